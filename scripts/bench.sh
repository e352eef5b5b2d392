#!/usr/bin/env bash
# The project's benchmark command (README "Benchmarks"; docs/benchmarks.md): installs the
# peers the suite drives (the Go Cube client with its bench mode, csi-test's mock driver,
# kube-apiserver + etcd; each cached by its installer), builds the bridge and the suite in
# release mode, and prints one table: every figure, its baseline measured in the same run,
# the ratio, the target and PASS/MISS. Benchmarks print; a missed target never fails.
#
#   scripts/bench.sh                 # the full suite (several minutes on 2 cores)
#   scripts/bench.sh --quick         # fewer iterations
#   scripts/bench.sh --only hot,ready
#   scripts/bench.sh --profile DIR   # strace/perf of the hot, first-Attach and Create paths, and storms
#
# Run as root: the suite mounts (in a private mount namespace of its own).
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "bench: $*" >&2; }
die() { log "error: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root: the suite makes real mounts"
command -v go >/dev/null 2>&1 || die "Go is needed to build the Go Cube client in tests/peers"

for arg in "$@"; do
	if [ "$arg" = --profile ]; then
		. scripts/ensure-commands.sh
		ensure_commands strace:strace perf:linux-perf
	fi
done

CUBE_CSI_BRIDGE_PEERS_BIN="$(bash scripts/install-test-peers.sh | tail -n 1)"
CUBE_CSI_BRIDGE_K8S_BIN="$(bash scripts/install-k8s-peers.sh | tail -n 1)"
export CUBE_CSI_BRIDGE_PEERS_BIN CUBE_CSI_BRIDGE_K8S_BIN

# The bench profile is the release profile; this builds target/release/cube-csi-bridge too.
cargo bench --locked --bench suite -- "$@"
