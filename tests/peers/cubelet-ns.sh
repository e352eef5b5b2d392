#!/bin/sh
# cubelet-ns.sh — a simulated Cubelet mount namespace for cube-csi-bridge's
# end-to-end tests. Root only.
#
#   cubelet-ns.sh start NSFILE PIDFILE
#   cubelet-ns.sh stop  NSFILE PIDFILE
#
# start creates a long-lived holder process (setsid, stdio on /dev/null) in a
# new mount namespace that is a one-way slave of the host, as Cubelet's is
# (cube-hook-protocol.md §4.5): `unshare -m --propagation unchanged` copies
# the host's mounts with their propagation, then `mount --make-rslave /` inside
# turns every shared mount into a slave. The holder's /proc/PID/ns/mnt is then
# bind-mounted onto NSFILE (like Cubelet's
# /usr/local/services/cubetoolbox/cubeletmnt/mnt) and its PID written to
# PIDFILE. Enter the namespace with `nsenter --mount=NSFILE …` or read
# /proc/PID/mountinfo.
#
# What it sees: a mount made in the host (or in a peer namespace of the host's)
# under a directory whose mount is SHARED in the host appears in it at once; mounts made elsewhere do not, nor do mounts
# made inside it reach the host. Host "/" is usually private on test machines,
# so make the test's base directory a shared mount first
# (tests/peers/shared-dir.sh make DIR) and only then start the namespace:
# mounts that exist before start are copied, but only shared ones keep
# propagating.
#
# NSFILE's directory must not be on a shared mount (the kernel refuses to
# propagate a namespace file); if it is, start bind-mounts that directory onto
# itself as a private mount and stop undoes it.
#
# stop unmounts NSFILE, kills the holder (after checking that PIDFILE still
# names it), removes PIDFILE and NSFILE. Both commands are idempotent.
set -eu
die() { echo "cubelet-ns.sh: $*" >&2; exit 1; }
[ $# -eq 3 ] || die "usage: cubelet-ns.sh start|stop NSFILE PIDFILE"
cmd=$1 nsfile=$2 pidfile=$3
[ "$(id -u)" = 0 ] || die "must run as root"

holder_ok() { # PID: is it a holder process (sleep, in a mount namespace of its own)?
	[ "$(cat "/proc/$1/comm" 2>/dev/null)" = sleep ] &&
		[ "$(stat -L -c %i "/proc/$1/ns/mnt")" != "$(stat -L -c %i /proc/self/ns/mnt)" ]
}
holds_ns() { # PID NSFILE: is NSFILE bound to PID's mount namespace?
	holder_ok "$1" && [ "$(stat -L -c %i "/proc/$1/ns/mnt")" = "$(stat -L -c %i "$2" 2>/dev/null)" ]
}

case $cmd in
start)
	if [ -s "$pidfile" ] && holds_ns "$(cat "$pidfile")" "$nsfile"; then
		exit 0 # already running
	fi
	nsdir=$(dirname "$nsfile")
	mkdir -p "$nsdir" "$(dirname "$pidfile")"
	nsdir=$(cd "$nsdir" && pwd -P)
	case $(findmnt -n -o PROPAGATION --target "$nsdir") in
	private) ;;
	*)
		if ! mountpoint -q "$nsdir"; then
			mount --bind "$nsdir" "$nsdir"
			echo "$nsdir" >"$pidfile.privdir"
		fi
		mount --make-private "$nsdir"
		;;
	esac
	[ -e "$nsfile" ] || : >"$nsfile"
	rm -f "$pidfile.tmp"
	# The inner shell writes its own PID ($$), then execs into the holder,
	# so the PID stays the holder's whatever setsid does.
	setsid unshare -m --propagation unchanged -- /bin/sh -c \
		'mount --make-rslave / && echo $$ >"$1.tmp" && exec sleep infinity' \
		sh "$pidfile" </dev/null >/dev/null 2>&1 &
	i=0
	while [ ! -s "$pidfile.tmp" ]; do
		i=$((i + 1))
		[ $i -le 500 ] || die "holder process did not start"
		sleep 0.01
	done
	pid=$(cat "$pidfile.tmp")
	i=0
	while ! holder_ok "$pid"; do
		i=$((i + 1))
		[ $i -le 500 ] || die "holder process $pid did not exec"
		sleep 0.01
	done
	mount --bind "/proc/$pid/ns/mnt" "$nsfile"
	mv "$pidfile.tmp" "$pidfile"
	;;
stop)
	pid=""
	[ -s "$pidfile" ] && pid=$(cat "$pidfile")
	if [ -n "$pid" ] && holds_ns "$pid" "$nsfile"; then
		umount "$nsfile"
		kill "$pid"
		i=0
		while [ -e "/proc/$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = sleep ] && [ $i -lt 200 ]; do
			i=$((i + 1))
			sleep 0.01
		done
	elif mountpoint -q "$nsfile" 2>/dev/null; then
		umount "$nsfile"
	fi
	rm -f "$pidfile" "$pidfile.tmp"
	[ -f "$nsfile" ] && rm -f "$nsfile"
	if [ -s "$pidfile.privdir" ]; then
		umount "$(cat "$pidfile.privdir")" || true
		rm -f "$pidfile.privdir"
	fi
	;;
*) die "unknown command $cmd" ;;
esac
