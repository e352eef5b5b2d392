#!/bin/sh
# shared-dir.sh — set the propagation of a test directory's mount in the host
# namespace. A simulated Cubelet namespace (cubelet-ns.sh) only sees the mounts
# made under a directory whose mount is shared; tests/cube_callers.rs uses
# `make` for the volume base dir, and `private` to show what happens without.
# Root only.
#
#   shared-dir.sh make DIR     if DIR is not itself a mount point, bind-mount it
#                              onto itself; then mark it shared. Prints "bound"
#                              when it made the bind mount, "marked" otherwise.
#   shared-dir.sh private DIR  the same, but marks it private (mounts made
#                              under DIR then reach no other namespace, whatever
#                              the propagation of the mount DIR lies on).
#   shared-dir.sh release DIR  lazily unmount DIR and everything below it
#                              (umount -R -l). Use only on a DIR that `make` or
#                              `private` answered "bound" for.
#   shared-dir.sh check DIR    exit 0 when the mount holding DIR is shared.
set -eu
die() { echo "shared-dir.sh: $*" >&2; exit 1; }
[ $# -eq 2 ] || die "usage: shared-dir.sh make|private|release|check DIR"
cmd=$1
[ -d "$2" ] || die "$2 is not a directory"
dir=$(cd "$2" && pwd -P)

case $cmd in
make | private)
	flag=--make-shared
	[ "$cmd" = private ] && flag=--make-private
	if mountpoint -q "$dir"; then
		mount "$flag" "$dir"
		echo marked
	else
		mount --bind "$dir" "$dir"
		mount "$flag" "$dir"
		echo bound
	fi
	;;
release)
	mountpoint -q "$dir" || exit 0
	umount -R -l "$dir"
	;;
check)
	case $(findmnt -n -o PROPAGATION --target "$dir") in
	shared*) exit 0 ;;
	*) exit 1 ;;
	esac
	;;
*) die "unknown command $cmd" ;;
esac
