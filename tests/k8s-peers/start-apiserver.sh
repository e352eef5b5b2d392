#!/usr/bin/env bash
# start-apiserver.sh <workdir> <bin-dir> — start a throwaway Kubernetes API
# (etcd + kube-apiserver, no controllers, no nodes) on loopback, and print the
# path of an admin kubeconfig for it as the LAST line of stdout. Progress and
# errors go to stderr. Stop it with stop-apiserver.sh <workdir>.
#
# <bin-dir> holds kube-apiserver and etcd (scripts/install-k8s-peers.sh prints
# it). Every start is a fresh cluster: <workdir>'s etcd data and keys from an
# earlier run are replaced. Both servers run in the background with all their
# output in <workdir>/etcd.log and <workdir>/kube-apiserver.log, so a caller
# that captures this script's output (a Rust test) is not held up by them.
#
# <workdir> afterwards:
#   kubeconfig     admin kubeconfig (real CA data, bearer token, current-context)
#   pids           etcd's and kube-apiserver's pids, one per line
#   env            KUBE_APISERVER_URL=, KUBE_ADMIN_TOKEN=, KUBE_CA_FILE=, ETCD_URL=
#   token          the admin bearer token (user "admin", group system:masters)
#   pki/           ca.crt/ca.key, the serving cert, the service-account key pair
#
# Needs openssl, python3 and curl (scripts/install-k8s-peers.sh installs them).
set -euo pipefail

log() { echo "start-apiserver: $*" >&2; }
die() { log "error: $*"; exit 1; }

