#!/usr/bin/env bash
# install-python-peers.sh — a Python virtual environment with the pinned packages of
# tests/python/requirements.txt (grpcio, grpcio-tools: the grpc-core client of
# tests/any_grpc_client.rs), installed with pip, cached, and print its bin
# directory as the LAST line of stdout. Everything else goes to stderr.
#
#   bin=$(scripts/install-python-peers.sh | tail -n1)
#   "$bin/python" tests/python/cube_hooks.py unix:///run/cube-csi-bridge/nfs.sock proto
#
# Cache: ${CUBE_CSI_BRIDGE_PYTHON_PEERS_DIR:-/var/cache/cube-csi-bridge-python-peers}/<key>,
# <key> = sha256 of the interpreter's version, requirements.txt and this script. A
# complete entry is reused without running pip; a lock serialises concurrent runs.
# Entries unused for 14 days are pruned.
#
# Needs python3 with venv and ensurepip (Debian python3-venv is installed with apt-get
# when they are missing). Packages come through pip's configured index; only wheels are
# taken, so nothing is compiled.
set -euo pipefail

log() { echo "install-python-peers: $*" >&2; }
die() { log "error: $*"; exit 1; }

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
requirements=$repo/tests/python/requirements.txt
cache_root=${CUBE_CSI_BRIDGE_PYTHON_PEERS_DIR:-/var/cache/cube-csi-bridge-python-peers}

[ -f "$requirements" ] || die "missing $requirements"

. "$repo/scripts/ensure-commands.sh"
ensure_commands python3:python3 flock:util-linux sha256sum:coreutils
if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
	[ "$(id -u)" = 0 ] || die "python3 lacks venv/ensurepip and not root to install python3-venv"
	log "installing Debian package python3-venv"
	DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >&2
	python3 -c 'import venv, ensurepip' || die "python3 still lacks venv/ensurepip"
fi

python=$(command -v python3)
pyversion=$("$python" -c 'import sys; print(sys.version.split()[0])')
key=$(
	{
		echo "$pyversion"
		sha256sum "$requirements" "$repo/scripts/install-python-peers.sh" | cut -d' ' -f1
	} | sha256sum | cut -c1-16
)
dir=$cache_root/$key

mkdir -p "$cache_root"
exec 9>"$cache_root/.lock"
flock 9

# The pinned versions, as `name==version` lines.
pins() { grep -Ev '^[[:space:]]*(#|$)' "$requirements"; }

complete() {
	[ -f "$dir/.complete" ] && [ -x "$dir/bin/python" ]
}

if complete; then
	log "up to date: $dir (key $key)"
else
	log "creating a venv with Python $pyversion and $(pins | tr '\n' ' ')in $dir"
	start=$(date +%s)
	# A venv records its own path, so it is built where it stays; .complete marks it done.
	rm -rf "$dir"
	trap 'rm -rf "$dir"' EXIT
	"$python" -m venv "$dir" >&2
	"$dir/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
		--only-binary=:all: -r "$requirements" >&2
	# Smoke check: the pinned grpcio imports, and grpc_tools compiles a proto.
	want=$(pins | sed -n 's/^grpcio==//p')
	have=$("$dir/bin/python" -c 'import grpc, grpc_tools.protoc; print(grpc.__version__)')
	[ "$have" = "$want" ] || die "venv has grpcio $have, want $want"
	touch "$dir/.complete"
	trap - EXIT
	log "installed in $(($(date +%s) - start)) s"
fi
touch "$dir"

find "$cache_root" -mindepth 1 -maxdepth 1 -type d -name '[0-9a-f]*' -mtime +14 \
	! -name "$key" -exec rm -rf {} + 2>/dev/null || true

echo "$dir/bin"
