#!/usr/bin/env bash
# Run a command in a cpu cgroup of its own on a cgroup-v1 host, with cpu.shares SHARES:
#   lab/cpu-group.sh NAME SHARES COMMAND [ARGS...]
# On cgroup v1 the CFS weighs every runnable process of the root cgroup at 1024 against each child
# cgroup as a whole; podman puts all containers in one child (libpod_parent, 1024). So beside the
# unit tests' dozens of processes the lab laptops of the molecule scenarios get a few percent of
# the CPU, and their provisioning waits on it. With the unit tests in one group of SHARES, the
# containers get SHARES' complement: 1024 against 1024 splits the busy machine in halves.
# Where there is no writable cgroup-v1 cpu hierarchy (cgroup v2, not root) the command runs as is.
# The group (/sys/fs/cgroup/cpu/NAME) is removed when the command ends, unless a process it started
# still lives in it. Exits with the command's status.
set -u
if [ $# -lt 3 ]; then
    echo "cpu-group: usage: lab/cpu-group.sh NAME SHARES COMMAND [ARGS...]" >&2
    exit 2
fi
name=$1 shares=$2
shift 2
root=/sys/fs/cgroup/cpu
dir=$root/$name
if [ -w "$root/cgroup.procs" ] && mkdir -p "$dir" 2>/dev/null \
        && echo "$shares" > "$dir/cpu.shares" 2>/dev/null && echo $$ > "$dir/cgroup.procs" 2>/dev/null; then
    "$@"
    rc=$?
    echo $$ > "$root/cgroup.procs"
    rmdir "$dir" 2>/dev/null
    exit $rc
fi
exec "$@"
