"""Filters of the bench role: whether a link may be shaped, from what ``tc qdisc show dev <if>
root`` returned on the node (tasks/qdisc.yml), and the one line that says why not."""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from typing import Any

#: root queueing disciplines a kernel or a distribution sets by itself: the bench may replace them
DEFAULT_QDISCS = ("noqueue", "pfifo_fast", "fq_codel", "mq", "fq", "pfifo")


def _text(result: Mapping[str, Any], key: str) -> str:
    return " ".join(str(result.get(key) or "").split())


def bench_qdisc_refusal(result: Mapping[str, Any], host: str, ifname: str, own_handle: str,
                        path: str) -> str:
    """The refusal to shape ``ifname`` of ``host``, '' when the bench may shape it.

    ``result``: the registered result of ``tc qdisc show dev <ifname> root`` run with become and
    ``path`` as its PATH (``failed_when: false``). Shaping is allowed over a default root qdisc
    (:data:`DEFAULT_QDISCS`), the bench's own (handle ``own_handle``, left by an interrupted bench)
    or none shown. Else one line naming the cause and its fix:

    * no ``rc``: the task never ran the command (become or the connection failed): its message;
    * the command module could not execute tc (its ``msg`` "Error executing command.", ``rc`` the
      errno, no output): ENOENT, no tc in any folder of ``path``: install iproute2; another
      errno: its name;
    * tc ran and exited non-zero (e.g. ``Cannot find device "eth9"``): its words, and where the
      shaped interface comes from (``wired_network_ifname``);
    * a root qdisc someone else set: which, and the command that removes it.
    """
    lead = f"{host}: cannot shape {ifname}:"
    rc, msg = result.get("rc"), _text(result, "msg")
    if rc is None:
        return (f"{lead} `tc qdisc show` did not run ({msg or 'no message'}); fix: check that the account "
                f"can sudo on {host} (pass -K when sudo asks a password)")
    if msg.startswith("Error executing command"):
        if rc == errno.ENOENT:
            return (f"{lead} tc is not installed (no tc in {path}); fix: install iproute2 on {host} (sudo "
                    "apt-get install iproute2), or run without bench_shape_rate_mbit")
        return (f"{lead} tc could not be executed ({os.strerror(rc) if isinstance(rc, int) else rc}); fix: "
                f"reinstall iproute2 on {host}, or run without bench_shape_rate_mbit")
    if rc != 0:
        said = _text(result, "stderr") or _text(result, "stdout") or msg or "no output"
        return (f"{lead} `tc qdisc show dev {ifname} root` failed (exit {rc}: {said}); fix: check that "
                f"{ifname} is {host}'s wired interface (wired_network_ifname, from its route to the "
                "rendezvous host; `ip -br link` lists them), or run without bench_shape_rate_mbit")
    words = str(result.get("stdout") or "").split()
    kind, handle = (words[1:2] or [""])[0], (words[2:3] or [""])[0]
    if not words or kind in DEFAULT_QDISCS or handle == own_handle:
        return ""
    return (f"{lead} its root qdisc is {' '.join(words)}, set by someone else; fix: remove it (sudo tc qdisc "
            f"del dev {ifname} root) or run without bench_shape_rate_mbit")


class FilterModule:
    """The filters above."""

    def filters(self):
        return {"bench_qdisc_refusal": bench_qdisc_refusal}
