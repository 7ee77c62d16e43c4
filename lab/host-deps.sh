#!/usr/bin/env bash
# Install the host packages the built-in lab needs, only those missing: podman (containers), runc
# (a runtime that works where crun does not), debootstrap (the offline base image), iptables and
# iproute2 (podman networking, fault injection), python3 + python3-venv (lab/lab.py, the controller
# venv), openssh-client (Ansible reaches the lab nodes over SSH; ssh-keygen makes the lab's key).
# `--test` adds what the tests run on the controller: network-manager (tests/test_dropins.py runs
# the real `NetworkManager --print-config` on folders of its own; Debian leaves the host's
# ifupdown interfaces unmanaged, and the tests never start the daemon). Idempotent: prints
# "nothing to install" when everything is there. Debian/Ubuntu (apt), root.
set -euo pipefail

packages=(podman runc debootstrap iptables iproute2 python3 python3-venv openssh-client)
case "${1:-}" in
    --test) packages+=(network-manager) ;;
    "") ;;
    *) echo "host-deps: error: unknown argument '$1' (usage: lab/host-deps.sh [--test])" >&2; exit 2 ;;
esac

missing=()
for pkg in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q '^install ok installed$'; then
        missing+=("$pkg")
    fi
done

if [ "${#missing[@]}" -eq 0 ]; then
    echo "host-deps: nothing to install (${packages[*]} present)"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "host-deps: error: missing ${missing[*]} and this host has no apt-get;" \
        "install them with your package manager, then rerun" >&2
    exit 1
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "host-deps: error: missing ${missing[*]}; installing needs root:" \
        "run 'sudo lab/host-deps.sh' (or 'sudo make deps')" >&2
    exit 1
fi

echo "host-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q "${missing[@]}"
echo "host-deps: installed ${missing[*]}"
