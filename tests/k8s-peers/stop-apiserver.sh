#!/usr/bin/env bash
# stop-apiserver.sh <workdir> — stop what start-apiserver.sh <workdir> started:
# the pids in <workdir>/pids, newest first (kube-apiserver, then etcd), with
# SIGTERM, then SIGKILL for any still there after 10 s. A pid is only signalled
# while its command line still names <workdir>, so a recycled pid is left
# alone. Idempotent: nothing to stop is not an error. The workdir (logs, etcd
# data) is kept for inspection.
set -euo pipefail

log() { echo "stop-apiserver: $*" >&2; }

[ $# = 1 ] || { log "usage: stop-apiserver.sh <workdir>"; exit 2; }
[ -d "$1" ] || exit 0
wd=$(cd "$1" && pwd -P)
[ -f "$wd/pids" ] || exit 0

# Both servers' flags name files under <workdir>/.
ours() { grep -qF "$wd/" "/proc/$1/cmdline" 2>/dev/null; }

mapfile -t all <"$wd/pids"
pids=()
for ((i = ${#all[@]} - 1; i >= 0; i--)); do
	pid=${all[i]//[^0-9]/}
	[ -n "$pid" ] && ours "$pid" && pids+=("$pid")
done

for pid in "${pids[@]}"; do
	kill -TERM "$pid" 2>/dev/null || continue
	# Give each a moment, so kube-apiserver goes before the etcd it uses.
	for _ in $(seq 50); do ours "$pid" || break; sleep 0.2; done
done
for pid in "${pids[@]}"; do
	if ours "$pid"; then
		log "pid $pid did not stop on SIGTERM; killing it"
		kill -KILL "$pid" 2>/dev/null || true
	fi
done
for pid in "${pids[@]}"; do
	for _ in $(seq 25); do ours "$pid" || break; sleep 0.2; done
	! ours "$pid" || { log "error: pid $pid is still running"; exit 1; }
done
rm -f "$wd/pids"
