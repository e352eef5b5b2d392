#!/bin/sh
# nfs-driver-ns.sh — run a command, the real csi-driver-nfs plugin in the tests, in a mount
# namespace of its own in which /sbin/mount.nfs is the test-only helper
# tests/peers/nfs-sbin/mount.nfs. Root only.
#
#   nfs-driver-ns.sh EXPORTS CMD [ARG...]
#
# The helper serves NFS "servers" from directories: SERVER:/PATH is EXPORTS/SERVER/PATH
# (see nfs-sbin/mount.nfs; set CUBE_TEST_NFS_LOG to record every mount). CMD replaces
# this script (same PID, so killing that PID stops the driver and its namespace ends
# with it).
#
# What stays private, and what does not:
# - `unshare -m --propagation unchanged` copies the host's mounts with their propagation,
#   so a directory that is a shared mount in the host (the tests' volume base dirs, made
#   with shared-dir.sh) is a peer of the host's copy here: what the driver mounts below it
#   (NodePublishVolume's target) appears in the host at once, and from there in a
#   simulated Cubelet namespace. Start this only after the base dir is shared.
# - The mount that holds /sbin (normally `/`) is made a slave here, not recursively, and
#   the helper is overlaid on /sbin's directory (lowerdirs: the helper's directory, then
#   the real one, so every other binary stays as it was). That overlay cannot propagate
#   out: the host, and every other process, keep their own /sbin, with no mount.nfs added
#   or replaced. The host need not have a /sbin/mount.nfs at all.
# - The driver's other mounts outside shared mounts (CreateVolume's and DeleteVolume's
#   share mounts in its working directory) stay in its namespace and end with it.
set -eu
die() { echo "nfs-driver-ns.sh: $*" >&2; exit 1; }
[ $# -ge 2 ] || die "usage: nfs-driver-ns.sh EXPORTS CMD [ARG...]"
[ "$(id -u)" = 0 ] || die "must run as root"
[ -d "$1" ] || die "exports directory $1 does not exist"
exports=$(cd "$1" && pwd -P)
shift
helper_dir=$(cd "$(dirname "$0")/nfs-sbin" && pwd -P)
[ -x "$helper_dir/mount.nfs" ] || die "missing $helper_dir/mount.nfs"
sbin=$(readlink -f /sbin)
export CUBE_TEST_NFS_EXPORTS="$exports"
exec unshare -m --propagation unchanged -- /bin/sh -c '
	set -e
	sbin=$1 helper_dir=$2
	shift 2
	mount --make-slave "$(findmnt -n -o TARGET --target "$sbin")"
	mount -t overlay ccb-test-mount-nfs -o "lowerdir=$helper_dir:$sbin" "$sbin"
	exec "$@"
' nfs-driver-ns "$sbin" "$helper_dir" "$@"
