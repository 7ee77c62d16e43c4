"""What the benchmarks share on their command line: the ``--help`` description."""

from __future__ import annotations

import re


def first_sentence(doc: str | None) -> str:
    """The first sentence of a module docstring, joined onto one line: the text up to the first
    ``.``, ``?`` or ``!`` that ends a sentence (followed by white space or the end), else the first
    paragraph. ``""`` for a missing docstring.

    >>> first_sentence("Cost of a restart: spawn vs fork.\\n\\nMore.")
    'Cost of a restart: spawn vs fork.'
    """
    paragraph = " ".join((doc or "").strip().split("\n\n")[0].split())
    found = re.search(r"[.?!](?=\s|$)", paragraph)
    return paragraph[: found.end()] if found else paragraph
