#!/usr/bin/env bash
# install-fuzz-tools.sh — cargo-fuzz, for the fuzz targets in fuzz/ (scripts/fuzz.sh), built
# with `cargo install` once and cached; prints the directory that holds it as the LAST line of
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
# where <key> hashes the cargo-fuzz version and `rustc -vV` (scripts/cargo-tool-cache.sh
# says how). A complete entry is reused without running cargo at all.
set -euo pipefail

log() { echo "install-fuzz-tools: $*" >&2; }
die() { log "error: $*"; exit 1; }

CARGO_FUZZ_VERSION=0.13.2

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
cache_root=${CUBE_CSI_BRIDGE_FUZZ_TOOLS_DIR:-/var/cache/cube-csi-bridge-fuzz-tools}

# --- Debian packages -------------------------------------------------------
. "$repo/scripts/ensure-commands.sh"
. "$repo/scripts/cargo-tool-cache.sh"
ensure_commands c++:g++ flock:util-linux sha256sum:coreutils

cargo_tool_cached cargo-fuzz "$CARGO_FUZZ_VERSION" "$cache_root"
