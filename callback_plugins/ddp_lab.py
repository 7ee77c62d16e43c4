"""Stdout callback ``ddp_lab``: Ansible's ``default`` output, with the project's refusals in one line.

ansible-core 2.19 prints every failed task's error with an ``Origin:`` block (the task file, line
and column, and five lines of the YAML around it) under the ``[ERROR]:`` line. For the project's
refusals, whose ``fail_msg``/``msg`` already says what is wrong and how to fix it (the tasks of
:data:`REFUSALS` and the project's own action plugins, e.g. status.yml's table), that block is only
noise: their ``[ERROR]:`` line is printed alone (``Task failed: Action failed: <msg>``, the words
``errors()`` of tests/labharness.py and people read). Every other failure (a module's, a template
error, an exception) keeps Ansible's whole message with its origin. The ``fatal: [host]: FAILED!``
line that follows stays (an assert's ``assertion`` and ``evaluated_to`` left out of it). Set in
ansible.cfg (``stdout_callback = ddp_lab``).
"""

from __future__ import annotations

from pathlib import Path

from ansible import constants as C
from ansible.plugins.callback.default import CallbackModule as DefaultCallback

DOCUMENTATION = """
    name: ddp_lab
    type: stdout
    short_description: default output, the project's refusals without the Origin block
    description:
      - The default stdout callback; a failed assert or fail task, or a failure of one of the project's
        own action plugins, prints its [ERROR] line without the Origin block below it.
    extends_documentation_fragment:
      - default_callback
      - result_format_callback
    requirements:
      - set as stdout in configuration
"""

# Actions whose failure is a message written for people (the project's checks and refusals).
REFUSALS = frozenset({"assert", "fail", "ansible.builtin.assert", "ansible.builtin.fail",
                      "ansible.legacy.assert", "ansible.legacy.fail"})
# ... and the project's own action plugins (roles/*/action_plugins/<name>.py)
PROJECT_ACTIONS = frozenset(p.stem for p in (Path(__file__).resolve().parents[1] / "roles").glob(
    "*/action_plugins/*.py"))


def is_refusal(action: str) -> bool:
    """Whether a failure of the task ``action`` is a refusal written for people (see the module
    docstring): assert, fail, or one of the project's action plugins."""
    return action in REFUSALS or action in PROJECT_ACTIONS


class CallbackModule(DefaultCallback):
    """See the module docstring."""

    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "stdout"
    CALLBACK_NAME = "ddp_lab"

    def __init__(self) -> None:
        super().__init__()
        self._refusal = False

    def v2_runner_on_failed(self, result, ignore_errors: bool = False) -> None:
        self._refusal = is_refusal(str(result.task.action)) and bool(result.result.get("msg"))
        if self._refusal:  # the assert's expression is the role's code, not the user's problem
            for key in ("assertion", "evaluated_to"):
                result.result.pop(key, None)
        try:
            super().v2_runner_on_failed(result, ignore_errors)
        finally:
            self._refusal = False

    def _handle_exception(self, result, use_stderr: bool = False) -> None:
        if self._refusal and result.get("exception"):
            result.pop("exception", None)
            msg = " ".join(str(result.get("msg")).split())
            self._display.display(f"[ERROR]: Task failed: Action failed: {msg}", color=C.COLOR_ERROR,
                                  stderr=use_stderr)
            return
        super()._handle_exception(result, use_stderr)
