#!/usr/bin/env bash
# Installs what the Node and Java clients (clients/) need and builds them; safe to run again (fast
# when everything is there). Debian only; installs system packages, so it runs as root (or with sudo).
#   1. Debian packages: gRPC Java and the runtime jars it does not pull in itself (protobuf-java,
#      guava, netty, perfmark, gson, javax.annotation), protoc and its grpc-java plugin, a JDK if
#      javac is missing, Node.js and npm if node is missing; and Debian's prometheus package for its
#      promtool, with which tests/test_monitoring.py loads and unit-tests the alert rules.
#   2. npm ci in clients/node (skipped when node_modules matches package-lock.json).
#   3. clients/java/build.sh (skips itself when the build is up to date).
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf 'setup_clients: %s\n' "$*" >&2; }

JAVA_PACKAGES=(
  libgrpc-java
  libprotobuf-java
  libguava-java
  protobuf-compiler
  protobuf-compiler-grpc-java-plugin
  libnetty-java
  libperfmark-java
  libgoogle-gson-java
  libgeronimo-annotation-1.3-spec-java
)

# (Outputs are captured before matching: with pipefail, `cmd | grep -q` fails when grep stops early.)
installed() { [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null || true)" = 'install ok installed' ]; }
has_candidate() { [[ "$(apt-cache policy "$1" 2>/dev/null || true)" == *'Candidate: '[!\(]* ]]; }

missing=()
for pkg in "${JAVA_PACKAGES[@]}"; do
  installed "$pkg" || missing+=("$pkg")
done
command -v javac >/dev/null 2>&1 || missing+=(default-jdk-headless)
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  missing+=(nodejs npm)
fi
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)

if [ "${#missing[@]}" -gt 0 ]; then
  SUDO=()
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
      SUDO=(sudo env DEBIAN_FRONTEND=noninteractive)
    else
      log "need root (or sudo) to install: ${missing[*]}"
      exit 1
    fi
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt_install() { "${SUDO[@]}" apt-get install -y -q --no-install-recommends "$@"; }
  # apt-get update only when the package lists do not know a package we need; if the install
  # still fails (stale lists point at files the mirror no longer has), update once and retry.
  updated=0
  for pkg in "${missing[@]}"; do
    if ! has_candidate "$pkg"; then
      log "apt-get update (the package lists do not have $pkg)"
      "${SUDO[@]}" apt-get update -q
      updated=1
      break
    fi
  done
  log "apt-get install ${missing[*]}"
  if ! apt_install "${missing[@]}"; then
    if [ "$updated" -eq 1 ]; then
      log "apt-get install failed"
      exit 1
    fi
    log "apt-get install failed; apt-get update and retry"
    "${SUDO[@]}" apt-get update -q
    apt_install "${missing[@]}"
  fi
fi

# Node client: npm ci unless node_modules was installed from this very package-lock.json.
node_stamp=clients/node/node_modules/.specdec-lock.sha256
lock_sum=$(sha256sum clients/node/package-lock.json clients/node/package.json | sha256sum | cut -d' ' -f1)
if [ -f "$node_stamp" ] && [ "$(cat "$node_stamp")" = "$lock_sum" ]; then
  :
else
  log "npm ci in clients/node"
  (cd clients/node && npm ci --no-audit --no-fund --loglevel=error)
  echo "$lock_sum" >"$node_stamp"
fi

# Java client: generation + compilation (build.sh skips itself when up to date).
bash clients/java/build.sh
