#!/usr/bin/env bash
# Runs the Java client built by build.sh: run.sh --address HOST:PORT [options] ["PROMPT"]
# (run.sh --help lists the options). Extra JVM options can be passed in JAVA_OPTS.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
if [ ! -f "$HERE/build/classpath" ] || [ ! -d "$HERE/build/classes" ]; then
  echo "clients/java/run.sh: not built yet; run clients/java/build.sh (or scripts/setup_clients.sh)" >&2
  exit 2
fi
# Java decodes the command line (a PROMPT) with the locale's charset: make it UTF-8 if it is not.
case "$(locale charmap 2>/dev/null || true)" in
  UTF-8) ;;
  *) export LC_ALL=C.UTF-8 ;;
esac
# A short-lived CLI: the client compiler and a serial GC start fastest.
# shellcheck disable=SC2086
exec java -XX:+UseSerialGC -XX:TieredStopAtLevel=1 ${JAVA_OPTS:-} \
  -cp "$HERE/build/classes:$(cat "$HERE/build/classpath")" dev.specdec.client.GenerateCli "$@"
