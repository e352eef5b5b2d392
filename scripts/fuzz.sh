#!/usr/bin/env bash
# fuzz.sh — runs every cargo-fuzz target in fuzz/ (the parsers of what Cube, operators and
# socket peers hand the bridge: the binary hook's argv, private_data, Detach metadata, the
# config, the HTTP/2 stream the :authority filter reads) for a
# bounded time each, starting from the committed seed corpora, and fails on any crash
# (the crashing input is kept under fuzz/artifacts/<target>/).
#
#   scripts/fuzz.sh <dir holding cargo-fuzz>     # from scripts/install-fuzz-tools.sh
#
# CUBE_CSI_BRIDGE_FUZZ_SECS (default 20) is each target's time. The targets are built with
# the default toolchain, stable included: cargo-fuzz passes rustc a few unstable flags, which
# RUSTC_BOOTSTRAP=1 allows. No sanitizer (the targets are safe Rust; panics, overflow checks
# and debug assertions are what finds bugs there), so no nightly-only runtime is needed.
# libFuzzer itself is compiled by the libfuzzer-sys crate (needs a C++ compiler).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
bin=${1:?usage: fuzz.sh <dir holding cargo-fuzz>}
secs=${CUBE_CSI_BRIDGE_FUZZ_SECS:-20}
export PATH="$bin:$PATH"
export RUSTC_BOOTSTRAP=1

cd "$repo/fuzz"
flags=(--sanitizer none --debug-assertions)
nice cargo fuzz build "${flags[@]}" >&2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for target in $(cargo fuzz list); do
	# The seeds are copied: what the run discovers is not kept in the tree.
	mkdir -p "$work/$target"
	cp corpus/"$target"/seed-* "$work/$target/"
	echo "fuzz.sh: $target for ${secs}s" >&2
	if ! cargo fuzz run "${flags[@]}" "$target" "$work/$target" -- \
		-max_total_time="$secs" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
		>"$work/$target.log" 2>&1; then
		tail -n 60 "$work/$target.log" >&2
		echo "fuzz.sh: $target found a crash; the input is in fuzz/artifacts/$target/" >&2
		exit 1
	fi
	grep -E '^stat::number_of_executed_units|^Done' "$work/$target.log" | sed "s/^/fuzz.sh: $target: /" >&2 || true
done
echo "fuzz.sh: no crash in $(cargo fuzz list | wc -l) targets" >&2
