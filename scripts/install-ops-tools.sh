#!/usr/bin/env bash
# install-ops-tools.sh — the tools of cube-csi-bridge's operations checks, installed
# idempotently, and print the directory that holds cargo-deny as the LAST line of stdout.
# Everything else goes to stderr. Run as root (CI does); safe to run concurrently (a lock
# serialises builds).
#
#   bin=$(scripts/install-ops-tools.sh | tail -n1)
#   "$bin/cargo-deny" --locked check licenses bans sources    # deny.toml
#   cargo test --test systemd_units                            # uses systemd-analyze
#
# - systemd-analyze, from Debian's systemd package (installed with apt-get only when the
#   command is missing): tests/systemd_units.rs runs `systemd-analyze verify` on the units
#   in packaging/systemd. It works offline, with or without systemd running as PID 1.
# - cargo-deny $CARGO_DENY_VERSION, built from crates.io with `cargo install --locked` (its
#   own Cargo.lock, so the build is reproducible): the dependency check of scripts/test.sh.
#
# Cache: ${CUBE_CSI_BRIDGE_OPS_TOOLS_DIR:-/var/cache/cube-csi-bridge-ops-tools}/<key>/bin
# where <key> hashes the cargo-deny version, `rustc -vV` and this script. A complete entry
# is reused without running cargo at all (a cold build takes several minutes on 2 cores);
# a build goes to a temporary directory renamed into place once the binary runs.
# <root>/current is a symlink to the last entry installed or reused. Entries unused for 14
# days are pruned.
set -euo pipefail

log() { echo "install-ops-tools: $*" >&2; }
die() { log "error: $*"; exit 1; }

CARGO_DENY_VERSION=0.20.2

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
cache_root=${CUBE_CSI_BRIDGE_OPS_TOOLS_DIR:-/var/cache/cube-csi-bridge-ops-tools}

# --- Debian packages -------------------------------------------------------
. "$repo/scripts/ensure-commands.sh"
ensure_commands systemd-analyze:systemd flock:util-linux sha256sum:coreutils
command -v cargo >/dev/null 2>&1 || die "cargo is not on PATH"

# --- cache key -------------------------------------------------------------
key=$(
	{
		echo "cargo-deny $CARGO_DENY_VERSION"
		rustc -vV
		sha256sum "$repo/scripts/install-ops-tools.sh" | cut -d' ' -f1
	} | sha256sum | cut -c1-16
)
dir=$cache_root/$key

mkdir -p "$cache_root"
exec 9>"$cache_root/.lock"
flock 9

complete() {
	[ -f "$dir/.complete" ] && [ -x "$dir/bin/cargo-deny" ]
}

if complete; then
	log "up to date: $dir (key $key)"
else
	log "building cargo-deny $CARGO_DENY_VERSION into $dir (several minutes the first time)"
	start=$(date +%s)
	tmp=$(mktemp -d "$cache_root/.build.XXXXXX")
	trap 'rm -rf "$tmp"' EXIT
	chmod 755 "$tmp"
	# A private target dir, so nothing of the build is left outside the cache entry.
	CARGO_TARGET_DIR="$tmp/target" nice cargo install --locked --quiet \
		--root "$tmp" cargo-deny --version "=$CARGO_DENY_VERSION" >&2
	rm -rf "$tmp/target"
	# Smoke check: the binary runs and is the version asked for.
	version=$("$tmp/bin/cargo-deny" --version 2>&1) || die "built cargo-deny does not run: $version"
	[[ $version == *" $CARGO_DENY_VERSION"* ]] || die "built cargo-deny reports $version"
	{
		echo "key=$key"
		echo "cargo-deny=$CARGO_DENY_VERSION"
		rustc -V
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
