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
# - cargo-deny $CARGO_DENY_VERSION, built with `cargo install --locked` (its
#   own Cargo.lock, so the build is reproducible): the dependency check of scripts/test.sh.
#
# Cache: ${CUBE_CSI_BRIDGE_OPS_TOOLS_DIR:-/var/cache/cube-csi-bridge-ops-tools}/<key>/bin
# where <key> hashes the cargo-deny version and `rustc -vV` (scripts/cargo-tool-cache.sh
# says how). A complete entry is reused without running cargo at all (a cold build takes
# several minutes on 2 cores).
set -euo pipefail

log() { echo "install-ops-tools: $*" >&2; }
die() { log "error: $*"; exit 1; }

CARGO_DENY_VERSION=0.20.2

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
cache_root=${CUBE_CSI_BRIDGE_OPS_TOOLS_DIR:-/var/cache/cube-csi-bridge-ops-tools}

# --- Debian packages -------------------------------------------------------
. "$repo/scripts/ensure-commands.sh"
. "$repo/scripts/cargo-tool-cache.sh"
ensure_commands systemd-analyze:systemd flock:util-linux sha256sum:coreutils

cargo_tool_cached cargo-deny "$CARGO_DENY_VERSION" "$cache_root"
