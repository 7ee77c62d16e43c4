"""A node whose SSH host key changed, in one line: OpenSSH's multi-line refusal becomes the key the
node offers now, the known_hosts line it contradicts and the fix."""

from __future__ import annotations

import re

# OpenSSH (ssh(1), sshconnect.c) on a key that differs from known_hosts, with StrictHostKeyChecking
CHANGED = re.compile(r"REMOTE HOST IDENTIFICATION HAS CHANGED")
FINGERPRINT = re.compile(r"fingerprint for the (\S+) key sent by the remote host is\s+(\S+?)\.?\s*$", re.M)
OFFENDING = re.compile(r"Offending (\S+) key in (\S+?):(\d+)")
REMOVE = re.compile(r"ssh-keygen -f ('[^']*'|\S+) -R ('[^']*'|\S+)")
LAB_FIX = "make lab-up (it reads the lab nodes' host keys again into lab/.state/ssh/known_hosts)"


def host_key_changed(text: str, lab: bool = False) -> str:
    """``SSH host key changed (the node now offers ED25519 key SHA256:...; known_hosts: FILE line N);
    fix: ...`` from ssh's error output ``text``; '' when it is not that refusal. ``lab``: the node
    is a lab container (the fix is the lab's)."""
    text = str(text or "")
    if not CHANGED.search(text):
        return ""
    fp, bad, rm = FINGERPRINT.search(text), OFFENDING.search(text), REMOVE.search(text)
    key = f"{fp.group(1)} key {fp.group(2)}" if fp else "host key"
    where = f"; known_hosts: {bad.group(2)} line {bad.group(3)}" if bad else ""
    if lab:
        fix = LAB_FIX
    elif rm:
        fix = (f"if the laptop was reinstalled, ssh-keygen -f {rm.group(1)} -R {rm.group(2)}, then accept "
               "its new key at the next login; if not, do not connect (someone may be in between)")
    else:
        fix = "remove the node's old key from known_hosts (ssh-keygen -R <host>) if it was reinstalled"
    return f"SSH host key changed (the node now offers {key}{where}); fix: {fix}"
