#!/usr/bin/env bash
# Builds the Java client into clients/java/build/:
#   1. protoc --java_out --grpc-java_out generates code from protos/specdec.proto (build/generated);
#   2. javac compiles it with src/ against Debian's jars in /usr/share/java (build/classes);
#   3. build/classpath lists the jars run.sh needs at run time.
# Does nothing when the build is up to date (same proto, sources, script, tools and jars).
# Needs the Debian packages that scripts/setup_clients.sh installs.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
BUILD=$HERE/build
PROTO_DIR=$ROOT/protos
PROTO=$PROTO_DIR/specdec.proto
JARS=${SPECDEC_JAVA_JARS:-/usr/share/java}
PROTOC=${PROTOC:-protoc}
PLUGIN=${GRPC_JAVA_PLUGIN:-/usr/bin/grpc_java_plugin}

fail() { printf 'clients/java/build.sh: %s\n' "$*" >&2; exit 1; }

# The jars the client compiles and runs against, and the Debian package of each.
declare -A JAR_PACKAGES=(
  [grpc-api]=libgrpc-java [grpc-context]=libgrpc-java [grpc-core]=libgrpc-java
  [grpc-netty]=libgrpc-java [grpc-protobuf]=libgrpc-java [grpc-protobuf-lite]=libgrpc-java
  [grpc-stub]=libgrpc-java
  [protobuf]=libprotobuf-java [guava]=libguava-java [gson]=libgoogle-gson-java
  [perfmark-api]=libperfmark-java [geronimo-annotation-1.3-spec]=libgeronimo-annotation-1.3-spec-java
  [netty-buffer]=libnetty-java [netty-codec]=libnetty-java [netty-codec-http]=libnetty-java
  [netty-codec-http2]=libnetty-java [netty-codec-socks]=libnetty-java [netty-common]=libnetty-java
  [netty-handler]=libnetty-java [netty-handler-proxy]=libnetty-java [netty-resolver]=libnetty-java
  [netty-transport]=libnetty-java
)

command -v "$PROTOC" >/dev/null 2>&1 || fail "protoc not found (apt-get install protobuf-compiler, or run scripts/setup_clients.sh)"
[ -x "$PLUGIN" ] || fail "$PLUGIN not found (apt-get install protobuf-compiler-grpc-java-plugin)"
command -v javac >/dev/null 2>&1 || fail "javac not found (apt-get install default-jdk-headless)"
classpath=()
missing=()
for jar in $(printf '%s\n' "${!JAR_PACKAGES[@]}" | sort); do
  if [ -f "$JARS/$jar.jar" ]; then
    classpath+=("$JARS/$jar.jar")
  else
    missing+=("${JAR_PACKAGES[$jar]}")
  fi
done
[ "${#missing[@]}" -eq 0 ] || fail "missing jars in $JARS; apt-get install $(printf '%s\n' "${missing[@]}" | sort -u | tr '\n' ' ')"
CLASSPATH_JARS=$(IFS=:; echo "${classpath[*]}")

mapfile -t SOURCES < <(find "$HERE/src/main/java" -name '*.java' | sort)

# Up to date? The stamp hashes every input, including the versions the jars resolve to.
inputs_sum=$(
  {
    sha256sum "$PROTO" "$0" "${SOURCES[@]}"
    "$PROTOC" --version
    sha256sum "$PLUGIN"
    javac -version 2>&1
    for jar in "${classpath[@]}"; do readlink -f "$jar"; done
  } | sha256sum | cut -d' ' -f1
)
if [ -f "$BUILD/.stamp" ] && [ "$(cat "$BUILD/.stamp")" = "$inputs_sum" ] && [ -f "$BUILD/classpath" ]; then
  exit 0
fi

echo "clients/java/build.sh: building into $BUILD" >&2
rm -rf "$BUILD"
mkdir -p "$BUILD/generated" "$BUILD/classes"
"$PROTOC" --plugin=protoc-gen-grpc-java="$PLUGIN" -I "$PROTO_DIR" \
  --java_out="$BUILD/generated" --grpc-java_out="$BUILD/generated" "$PROTO"
mapfile -t GENERATED < <(find "$BUILD/generated" -name '*.java' | sort)
# -nowarn: the generated code uses APIs that javac flags (deprecations, unchecked casts).
javac -nowarn -encoding UTF-8 --release 11 -cp "$CLASSPATH_JARS" -d "$BUILD/classes" \
  "${GENERATED[@]}" "${SOURCES[@]}"
echo "$CLASSPATH_JARS" >"$BUILD/classpath"
echo "$inputs_sum" >"$BUILD/.stamp"
