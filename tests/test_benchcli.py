"""benchmarks/benchcli.py: every benchmark's ``--help`` starts with a whole sentence of its
docstring (the first line alone was cut mid-sentence in fault_loss.py and recovery.py)."""

import ast
import os
import subprocess
import sys

import pytest
from benchcli import first_sentence
from labharness import REPO

BENCHMARKS = sorted(p for p in (REPO / "benchmarks").glob("*.py") if p.name != "benchcli.py")


def test_first_sentence_joins_lines_and_stops_at_the_end_of_the_sentence():
    doc = "Recovery figures of both engines, side by side: how fast a node loss is\nsurvived. More text."
    assert (
        first_sentence(doc)
        == "Recovery figures of both engines, side by side: how fast a node loss is survived."
    )
    assert first_sentence("Does it learn? The loss.\n") == "Does it learn?"
    assert first_sentence("A ratio of 1.5 x\nis kept.") == "A ratio of 1.5 x is kept."
    assert first_sentence("No full stop\n\nSecond paragraph.") == "No full stop"
    assert first_sentence(None) == ""


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_every_benchmark_describes_itself_with_its_first_whole_sentence(path):
    source = path.read_text()
    doc = ast.get_docstring(ast.parse(source))
    assert doc, f"{path.name}: no module docstring"
    assert first_sentence(doc)[-1] in ".?!", f"{path.name}: the first paragraph has no whole sentence"
    assert "description=first_sentence(__doc__)" in source, f"{path.name}: --help does not use first_sentence"


def _help(script: str) -> str:
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--help"], capture_output=True,
                          text=True, check=True, timeout=120, env={**os.environ, "COLUMNS": "400"})
    return done.stdout


def test_benchcli_help_lists_the_benchmarks():
    """``python benchmarks/benchcli.py --help`` printed nothing (a module without a command line)."""
    out = _help("benchcli.py")
    assert out.startswith("usage: benchcli.py"), out
    for path in BENCHMARKS:
        sentence = first_sentence(ast.get_docstring(ast.parse(path.read_text())))
        assert f"{path.name} " in out and sentence in out, (path.name, out)


def test_fault_loss_help_gives_every_default():
    """fault_loss.py --help showed no defaults (-i and --engine had no help text at all)."""
    out = _help("fault_loss.py")
    options: list[str] = []  # one entry per option: its line and the help lines under it
    for line in out.split("options:", 1)[1].splitlines():
        if line.startswith("  -"):
            options.append(line)
        elif options and line.startswith("    "):
            options[-1] += " " + line.strip()
    options = [o for o in options if not o.startswith("  -h,")]
    assert len(options) >= 13, out
    # an option without a value by default (None) says what unset means in its own words
    unset = ("--out", "--plot", "--table", "--results-dir")
    named = {line.split()[0]: line for line in options}
    assert all("(default: " in line for flag, line in named.items() if flag not in unset), options
    assert all("unset: " in named[flag] or "no play" in named[flag] for flag in unset), options
    assert "--seed SEED" in out and "(default: 1337)" in out and "(default: per_step)" in out


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_no_help_shows_a_default_of_none(path):
    """--help ended options without a default in "(default: None)" (and flags in "(default: False)")."""
    out = _help(path.name)
    assert "(default: None)" not in out and "(default: False)" not in out, out


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_every_option_says_what_it_is(path):
    """train_overhead.py's options and scaling.py's --seed had no help text at all."""
    lines = [*_help(path.name).split("options:", 1)[1].splitlines(), ""]
    # an option's help follows its flags on the same line, or (long flags) on indented lines below
    bare = [line.strip() for line, below in zip(lines, lines[1:], strict=False)
            if line.startswith("  -") and "  " not in line.strip()
            and not (below.startswith("      ") and below.strip())]
    assert not bare, bare
