#!/bin/sh
# Make the files deploy/kustomization.yaml turns into the millwheel-auth and
# millwheel-tls Secrets: a client token, an operator token (rescale, savepoints, stop,
# drain, restore, replay: docs/service.md, Security), a cluster secret, a CA, one certificate for
# the controller and every worker (DNS name "millwheel", MILLWHEEL_TLS_SERVER_NAME) and
# one client certificate for users (user.crt/user.key, for the CLI with --tls-*).
# Run once from anywhere; it refuses to overwrite. Keep ca.key offline afterwards.
set -eu
cd "$(dirname "$0")"
[ -e client-token ] && { echo "deploy/secrets already holds secrets: remove them first" >&2; exit 1; }
umask 077
token() { python3 -c 'import secrets; print(secrets.token_urlsafe(32))'; }
token > client-token
token > operator-token
token > cluster-secret
ec="-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes"
openssl req -x509 $ec -keyout ca.key -out ca.crt -days 825 -subj "/CN=millwheel CA" 2>/dev/null
issue() {  # name, subject alternative names
    openssl req $ec -keyout "$1.key" -out "$1.csr" -subj "/CN=$1" 2>/dev/null
    printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n' "$2" > "$1.ext"
    openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 825 \
        -extfile "$1.ext" -out "$1.crt" 2>/dev/null
    rm -f "$1.csr" "$1.ext"
}
issue tls "DNS:millwheel,DNS:localhost,IP:127.0.0.1"
issue user "DNS:millwheel-user"
echo "wrote client-token, operator-token, cluster-secret, ca.crt (+ ca.key), tls.crt/tls.key, user.crt/user.key in $(pwd)"
