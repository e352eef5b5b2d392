#!/usr/bin/env bash
# install-fuzz-tools.sh — cargo-fuzz, for the fuzz targets in fuzz/ (scripts/fuzz.sh), built
# from crates.io once and cached; prints the directory that holds it as the LAST line of
# stdout. Everything else goes to stderr. Run as root (CI does); idempotent; safe to run
# concurrently (a lock serialises builds).
#
#   bin=$(scripts/install-fuzz-tools.sh | tail -n1)
#   bash scripts/fuzz.sh "$bin"
#
# - cargo-fuzz $CARGO_FUZZ_VERSION, built with `cargo install --locked` (its own Cargo.lock).
#   It needs no nightly toolchain to build; the fuzz targets are built by scripts/fuzz.sh
#   with the toolchain at hand (see there).
# - a C++ compiler (Debian g++, installed with apt-get only when missing): libfuzzer-sys
#   compiles libFuzzer from its bundled sources.
#
# Cache: ${CUBE_CSI_BRIDGE_FUZZ_TOOLS_DIR:-/var/cache/cube-csi-bridge-fuzz-tools}/<key>/bin
# where <key> hashes the cargo-fuzz version, `rustc -vV` and this script. A complete entry
# is reused without running cargo at all; a build goes to a temporary directory renamed
# into place once the binary runs. <root>/current is a symlink to the last entry installed
# or reused. Entries unused for 14 days are pruned.
set -euo pipefail

log() { echo "install-fuzz-tools: $*" >&2; }
die() { log "error: $*"; exit 1; }

CARGO_FUZZ_VERSION=0.13.2

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
cache_root=${CUBE_CSI_BRIDGE_FUZZ_TOOLS_DIR:-/var/cache/cube-csi-bridge-fuzz-tools}

# --- Debian packages -------------------------------------------------------
. "$repo/scripts/ensure-commands.sh"
ensure_commands c++:g++ flock:util-linux sha256sum:coreutils
command -v cargo >/dev/null 2>&1 || die "cargo is not on PATH"

# --- cache key -------------------------------------------------------------
key=$(
	{
		echo "cargo-fuzz $CARGO_FUZZ_VERSION"
		rustc -vV
		sha256sum "$repo/scripts/install-fuzz-tools.sh" | cut -d' ' -f1
	} | sha256sum | cut -c1-16
)
dir=$cache_root/$key

mkdir -p "$cache_root"
exec 9>"$cache_root/.lock"
flock 9

complete() {
	[ -f "$dir/.complete" ] && [ -x "$dir/bin/cargo-fuzz" ]
}

if complete; then
	log "up to date: $dir (key $key)"
else
	log "building cargo-fuzz $CARGO_FUZZ_VERSION into $dir (a few minutes the first time)"
	start=$(date +%s)
	tmp=$(mktemp -d "$cache_root/.build.XXXXXX")
	trap 'rm -rf "$tmp"' EXIT
	chmod 755 "$tmp"
	# A private target dir, so nothing of the build is left outside the cache entry.
	CARGO_TARGET_DIR="$tmp/target" nice cargo install --locked --quiet \
		--root "$tmp" cargo-fuzz --version "=$CARGO_FUZZ_VERSION" >&2
	rm -rf "$tmp/target"
	# Smoke check: the binary runs and is the version asked for.
	version=$("$tmp/bin/cargo-fuzz" --version 2>&1) || die "built cargo-fuzz does not run: $version"
	[[ $version == *" $CARGO_FUZZ_VERSION"* ]] || die "built cargo-fuzz reports $version"
	{
		echo "key=$key"
		echo "cargo-fuzz=$CARGO_FUZZ_VERSION"
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
