#!/usr/bin/env bash
# Makes a development CA and certificates for mutual TLS between specdec's services:
#   ca.pem            the CA every service trusts (--tls-ca, --backend-tls-ca)
#   server.pem/.key   the draft's and target's certificate (names: localhost, draft, target, their headless Services, ...)
#   client.pem/.key   the coordinator's client certificate (--backend-tls-cert/--backend-tls-key)
# Usage: scripts/make_dev_certs.sh [OUT_DIR] [extra DNS names...]   (default OUT_DIR: ./certs)
set -euo pipefail
OUT=${1:-certs}
shift || true
mkdir -p "$OUT"
cd "$OUT"
SANS="DNS:localhost,IP:127.0.0.1,DNS:draft,DNS:target,DNS:draft-headless,DNS:target-headless,DNS:coordinator"
for name in "$@"; do SANS="$SANS,DNS:$name"; done
openssl req -x509 -newkey rsa:2048 -nodes -days 365 -subj "/CN=specdec-dev-ca" \
  -keyout ca.key -out ca.pem 2>/dev/null
for who in server client; do
  openssl req -newkey rsa:2048 -nodes -subj "/CN=specdec-$who" -keyout "$who.key" -out "$who.csr" 2>/dev/null
  printf 'subjectAltName=%s\nextendedKeyUsage=%s\n' "$SANS" "$([ "$who" = server ] && echo serverAuth || echo clientAuth)" > "$who.ext"
  openssl x509 -req -in "$who.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 365 \
    -extfile "$who.ext" -out "$who.pem" 2>/dev/null
  rm -f "$who.csr" "$who.ext"
done
chmod 600 ./*.key
echo "wrote $(pwd)/{ca,server,client}.pem and keys"
