# Sourced by the installers of tools built with `cargo install` (install-ops-tools.sh,
# install-fuzz-tools.sh), after they define log and die.
#
# cargo_tool_cached <crate> <version> <cache-root>
#   Builds <crate> <version> with `cargo install --locked` (the crate's own Cargo.lock, so the
#   build is reproducible) into <cache-root>/<key>/bin, unless a complete entry is there, and
#   prints that bin directory on stdout. <key> hashes the crate, its version, `rustc -vV` and
#   this file, so a new toolchain or a new way of building makes a new entry. A complete entry
#   is reused without running cargo at all; a build goes to a temporary directory renamed
#   into place once the binary runs and reports the version asked for. <cache-root>/current
#   is a symlink to the last entry installed or reused; entries unused for 14 days are pruned.
#   A lock serialises concurrent installers.
cargo_tool_cached() {
	local crate=$1 version=$2 cache_root=$3
	command -v cargo >/dev/null 2>&1 || die "cargo is not on PATH"
	local key dir tmp start reported
	key=$(
		{
			echo "$crate $version"
			rustc -vV
			sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1
		} | sha256sum | cut -c1-16
	)
	dir=$cache_root/$key

	mkdir -p "$cache_root"
	exec 9>"$cache_root/.lock"
	flock 9

	if [ -f "$dir/.complete" ] && [ -x "$dir/bin/$crate" ]; then
		log "up to date: $dir (key $key)"
	else
		log "building $crate $version into $dir (minutes the first time)"
		start=$(date +%s)
		tmp=$(mktemp -d "$cache_root/.build.XXXXXX")
		# shellcheck disable=SC2064 # expand $tmp now: the trap outlives this function
		trap "rm -rf '$tmp'" EXIT
		chmod 755 "$tmp"
		# A private target dir, so nothing of the build is left outside the cache entry.
		CARGO_TARGET_DIR="$tmp/target" nice cargo install --locked --quiet \
			--root "$tmp" "$crate" --version "=$version" >&2
		rm -rf "$tmp/target"
		reported=$("$tmp/bin/$crate" --version 2>&1) || die "built $crate does not run: $reported"
		[[ $reported == *" $version"* ]] || die "built $crate reports $reported"
		{
			echo "key=$key"
			echo "$crate=$version"
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
	exec 9>&-

	echo "$dir/bin"
}
