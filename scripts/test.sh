#!/usr/bin/env bash
# The project's test command (README "Run the tests"; .ci/run calls exactly this).
# Installs what the tests need, idempotently, then checks formatting and lints and runs
# every test. Run it as root: the integration tests make real mounts (they skip
# themselves, loudly, when not root).
set -euo pipefail
cd "$(dirname "$0")/.."

# The Go Cube-like caller (tests/cube_callers.rs, tests/real_mounts.rs), csi-test's mock
# driver (tests/mock_driver.rs, the third-party CSI implementation) and grpcurl, built from
# Go modules once and cached. Every test peer comes from a package registry or this tree.
if ! command -v go >/dev/null 2>&1; then
    echo "scripts/test.sh: Go is needed to build the test peers in tests/peers" >&2
    exit 1
fi
CUBE_CSI_BRIDGE_PEERS_BIN="$(bash scripts/install-test-peers.sh | tail -n 1)"
export CUBE_CSI_BRIDGE_PEERS_BIN

# The Python grpcio client (tests/any_grpc_client.rs), in a venv built once and cached.
CUBE_CSI_BRIDGE_PYTHON_BIN="$(bash scripts/install-python-peers.sh | tail -n 1)"
export CUBE_CSI_BRIDGE_PYTHON_BIN

# A real kube-apiserver, etcd and helm (tests/kubernetes.rs, tests/helm_chart.rs), built
# from the Go module proxy once and cached. The first build is the longest step of a cold
# run, so it goes on in the background, beside the cargo installs and the Rust build, and
# is waited for just before the tests.
k8s_out=$(mktemp)
trap 'rm -f "$k8s_out"' EXIT
bash scripts/install-k8s-peers.sh >"$k8s_out" &
k8s_pid=$!

# systemd-analyze (tests/systemd_units.rs) from Debian, and cargo-deny (the dependency check
# below) built with `cargo install` once and cached.
CUBE_CSI_BRIDGE_OPS_BIN="$(bash scripts/install-ops-tools.sh | tail -n 1)"
export CUBE_CSI_BRIDGE_OPS_BIN

# cargo-fuzz (scripts/fuzz.sh below), built with `cargo install` once and cached.
CUBE_CSI_BRIDGE_FUZZ_BIN="$(bash scripts/install-fuzz-tools.sh | tail -n 1)"

cargo fmt --check
cargo clippy --locked --all-targets --all-features -- -D warnings
# Licences, bans and sources of Cargo.lock (deny.toml; advisories: see there).
bash scripts/check-deps.sh "$CUBE_CSI_BRIDGE_OPS_BIN"
# The fault-injection points are compiled in for the tests only: the crash matrix
# (tests/crash_matrix.rs) needs them and fails in CI without them.
cargo test --locked --features fault-injection --no-run
if ! wait "$k8s_pid"; then
    echo "scripts/test.sh: scripts/install-k8s-peers.sh failed (its log is above)" >&2
    exit 1
fi
CUBE_CSI_BRIDGE_K8S_BIN="$(tail -n 1 "$k8s_out")"
export CUBE_CSI_BRIDGE_K8S_BIN
# Every test binary runs even after one fails: one run names every failing test.
cargo test --locked --features fault-injection --no-fail-fast
# Each fuzz target (the parsers of what Cube and operators hand the bridge) for 20 s.
bash scripts/fuzz.sh "$CUBE_CSI_BRIDGE_FUZZ_BIN"