[ $# = 2 ] || die "usage: start-apiserver.sh <workdir> <bin-dir>"
mkdir -p "$1"
wd=$(cd "$1" && pwd -P)
bin=$(cd "$2" && pwd -P)
for b in etcd kube-apiserver; do [ -x "$bin/$b" ] || die "no $b in $bin"; done
for c in openssl python3 curl; do command -v "$c" >/dev/null || die "$c is not on PATH"; done

# Refuse to start over a cluster that is still running from this workdir.
if [ -s "$wd/pids" ]; then
	while read -r pid; do
		if [ -n "$pid" ] && grep -qF "$wd/" "/proc/$pid/cmdline" 2>/dev/null; then
			die "already running from $wd (pid $pid); run stop-apiserver.sh $wd first"
		fi
	done <"$wd/pids"
fi
rm -rf "$wd/etcd-data" "$wd/pki" "$wd/pids" "$wd/kubeconfig" "$wd/env" "$wd/token"
mkdir -p "$wd/pki"
chmod 700 "$wd/pki"

# --- ports: three free loopback ports, held open together so they differ ---
read -r etcd_port peer_port api_port < <(python3 -c '
import socket
socks = []
for _ in range(3):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(*(s.getsockname()[1] for s in socks))
')
[ -n "${api_port:-}" ] || die "could not pick free ports"

# --- keys and certificates ---------------------------------------------------
pki=$wd/pki
ossl() { openssl "$@" 2>"$pki/openssl.err" || { cat "$pki/openssl.err" >&2; die "openssl $1 failed"; }; }
# CA, and the apiserver's serving certificate signed by it.
ossl ecparam -name prime256v1 -genkey -noout -out "$pki/ca.key"
ossl req -x509 -new -key "$pki/ca.key" -sha256 -days 3650 -subj "/CN=cube-csi-bridge-test-ca" \
	-addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
	-out "$pki/ca.crt"
ossl ecparam -name prime256v1 -genkey -noout -out "$pki/apiserver.key"
ossl req -new -key "$pki/apiserver.key" -subj "/CN=kube-apiserver" -out "$pki/apiserver.csr"
cat >"$pki/apiserver.ext" <<'EOF'
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local
EOF
ossl x509 -req -in "$pki/apiserver.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
	-sha256 -days 3650 -extfile "$pki/apiserver.ext" -out "$pki/apiserver.crt"
# Service-account token signing key pair (TokenRequest, bound tokens).
ossl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$pki/sa.key"
ossl pkey -in "$pki/sa.key" -pubout -out "$pki/sa.pub"
rm -f "$pki/openssl.err" "$pki/apiserver.csr"

# Static admin token: user "admin" in group system:masters (all rights).
token=$(openssl rand -hex 32)
echo "$token,admin,admin,system:masters" >"$pki/tokens.csv"
chmod 600 "$pki/tokens.csv"
(umask 077 && echo "$token" >"$wd/token")

# --- processes ----------------------------------------------------------------
# Whatever ends this script before the cluster is ready (an error, a signal)
# stops what it started.
stop=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)/stop-apiserver.sh
pids=()
ready=0
trap '[ $ready = 1 ] || bash "$stop" "$wd" >&2 || true' EXIT
trap 'exit 130' INT TERM HUP
fail() {
	log "error: $*"
	local f n
	for f in etcd.log:15 kube-apiserver.log:40; do
		n=${f#*:} f=$wd/${f%:*}
		[ -f "$f" ] || continue
		echo "----- last $n lines of $f -----" >&2
		tail -n "$n" "$f" >&2
	done
	exit 1
}
alive() { kill -0 "$1" 2>/dev/null; }

etcd_url=http://127.0.0.1:$etcd_port
log "starting etcd on $etcd_url"
"$bin/etcd" \
	--name=test \
	--data-dir="$wd/etcd-data" \
	--listen-client-urls="$etcd_url" \
	--advertise-client-urls="$etcd_url" \
	--listen-peer-urls="http://127.0.0.1:$peer_port" \
	--initial-advertise-peer-urls="http://127.0.0.1:$peer_port" \
	--initial-cluster="test=http://127.0.0.1:$peer_port" \
	--initial-cluster-state=new \
	--unsafe-no-fsync \
	</dev/null >"$wd/etcd.log" 2>&1 &
pids+=($!)
echo "$!" >"$wd/pids"

deadline=$((SECONDS + 30))
until curl -fsS --max-time 2 "$etcd_url/health" 2>/dev/null | grep -q '"health":"true"'; do
	alive "${pids[0]}" || fail "etcd exited"
	[ $SECONDS -lt $deadline ] || fail "etcd not healthy after 30 s"
	sleep 0.2
done

api_url=https://127.0.0.1:$api_port
log "starting kube-apiserver on $api_url"
"$bin/kube-apiserver" \
	--bind-address=127.0.0.1 \
	--advertise-address=127.0.0.1 \
	--secure-port="$api_port" \
	--etcd-servers="$etcd_url" \
	--cert-dir="$pki" \
	--tls-cert-file="$pki/apiserver.crt" \
	--tls-private-key-file="$pki/apiserver.key" \
	--token-auth-file="$pki/tokens.csv" \
	--authorization-mode=RBAC \
	--service-account-issuer=https://kubernetes.default.svc.cluster.local \
	--service-account-key-file="$pki/sa.pub" \
	--service-account-signing-key-file="$pki/sa.key" \
	--service-cluster-ip-range=10.96.0.0/16 \
	--allow-privileged=true \
	--disable-admission-plugins=ServiceAccount \
	--endpoint-reconciler-type=none \
	--profiling=false \
	</dev/null >"$wd/kube-apiserver.log" 2>&1 &
pids+=($!)
echo "$!" >>"$wd/pids"

# Ready: /readyz says ok and the bootstrap controller has made "default".
ca=$pki/ca.crt
api() { curl -fsS --max-time 5 --cacert "$ca" -H "Authorization: Bearer $token" "$api_url$1"; }
deadline=$((SECONDS + 90))
until [ "$(api /readyz 2>/dev/null)" = ok ] && api /api/v1/namespaces/default >/dev/null 2>&1; do
	alive "${pids[0]}" || fail "etcd exited"
	alive "${pids[1]}" || fail "kube-apiserver exited"
	[ $SECONDS -lt $deadline ] || fail "kube-apiserver not ready after 90 s"
	sleep 0.5
done

# --- kubeconfig ---------------------------------------------------------------
cat >"$wd/env" <<EOF
KUBE_APISERVER_URL=$api_url
KUBE_ADMIN_TOKEN=$token
KUBE_CA_FILE=$ca
ETCD_URL=$etcd_url
EOF
(
	umask 077
	cat >"$wd/kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: test
  cluster:
    server: $api_url
    certificate-authority-data: $(base64 -w0 "$ca")
users:
- name: admin
  user:
    token: $token
contexts:
- name: test
  context:
    cluster: test
    user: admin
    namespace: default
current-context: test
EOF
)
ready=1
log "ready: $api_url (pids ${pids[*]}, logs in $wd)"
echo "$wd/kubeconfig"
