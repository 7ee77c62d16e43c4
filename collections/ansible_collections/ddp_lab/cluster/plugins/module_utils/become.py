"""Become that needs a password which was not given (``-K`` missing), or was given wrong, in one line."""

from __future__ import annotations

from typing import Any


def become_problem(become: Any, text: str, user: Any = None) -> str:
    """One line when ``text`` (a failed command's error over the connection whose become plugin is
    ``become``) says become needs a password that was not given, or was given wrong (the plugin's
    own ``check_missing_password`` / ``check_incorrect_password``, or Ansible's ``Missing sudo
    password``); "" otherwise. ``user``: the connecting account, for the line."""
    if become is None:
        return ""
    name = str(getattr(become, "name", "become")).rsplit(".", 1)[-1]
    raw, who = str(text).encode(errors="replace"), user or "the connecting account"
    if become.check_incorrect_password(raw) or f"Incorrect {name} password" in text:
        return f"the {name} password given for {who} is wrong; fix: pass -K again with the right password"
    if become.check_missing_password(raw) or f"Missing {name} password" in text:
        return (f"{name} asks {who} for a password and none was given; fix: pass -K (--ask-become-pass)"
                " to ansible-playbook, or let the account use it without one (NOPASSWD)")
    return ""
