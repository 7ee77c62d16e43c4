"""The agent unit as systemd shows it: the one parser of ``systemctl show`` output (:func:`show_props`)
and of its ``ExecStart`` property.

``systemctl show -p ExecStart UNIT`` prints ``{ path=/v/python ; argv[]=/v/python -m ddplab.agent
--nnodes 1:3 --rdzv-endpoint 10.89.0.1:29400 ... ; ignore_errors=no ; ... }``. Read on a node by
:mod:`ddplab.status` (the store a run's launch used) and on the controller by the validate role's
filter ``unit_launch`` (the addresses the last launch passed), which imports this module from the
checkout's ``train/``. Standard library only: it runs in the job's venv and on the controller.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence

_ARGV = re.compile(r"argv\[\]=(.*?) ;")


def show_props(show: str) -> dict[str, str]:
    """``KEY=VALUE`` lines of ``systemctl show`` as a dict (lines without ``=`` left out)."""
    return dict(line.split("=", 1) for line in (show or "").splitlines() if "=" in line)


def exec_start_argv(exec_start: str) -> list[str]:
    """The first command's ``argv`` of an ``ExecStart`` property value (``[]`` when it names none);
    words are split as a shell would, or at spaces when the quoting is broken."""
    match = _ARGV.search(exec_start or "")
    if not match:
        return []
    try:
        return shlex.split(match.group(1))
    except ValueError:
        return match.group(1).split()


def option_value(argv: Sequence[str], name: str) -> str | None:
    """The value of the long option ``name`` (e.g. ``--rdzv-endpoint``) in ``argv``, given as
    ``--name VALUE`` or ``--name=VALUE``, also spelled with underscores (torchrun accepts both);
    the first occurrence wins; None when absent."""
    spellings = (name, "--" + name[2:].replace("-", "_"))
    for i, word in enumerate(argv):
        for spelled in spellings:
            if word == spelled and i + 1 < len(argv):
                return argv[i + 1]
            if word.startswith(spelled + "="):
                return word.split("=", 1)[1]
    return None
