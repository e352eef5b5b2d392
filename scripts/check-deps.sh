#!/usr/bin/env bash
# check-deps.sh — the dependency check of Cargo.lock: cargo-deny's licences, bans and sources
# checks against deny.toml. Advisories are not checked (no reachable advisory database; see
# the top of deny.toml). Exits non-zero on any finding.
#
#   scripts/check-deps.sh <dir holding cargo-deny> [config, default deny.toml]
#
# The crate graph is the one of the platforms deny.toml names, from `cargo metadata
# --locked` (Cargo.lock must not change); crates not yet downloaded come from crates.io.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
bin=${1:?usage: check-deps.sh <dir holding cargo-deny> [config]}
config=${2:-$repo/deny.toml}

metadata=$(mktemp)
trap 'rm -f "$metadata"' EXIT
# Only the Linux targets the bridge is built for: without the filter cargo would need the
# sources of every other platform's dependencies (Windows crates and the like).
cargo metadata --manifest-path "$repo/Cargo.toml" --format-version 1 --locked \
	--filter-platform x86_64-unknown-linux-gnu --filter-platform aarch64-unknown-linux-gnu \
	>"$metadata"
"$bin/cargo-deny" --color never --metadata-path "$metadata" \
	--manifest-path "$repo/Cargo.toml" --config "$config" \
	check licenses bans sources
