#!/usr/bin/env bash
# install-test-peers.sh — build the Go test peers of cube-csi-bridge's
# end-to-end tests (tests/cube_callers.rs): cubeclient (tests/peers/cubeclient,
# a Cube-like caller that drives the bridge), csi-mock (the Kubernetes CSI
# mock driver, cmd/mock-driver of csi-test v4.2.0, a `tool` of tests/peers'
# go.mod) and grpcurl (v1.9.4, the `tool` of tests/peers/grpcurl/go.mod, for
# tests/any_grpc_client.rs), with a cache, and print the directory that holds
# them as the LAST line of stdout.
# Everything else goes to stderr. Run as root (CI does); idempotent; safe to
# run concurrently (a lock serialises builds).
#
#   bin=$(scripts/install-test-peers.sh | tail -n1)
#   "$bin/cubeclient" rpc --target /path/to/bridge.sock create --volume-id v1 --name v1
#   CSI_ENDPOINT=/path/to/mock.sock "$bin/csi-mock" -name=mock.csi.test -v=5
#   CUBE_CSI_BRIDGE_PEERS_BIN=$bin cargo test --test cube_callers
#
# Cache: ${CUBE_CSI_BRIDGE_PEERS_DIR:-/var/cache/cube-csi-bridge-test-peers}/<key>/bin
# where <key> hashes the Go version, tests/peers' go.mod, go.sum and Go
# sources, the Cube proto and this script. A current entry is reused without
# running go at all; <root>/current is a symlink to the last entry installed
# or reused (the printed path is the keyed one, which stays right even when
# several checkouts share the cache). Entries unused for 14 days are pruned.
#
# Needs: go (1.26+), and from Debian util-linux + mount (unshare, nsenter,
# findmnt, mountpoint, flock, setsid, mount, umount; installed with apt-get
# when missing, apt-get update only then). Modules come through the go
# command's configured module proxy; nothing else is downloaded.
#
# The shell helpers (tests/peers/cubelet-ns.sh, shared-dir.sh) are used in
# place from the checkout; they are not copied.
set -euo pipefail

log() { echo "install-test-peers: $*" >&2; }
die() { log "error: $*"; exit 1; }

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
peers=$repo/tests/peers
proto=$repo/proto/cube/v1/volumeplugin.proto
cache_root=${CUBE_CSI_BRIDGE_PEERS_DIR:-/var/cache/cube-csi-bridge-test-peers}
bins=(cubeclient csi-mock grpcurl)
# csi-mock's package; its version is the one tests/peers/go.mod requires.
csi_mock_pkg=github.com/kubernetes-csi/csi-test/v4/cmd/mock-driver
# grpcurl's package; its version is the one tests/peers/grpcurl/go.mod requires.
grpcurl_pkg=github.com/fullstorydev/grpcurl/cmd/grpcurl

[ -f "$peers/go.mod" ] || die "missing $peers/go.mod"
[ -f "$proto" ] || die "missing $proto"

# --- Debian packages -------------------------------------------------------
. "$repo/scripts/ensure-commands.sh"
ensure_commands mount:mount umount:mount findmnt:util-linux mountpoint:util-linux \
	unshare:util-linux nsenter:util-linux flock:util-linux setsid:util-linux \
	sha256sum:coreutils base64:coreutils
command -v go >/dev/null 2>&1 || die "go is not on PATH"

# --- cache key -------------------------------------------------------------
export GOTOOLCHAIN=local
goversion=$(go env GOVERSION)
key=$(
	cd "$repo"
	{
		echo "$goversion"
		echo "${bins[*]}"
		sha256sum scripts/install-test-peers.sh proto/cube/v1/volumeplugin.proto
		find tests/peers \( -name '*.go' -o -name go.mod -o -name go.sum \) -type f -print0 |
			LC_ALL=C sort -z | xargs -0 sha256sum
	} | sha256sum | cut -c1-16
)
dir=$cache_root/$key

mkdir -p "$cache_root"
exec 9>"$cache_root/.lock"
flock 9

complete() {
	[ -f "$dir/.complete" ] || return 1
	local b
	for b in "${bins[@]}"; do [ -x "$dir/bin/$b" ] || return 1; done
}

if complete; then
	log "up to date: $dir (key $key)"
else
	log "building test peers with $goversion into $dir"
	start=$(date +%s)
	tmp=$(mktemp -d "$cache_root/.build.XXXXXX")
	trap 'rm -rf "$tmp"' EXIT
	chmod 755 "$tmp"
	mkdir -p "$tmp/bin"
	(
		cd "$peers"
		# -mod=readonly: go.sum must already be complete (it is committed).
		go build -mod=readonly -trimpath -buildvcs=false \
			-ldflags "-X main.protoB64=$(base64 -w0 "$proto")" \
			-o "$tmp/bin/" ./cubeclient
		go build -mod=readonly -trimpath -buildvcs=false \
			-o "$tmp/bin/csi-mock" "$csi_mock_pkg"
		cd grpcurl
		grpcurl_version=$(go list -mod=readonly -f '{{.Module.Version}}' "$grpcurl_pkg")
		go build -mod=readonly -trimpath -buildvcs=false \
			-ldflags "-X main.version=$grpcurl_version" \
			-o "$tmp/bin/grpcurl" "$grpcurl_pkg"
	) >&2
	# Smoke checks: cubeclient's usage errors exit 2, csi-mock's -help exits
	# 0 listing its flags; anything else means a broken build.
	rc=0
	"$tmp/bin/cubeclient" >/dev/null 2>&1 || rc=$?
	[ "$rc" = 2 ] || die "built cubeclient does not run (exit $rc)"
	rc=0
	help=$("$tmp/bin/csi-mock" -help 2>&1) || rc=$?
	[ "$rc" = 0 ] && [[ $help == *-disable-attach* ]] ||
		die "built csi-mock does not run (exit $rc)"
	rc=0
	help=$("$tmp/bin/grpcurl" -help 2>&1) || rc=$?
	[ "$rc" = 0 ] && [[ $help == *-authority* ]] ||
		die "built grpcurl does not run (exit $rc)"
	csi_mock_mod=$(cd "$peers" && go list -mod=readonly -f '{{.Module.Path}}@{{.Module.Version}}' "$csi_mock_pkg")
	{
		echo "key=$key"
		echo "go=$goversion"
		echo "csi-mock=$csi_mock_pkg from $csi_mock_mod"
		echo "grpcurl=$grpcurl_pkg from $(cd "$peers/grpcurl" && go list -mod=readonly -f '{{.Module.Path}}@{{.Module.Version}}' "$grpcurl_pkg")"
		echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
	} >"$tmp/BUILD-INFO"
	touch "$tmp/.complete"
	rm -rf "$dir"
	mv "$tmp" "$dir"
	trap - EXIT
	log "built in $(($(date +%s) - start)) s"
fi
touch "$dir"
ln -sfn "$key" "$cache_root/.current.tmp"
mv -T "$cache_root/.current.tmp" "$cache_root/current"

# Prune entries unused for 14 days (never the one just used).
find "$cache_root" -mindepth 1 -maxdepth 1 -type d -name '[0-9a-f]*' -mtime +14 \
	! -name "$key" -exec rm -rf {} + 2>/dev/null || true

echo "$dir/bin"
