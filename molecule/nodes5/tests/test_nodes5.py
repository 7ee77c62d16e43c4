"""Scenario `nodes5`, on the controller: five laptops in the inventory at their fixed addresses, the
elastic range 1:5, the short run at world size 5 throughout, and the fault run's poweroff and
rejoin (world size 5 -> 4 -> 5) in summary.json and report.html, with every host's artefacts."""

import json
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

testinfra_hosts = ["controller"]

PROJECT = Path(os.environ.get("MOLECULE_PROJECT_DIRECTORY", Path(__file__).resolve().parents[3]))
EPHEMERAL = Path(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"])
INVENTORY = Path(os.environ["MOLECULE_INVENTORY_FILE"]).parent
SETTINGS = yaml.safe_load((Path(__file__).resolve().parents[1] / "extra_vars.yml").read_text())
RUNS = EPHEMERAL / "runs"
NODES = 5
SHORT_RUN_STEPS = 60  # converge.yml

sys.path.insert(0, str(PROJECT / "train"))


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _hosts(run_dir: Path) -> list[str]:
    """The host folders of a collected run (each has metrics/; plots/ and .live/ have none)."""
    return sorted(
        p.name for p in run_dir.iterdir() if (p / "metrics").is_dir() and not p.name.startswith(".")
    )


@pytest.fixture(scope="module")
def runs() -> tuple[Path, Path]:
    """(the short run, the fault run): the two run folders converge made, oldest first (a run id
    starts with its launch time); runs/current names the fault run."""
    found = sorted(p for p in RUNS.iterdir() if p.is_dir() and not p.is_symlink())
    assert len(found) == 2, f"expected the short run and the fault run in {RUNS}: {found}"
    assert (RUNS / "current").resolve() == found[1], "runs/current does not name the fault run"
    return found[0], found[1]


@pytest.fixture(scope="module")
def short_run(runs) -> Path:
    return runs[0]


@pytest.fixture(scope="module")
def run_dir(runs) -> Path:
    return runs[1]


@pytest.fixture(scope="module")
def summary(run_dir) -> dict:
    return _summary(run_dir)


@pytest.fixture(scope="module")
def trainers() -> list[str]:
    listing = subprocess.run(
        [str(Path(sys.executable).with_name("ansible-inventory")), "-i", str(INVENTORY), "--list"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    data = json.loads(listing.stdout)
    hostvars = data["_meta"]["hostvars"]
    hosts = sorted(data["trainers"]["hosts"])
    return [(h, hostvars[h]) for h in hosts]


def test_inventory_names_five_nodes_at_their_fixed_addresses(trainers):
    net = os.environ.get("DDP_LAB_MOLECULE_NET", "10.89.211")
    prefix = os.environ.get("DDP_LAB_MOLECULE_NAME", "mol")
    assert [h for h, _ in trainers] == [f"{prefix}-laptop-{x}" for x in "abcde"]
    for i, (host, hv) in enumerate(trainers):
        assert hv["ansible_host"] == f"{net}.{11 + i}", host
        assert hv["lab_container"] == host


def test_short_run_trained_at_world_size_5_throughout(short_run):
    s = _summary(short_run)
    assert len(_hosts(short_run)) == NODES and sorted(s["hosts"]) == _hosts(short_run)
    assert [e["world_size"] for e in s["world_size_timeline"]] == [NODES]
    assert s["steps_completed"] == SHORT_RUN_STEPS


def test_elastic_range_is_1_to_5(run_dir):
    for host in _hosts(run_dir):
        journal = (run_dir / host / "journal.txt").read_text(errors="replace")
        assert re.search(r"min_nodes\s+:\s+1\b", journal), f"{host}: torchrun's min_nodes is not 1"
        assert re.search(r"max_nodes\s+:\s+5\b", journal), f"{host}: torchrun's max_nodes is not 5"


def test_world_size_timeline_5_4_5(summary):
    assert [e["world_size"] for e in summary["world_size_timeline"]] == [5, 4, 5]


def test_poweroff_and_rejoin_measured(summary):
    faults = summary["faults"]
    assert [f["mode"] for f in faults] == ["poweroff", "rejoin"]
    off, back = faults
    assert off["rank"] == 0 and back["node"] == off["node"]
    assert (off["world_size_before"], off["world_size_after"], off["outcome"]) == (5, 4, "recovered")
    assert (back["world_size_before"], back["world_size_after"], back["outcome"]) == (4, 5, "recovered")
    assert off["steps_lost"] == 0 and back["steps_lost"] == 0
    assert 0 < off["detected_s"] <= off["recovered_s"]


def test_training_completed(summary, run_dir):
    configured = {json.loads((run_dir / h / "run.json").read_text())["max_steps"] for h in _hosts(run_dir)}
    assert len(configured) == 1, configured
    max_steps = configured.pop()
    assert summary["steps_completed"] == summary["max_steps"] == max_steps
    assert summary["final_train_loss"] is not None and summary["final_val_loss"] is not None


def test_artefacts_from_every_host(run_dir, summary, trainers):
    from ddplab.records import read_metrics_dir

    hosts = _hosts(run_dir)
    assert hosts == [h for h, _ in trainers] and sorted(summary["hosts"]) == hosts
    assert sorted(summary["per_host"]) == hosts
    for host in hosts:
        d = run_dir / host
        recs, _skipped = read_metrics_dir(d / "metrics")
        assert any(r["event"] == "end" for r in recs), f"{host}: no end record"
        assert 5 in summary["per_host"][host]["world_sizes"], host
        assert (d / "journal.txt").stat().st_size > 0, host
        assert list((d / "checkpoints").glob("ckpt-*.pt")), f"{host}: no checkpoint collected"


class _Cards(HTMLParser):
    """The report's key figures: <div class="k">name</div><div class="v [long]">value</div>."""

    def __init__(self) -> None:
        super().__init__()
        self.cards: dict[str, str] = {}
        self._cls: str | None = None
        self._key = ""

    def handle_starttag(self, tag, attrs):
        classes = (dict(attrs).get("class") or "").split() if tag == "div" else []
        self._cls = "k" if "k" in classes else "v" if "v" in classes else None  # e.g. class="v long"

    def handle_data(self, data):
        if self._cls == "k":
            self._key = data.strip()
        elif self._cls == "v" and self._key:
            self.cards[self._key] = data.strip()
            self._key = ""


def test_report_shows_five_nodes_and_the_world_sizes(run_dir, summary):
    page = (run_dir / "report.html").read_text()
    parser = _Cards()
    parser.feed(page)
    hosts = _hosts(run_dir)
    assert parser.cards["nodes"] == f"{NODES}: {', '.join(hosts)}"
    assert parser.cards["world sizes"] == "5 → 4 → 5"
    assert parser.cards["faults injected"] == "2"
    assert parser.cards["steps completed"].startswith(str(summary["steps_completed"]))


def test_store_stopped():
    assert not (EPHEMERAL / "rdzv" / f"store-{SETTINGS['rendezvous_port']}.json").exists()
