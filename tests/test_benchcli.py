"""benchmarks/benchcli.py: every benchmark's ``--help`` starts with a whole sentence of its
docstring (the first line alone was cut mid-sentence in fault_loss.py and recovery.py)."""

import ast
import sys

import pytest
from labharness import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from benchcli import first_sentence  # noqa: E402

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
