# Sourced by the scripts/install-*-peers.sh installers (after they define log and die).
#
# ensure_commands <command>:<debian-package>...
#   Installs, with apt-get, the packages whose command is missing (running apt-get update
#   only then). Installing needs root; without it, missing packages are an error. Installers
#   may run at once (scripts/test.sh runs one in the background): apt-get waits for the
#   dpkg lock instead of failing on it, and a flock serialises this project's own calls.
ensure_commands() {
	local pair
	local -A want=()
	for pair in "$@"; do
		command -v "${pair%%:*}" >/dev/null 2>&1 || want[${pair#*:}]=1
	done
	[ ${#want[@]} -gt 0 ] || return 0
	[ "$(id -u)" = 0 ] || die "missing packages ${!want[*]} and not root"
	log "installing Debian packages: ${!want[*]}"
	# The lock file lives in a directory only root writes: in a world-writable one
	# (/var/lock is /run/lock, mode 1777) another user could plant a symlink there, which
	# root's open would follow and truncate, or hold the flock to stall every install.
	local lock_dir=/var/cache/cube-csi-bridge
	install -d -m 0755 -o root -g root "$lock_dir" || die "cannot make $lock_dir"
	[ -O "$lock_dir" ] && [ ! -L "$lock_dir" ] || die "$lock_dir is not root's own directory"
	(
		if command -v flock >/dev/null 2>&1; then flock 8; fi
		DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 update -qq >&2
		DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
			--no-install-recommends "${!want[@]}" >&2
	) 8>"$lock_dir/apt.lock"
}
