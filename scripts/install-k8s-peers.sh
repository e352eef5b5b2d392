#!/usr/bin/env bash
# install-k8s-peers.sh — build the Kubernetes peers that cube-csi-bridge's
# integration tests run on loopback (a real kube-apiserver, the etcd it stores
# into, and helm 3), with a cache, and print the directory that holds them as
# the LAST line of stdout. Everything else goes to stderr. Run as root (CI
# does); idempotent; safe to run concurrently (a lock serialises builds).
#
#   bin=$(scripts/install-k8s-peers.sh | tail -n1)
#   kubeconfig=$(bash tests/k8s-peers/start-apiserver.sh /tmp/k8s "$bin" | tail -n1)
#   KUBECONFIG=$kubeconfig "$bin/helm" list -A
#   bash tests/k8s-peers/stop-apiserver.sh /tmp/k8s
#
# What is built, and from which modules: tests/k8s-peers/README.md. The
# versions are the ones pinned in tests/k8s-peers/go.mod (kube-apiserver and
# etcd) and tests/k8s-peers/helm/go.mod (helm); both go.sum files are
# committed and the builds run with -mod=readonly.
#
# Cache: ${CUBE_CSI_BRIDGE_PEERS_DIR:-/var/cache/cube-csi-bridge-test-peers}/k8s-<key>/bin
# where <key> hashes the Go version, the two go.mod and go.sum files and this
# script. A complete entry is reused without running go at all; a build goes
# to a temporary directory that is renamed into place only once all three
# binaries run. <root>/k8s-current is a symlink to the last entry installed
# or reused. k8s-* entries unused for 14 days are pruned.
#
# Needs: go (1.26+); from Debian openssl, python3 and curl (used by
# tests/k8s-peers/start-apiserver.sh) and util-linux (flock), installed with
# apt-get when missing (apt-get update only then). Modules come through the go
# command's configured module proxy; nothing else is downloaded. The Go build
# cache stays where go keeps it, so a rebuild after a version bump is cheaper.
set -euo pipefail

log() { echo "install-k8s-peers: $*" >&2; }
die() { log "error: $*"; exit 1; }

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
peers=$repo/tests/k8s-peers
cache_root=${CUBE_CSI_BRIDGE_PEERS_DIR:-/var/cache/cube-csi-bridge-test-peers}
bins=(kube-apiserver etcd helm)

for f in go.mod go.sum helm/go.mod helm/go.sum; do
	[ -f "$peers/$f" ] || die "missing $peers/$f"
done

# --- Debian packages -------------------------------------------------------
. "$repo/scripts/ensure-commands.sh"
ensure_commands openssl:openssl python3:python3 curl:curl flock:util-linux \
	sha256sum:coreutils base64:coreutils
command -v go >/dev/null 2>&1 || die "go is not on PATH"

# --- cache key -------------------------------------------------------------
export GOTOOLCHAIN=local
goversion=$(go env GOVERSION)
key=$(
	cd "$repo"
	{
		echo "$goversion"
		sha256sum scripts/install-k8s-peers.sh \
			tests/k8s-peers/go.mod tests/k8s-peers/go.sum \
			tests/k8s-peers/helm/go.mod tests/k8s-peers/helm/go.sum
	} | sha256sum | cut -c1-16
)
dir=$cache_root/k8s-$key

mkdir -p "$cache_root"
exec 9>"$cache_root/.lock-k8s"
flock 9

complete() {
	[ -f "$dir/.complete" ] || return 1
	local b
	for b in "${bins[@]}"; do [ -x "$dir/bin/$b" ] || return 1; done
}

# modversion <module dir> <module path>: the version go.mod selects.
modversion() { (cd "$1" && go list -mod=readonly -m -f '{{.Version}}' "$2"); }
# modtime <module dir> <module path>: that version's release time, UTC.
modtime() {
	(cd "$1" && go list -mod=readonly -m -f '{{.Time.UTC.Format "2006-01-02T15:04:05Z"}}' "$2")
}

if complete; then
	log "up to date: $dir (key $key)"
