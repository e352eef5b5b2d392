#!/usr/bin/env bash
# install-real-drivers.sh — build the two real CSI drivers the end-to-end tests and the
# benchmarks run against, from the pinned, unmodified release sources in ../shared/peers
# (csi-driver-host-path -> hostpathplugin, csi-driver-nfs -> nfsplugin), offline
# (GOFLAGS=-mod=vendor GOPROXY=off), with a cache, and print the directory that holds the
# binaries as the LAST line of stdout. Everything else goes to stderr.
#
#   bin=$(scripts/install-real-drivers.sh | tail -n1)
#   "$bin/hostpathplugin" --endpoint unix:///tmp/hp.sock --nodeid n1 --statedir /tmp/hp
#
# Inputs: ${CUBE_CSI_BRIDGE_SHARED_PEERS:-<repo>/../shared/peers} with SHA256SUMS and the
# two archives. A missing or tampered input is an error, never a skip: CI must run these
# drivers. Nothing from the archives is copied into this repository; they are unpacked
# into a scratch directory under the cache and deleted after the build.
#
# Cache: ${CUBE_CSI_BRIDGE_REAL_DRIVERS_DIR:-/var/cache/cube-csi-bridge-real-drivers}/<key>/bin,
# <key> = sha256 of the Go version, SHA256SUMS and this script. Idempotent; a lock
# serialises concurrent runs. Entries unused for 14 days are pruned.
set -euo pipefail

log() { echo "install-real-drivers: $*" >&2; }
die() { log "error: $*"; exit 1; }

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
peers=${CUBE_CSI_BRIDGE_SHARED_PEERS:-$repo/../shared/peers}
cache_root=${CUBE_CSI_BRIDGE_REAL_DRIVERS_DIR:-/var/cache/cube-csi-bridge-real-drivers}
hostpath_tag=v1.18.0
nfs_tag=v4.13.4
hostpath_archive=csi-driver-host-path-$hostpath_tag.tar.xz
nfs_archive=csi-driver-nfs-$nfs_tag.tar.xz

[ -d "$peers" ] || die "$peers does not exist: the real CSI driver sources (../shared/peers beside the checkout, or \$CUBE_CSI_BRIDGE_SHARED_PEERS) are required"
[ -f "$peers/SHA256SUMS" ] || die "$peers/SHA256SUMS is missing"
for archive in "$hostpath_archive" "$nfs_archive"; do
	grep -q " $archive\$" "$peers/SHA256SUMS" || die "$peers/SHA256SUMS does not list $archive"
done

. "$repo/scripts/ensure-commands.sh"
ensure_commands sha256sum:coreutils tar:tar xz:xz-utils flock:util-linux
command -v go >/dev/null 2>&1 || die "go is not on PATH"

# Verify before anything else reads the archives.
(cd "$peers" && sha256sum --quiet -c SHA256SUMS) >&2 || die "checksums in $peers/SHA256SUMS do not match"

export GOTOOLCHAIN=local
goversion=$(go env GOVERSION)
key=$(
	{
		echo "$goversion"
		cat "$peers/SHA256SUMS"
		sha256sum "$repo/scripts/install-real-drivers.sh" | cut -d' ' -f1
	} | sha256sum | cut -c1-16
)
dir=$cache_root/$key
bins=(hostpathplugin nfsplugin)

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
	log "building hostpathplugin $hostpath_tag and nfsplugin $nfs_tag with $goversion into $dir"
	start=$(date +%s)
	tmp=$(mktemp -d "$cache_root/.build.XXXXXX")
	trap 'rm -rf "$tmp"' EXIT
	chmod 755 "$tmp"
	mkdir -p "$tmp/bin" "$tmp/src"
	tar -xJf "$peers/$hostpath_archive" -C "$tmp/src"
	tar -xJf "$peers/$nfs_archive" -C "$tmp/src"
	(
		export GOFLAGS=-mod=vendor GOPROXY=off
		cd "$tmp/src/csi-driver-host-path-$hostpath_tag"
		# hostpathplugin answers GetPluginInfo only with a link-time version.
		go build -trimpath -buildvcs=false -ldflags "-X main.version=$hostpath_tag" \
			-o "$tmp/bin/hostpathplugin" ./cmd/hostpathplugin
		cd "$tmp/src/csi-driver-nfs-$nfs_tag"
		go build -trimpath -buildvcs=false -o "$tmp/bin/nfsplugin" ./cmd/nfsplugin
	) >&2
	rm -rf "$tmp/src"
	# Smoke checks: both print their flags for -help (exit 0 or 2, Go's flag package).
	for b in "${bins[@]}"; do
		rc=0
		help=$("$tmp/bin/$b" -help 2>&1) || rc=$?
		{ [ "$rc" = 0 ] || [ "$rc" = 2 ]; } && [[ $help == *-endpoint* ]] ||
			die "built $b does not run (exit $rc)"
	done
	{
		echo "key=$key"
		echo "go=$goversion"
		echo "hostpathplugin=csi-driver-host-path $hostpath_tag (unmodified, -mod=vendor)"
		echo "nfsplugin=csi-driver-nfs $nfs_tag (unmodified, -mod=vendor)"
		echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
	} >"$tmp/BUILD-INFO"
	touch "$tmp/.complete"
	rm -rf "$dir"
	mv "$tmp" "$dir"
	trap - EXIT
	log "built in $(($(date +%s) - start)) s"
fi
touch "$dir"

find "$cache_root" -mindepth 1 -maxdepth 1 -type d -name '[0-9a-f]*' -mtime +14 \
	! -name "$key" -exec rm -rf {} + 2>/dev/null || true

echo "$dir/bin"
