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
	(
		if command -v flock >/dev/null 2>&1; then flock 8; fi
		DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 update -qq >&2
		DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
			--no-install-recommends "${!want[@]}" >&2
	) 8>/var/lock/cube-csi-bridge-apt.lock
}
