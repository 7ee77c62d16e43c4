# shellcheck shell=bash
# Source this before running podman, ansible-playbook or molecule by hand on a host whose
# container runtime needs the lab's detected settings (lab/.state/containers.conf, written by
# `make image` / `make lab-up`):   source lab/env.sh
# The Makefile and the molecule scenarios set this themselves; ansible-playbook against an
# already-running lab works without it (podman exec reuses the container's own settings).
__ddp_lab_conf="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")" && pwd)/.state/containers.conf"
if [ -f "$__ddp_lab_conf" ]; then
    export CONTAINERS_CONF="$__ddp_lab_conf"
fi
unset __ddp_lab_conf
