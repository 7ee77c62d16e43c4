"""Stdout callback ``ddp_lab``: Ansible's ``default`` output, with the project's refusals in one line.

For a refusal (:func:`is_refusal`: a failure whose message the action wrote for people), the
``[ERROR]:`` line is printed alone (``Task failed: Action failed: <msg>``), without the ``Origin:``
block ansible-core 2.19 adds under it, for a task and for each failed item of a loop; a role's own
argument check prints its errors in one line (:func:`argument_line`) without the spec it carries.
Every other failure keeps Ansible's whole message. The ``fatal: [host]: FAILED!`` line stays,
without an assert's ``assertion`` and ``evaluated_to``. Set in ansible.cfg
(``stdout_callback = ddp_lab.cluster.ddp_lab``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ansible import constants as C
from ansible.plugins.callback.default import CallbackModule as DefaultCallback

DOCUMENTATION = """
    name: ddp_lab
    type: stdout
    short_description: default output, the project's refusals without the Origin block
    description:
      - The default stdout callback; a false assert, a fail task's message or a deliberate failure of
        one of the project's own action plugins, looped or not, prints its [ERROR] line without the
        Origin block below it; any other failure keeps it.
    extends_documentation_fragment:
      - default_callback
      - result_format_callback
    requirements:
      - set as stdout in configuration
"""

# Actions whose failure is a message written for people (the project's checks and refusals).
REFUSALS = frozenset({"assert", "fail", "ansible.builtin.assert", "ansible.builtin.fail",
                      "ansible.legacy.assert", "ansible.legacy.fail"})
ASSERTS = frozenset(a for a in REFUSALS if a.endswith("assert"))
# ... and a settings check against an argument spec (a role's own at its start)
ARGUMENT_SPECS = frozenset({"validate_argument_spec", "ansible.builtin.validate_argument_spec",
                            "ansible.legacy.validate_argument_spec"})
# ... and the project's own action plugins (this collection's plugins/action/<name>.py, by FQCN)
PROJECT_ACTIONS = frozenset(f"ddp_lab.cluster.{p.stem}"
                            for p in (Path(__file__).resolve().parents[1] / "action").glob("*.py"))


def innermost_message(summary: Any) -> str | None:
    """The message of the innermost event of an ansible-core ``ErrorSummary`` (a task result's
    ``exception``: ``event`` -> ``event.chain.event`` -> ...), or None without one."""
    event = getattr(summary, "event", None)
    while event is not None and getattr(event, "chain", None) is not None:
        event = event.chain.event
    return None if event is None else str(event.msg)


def argument_line(result: Mapping[str, Any]) -> str:
    """A failed argument spec check in one line: Ansible's words on each setting it refused and
    where the role documents its settings (``validate_args_context``: the role's own check)."""
    errors = "; ".join(" ".join(str(e).split()) for e in result.get("argument_errors") or [])
    role = (result.get("validate_args_context") or {}).get("name")
    where = f" (roles/{role}/README.md)" if role else ""
    return f"{errors or result.get('msg')}; fix: correct it in the inventory, group_vars or -e{where}"


def is_refusal(action: str, result: Mapping[str, Any], summary: Any) -> bool:
    """Whether the failed ``result`` of a task of ``action`` (its error summary ``summary``) is a
    refusal: an assert whose condition was false, a fail task, a role's argument check or one of
    this collection's actions, whose ``msg`` is the innermost event's message (an exception's
    ``msg`` is composed from the whole chain: ansible-core 2.19
    ``_error_utils.result_dict_from_exception``)."""
    if action not in REFUSALS and action not in PROJECT_ACTIONS and action not in ARGUMENT_SPECS:
        return False
    msg = result.get("msg")
    if not msg or innermost_message(summary) != str(msg):
        return False
    return action not in ASSERTS or "assertion" in result  # an assert's false condition


class CallbackModule(DefaultCallback):
    """See the module docstring."""

    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "stdout"
    CALLBACK_NAME = "ddp_lab"

    def __init__(self) -> None:
        super().__init__()
        self._refusal = False

    def _one_line(self, result) -> bool:
        """Whether ``result`` (a task's or an item's failed CallbackTaskResult) is a refusal; if so,
        drops the assert's expression from it."""
        refusal = is_refusal(str(result.task.action), result.result, result.exception)
        if refusal:  # the assert's expression is the role's code, not the user's problem
            for key in ("assertion", "evaluated_to", "argument_spec_data"):
                result.result.pop(key, None)
            if str(result.task.action) in ARGUMENT_SPECS:
                result.result["msg"] = argument_line(result.result)
        return refusal

    def _failed(self, show, result, *args) -> None:
        """``show(result, *args)`` (the default callback's) with a refusal printed in one line."""
        self._refusal = self._one_line(result)
        try:
            show(result, *args)
        finally:
            self._refusal = False

    def v2_runner_on_failed(self, result, ignore_errors: bool = False) -> None:
        self._failed(super().v2_runner_on_failed, result, ignore_errors)

    def v2_runner_item_on_failed(self, result) -> None:
        self._failed(super().v2_runner_item_on_failed, result)

    def _handle_exception(self, result, use_stderr: bool = False) -> None:
        if self._refusal and result.get("exception"):
            result.pop("exception", None)
            msg = " ".join(str(result.get("msg")).split())
            self._display.display(f"[ERROR]: Task failed: Action failed: {msg}", color=C.COLOR_ERROR,
                                  stderr=use_stderr)
            return
        super()._handle_exception(result, use_stderr)
