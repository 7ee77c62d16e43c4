"""What the benchmarks share on their command line: the ``--help`` description and formatter, and
the ``--results-dir`` option of the results file each writes (:mod:`ddplab.bench.results`).

Run alone (``python benchmarks/benchcli.py [--help]``) it lists the benchmarks with the first
sentence of each one's docstring; each benchmark's own ``--help`` gives its options and defaults.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


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


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help`` that shows an option's default (``(default: ...)`` after its help text) unless
    the default is None, False or already named in the help text, and keeps the description's and
    epilog's line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False) or "default" in text:
            return text
        return super()._get_help_string(action)


def add_results_dir(parser: argparse.ArgumentParser) -> None:
    """Add ``--results-dir DIR``: where the benchmark writes ``<name>.md`` (default: $DDPLAB_RESULTS_DIR,
    else the checkout's benchmarks/results; :func:`ddplab.bench.results.results_dir`)."""
    parser.add_argument(
        "--results-dir", type=Path, default=None,
        help="folder of the results file <name>.md this benchmark writes (unset: $DDPLAB_RESULTS_DIR, "
        "else benchmarks/results)")


def benchmarks(folder: Path = HERE) -> dict[str, str]:
    """``{file name: first sentence of its docstring}`` of every benchmark script in ``folder``
    (every ``*.py`` but this module), sorted by name. The docstrings are read with :mod:`ast`,
    nothing is imported."""
    found = {}
    for path in sorted(folder.glob("*.py")):
        if path.name != Path(__file__).name:
            found[path.name] = first_sentence(ast.get_docstring(ast.parse(path.read_text())))
    return found


def main(argv: list[str] | None = None) -> int:
    """List the benchmarks (also under ``--help``); returns the exit code 0."""
    listing = "\n".join(f"  {name:<20} {sentence}" for name, sentence in benchmarks().items())
    parser = argparse.ArgumentParser(
        description=first_sentence(__doc__) + " Not a benchmark: the benchmarks are listed below.",
        epilog=f"benchmarks (python benchmarks/<name> --help for each one's options):\n{listing}",
        formatter_class=HelpFormatter,
    )
    parser.parse_args(argv)
    print(f"benchmarks (python benchmarks/<name> --help for each one's options):\n{listing}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