else
	log "building kube-apiserver, etcd and helm with $goversion into $dir"
	log "(the first build takes a while: kube-apiserver is a large program)"
	start=$(date +%s)
	tmp=$(mktemp -d "$cache_root/.k8s-build.XXXXXX")
	trap 'rm -rf "$tmp"' EXIT
	chmod 755 "$tmp"
	mkdir -p "$tmp/bin"

	# Static, stripped, path-free builds, as the upstream release builds are.
	export CGO_ENABLED=0
	common=(-mod=readonly -trimpath -buildvcs=false)

	kube=$(modversion "$peers" k8s.io/kubernetes)
	kube_date=$(modtime "$peers" k8s.io/kubernetes)
	etcd=$(modversion "$peers" go.etcd.io/etcd/server/v3)
	helm=$(modversion "$peers/helm" helm.sh/helm/v3)
	helm_client_go=$(modversion "$peers/helm" k8s.io/client-go)
	log "k8s.io/kubernetes $kube, go.etcd.io/etcd/server/v3 $etcd, helm.sh/helm/v3 $helm"

	# kube-apiserver: the version stamps hack/lib/version.sh sets (without
	# them it reports v0.0.0-master and helm's kubeVersion checks fail), and
	# the tags hack/lib/golang.sh builds release binaries with.
	kmajor=${kube#v}; kmajor=${kmajor%%.*}
	kminor=${kube#v*.}; kminor=${kminor%%.*}
	kflags="-s -w"
	for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
		kflags+=" -X $pkg.gitVersion=$kube -X $pkg.gitMajor=$kmajor -X $pkg.gitMinor=$kminor"
		kflags+=" -X $pkg.gitCommit= -X $pkg.gitTreeState=clean -X $pkg.buildDate=$kube_date"
	done
	log "building kube-apiserver $kube"
	(cd "$peers" && go build "${common[@]}" -tags selinux,notest,grpcnotrace \
		-ldflags "$kflags" -o "$tmp/bin/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver) >&2

	# etcd: the server module's main package is the etcd binary. Built in the
	# kubernetes wrapper module, so with the dependency versions kubernetes
	# itself runs etcd's server packages with.
	log "building etcd $etcd"
	(cd "$peers" && go build "${common[@]}" -ldflags "-s -w" \
		-o "$tmp/bin/etcd" go.etcd.io/etcd/server/v3) >&2

	# helm: the version stamps helm's Makefile sets (the k8s version is the
	# default for `helm template` and lint, derived from client-go as upstream).
	hminor=${helm_client_go#v0.}; hminor=${hminor%%.*}
	hflags="-s -w -X helm.sh/helm/v3/internal/version.version=$helm"
	hflags+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
	for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
		hflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$hminor"
	done
	log "building helm $helm"
	(cd "$peers/helm" && go build "${common[@]}" -ldflags "$hflags" \
		-o "$tmp/bin/helm" helm.sh/helm/v3/cmd/helm) >&2

	# Smoke checks: each binary runs and reports the version it was built as.
	out=$("$tmp/bin/kube-apiserver" --version 2>&1) || die "kube-apiserver --version: $out"
	[ "$out" = "Kubernetes $kube" ] || die "kube-apiserver reports '$out', want 'Kubernetes $kube'"
	out=$("$tmp/bin/etcd" --version 2>&1) || die "etcd --version: $out"
	grep -qx "etcd Version: ${etcd#v}" <<<"$out" || die "etcd reports '$out', want ${etcd#v}"
	out=$("$tmp/bin/helm" version --short 2>&1) || die "helm version: $out"
	[ "${out%%+*}" = "$helm" ] || die "helm reports '$out', want $helm"

	{
		echo "key=$key"
		echo "go=$goversion"
		echo "kube-apiserver=$kube"
		echo "etcd=$etcd"
		echo "helm=$helm"
		echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
		echo "seconds=$(($(date +%s) - start))"
	} >"$tmp/BUILD-INFO"
	touch "$tmp/.complete"
	rm -rf "$dir"
	mv "$tmp" "$dir"
	trap - EXIT
	log "built in $(($(date +%s) - start)) s"
fi
touch "$dir"
ln -sfn "k8s-$key" "$cache_root/.k8s-current.tmp"
mv -T "$cache_root/.k8s-current.tmp" "$cache_root/k8s-current"

# Prune entries unused for 14 days (never the one just used), and builds
# left behind by a killed run (none is in progress: we hold the lock).
find "$cache_root" -mindepth 1 -maxdepth 1 -type d -name 'k8s-*' -mtime +14 \
	! -name "k8s-$key" -exec rm -rf {} + 2>/dev/null || true
find "$cache_root" -mindepth 1 -maxdepth 1 -type d -name '.k8s-build.*' \
	-exec rm -rf {} + 2>/dev/null || true

echo "$dir/bin"
