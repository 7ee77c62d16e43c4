"""Bytes on the wire (ddplab.wire): the gloo interface found from its address, the NIC meter counts
what the interface carried within the steps only, the ring model, and the report's table."""

import json
from pathlib import Path

from ddplab import wire
from ddplab.controller import report
from ddplab.controller.report import data
from ddplab.controller.rundir import load_run


def test_the_interface_is_the_one_holding_the_gloo_address():
    assert wire.interface_of("127.0.0.1") == "lo"
    assert wire.gloo_interface("127.0.0.1", {"GLOO_SOCKET_IFNAME": "eth-none"}) == "lo"  # the address wins
    assert wire.gloo_interface(None, {"GLOO_SOCKET_IFNAME": "lo"}) == "lo"
    assert wire.gloo_interface(None, {"GLOO_SOCKET_IFNAME": "no-such-nic"}) is None
    assert wire.gloo_interface("203.0.113.9", {}) is None  # not an address of this host
    assert wire.gloo_interface(None, {}) is None


def test_model_is_two_n_minus_one_over_n_of_the_payload():
    assert wire.model_bytes(496_000_000, 1) == 0
    assert wire.model_bytes(496_000_000, 2) == 496_000_000
    assert wire.model_bytes(496_000_000, 3) == round(4 / 3 * 496_000_000)


class FakeCounters:
    """psutil.net_io_counters(pernic=True) of a NIC whose counters the test moves."""

    def __init__(self):
        self.sent = self.recv = 0

    def __call__(self, pernic=False):
        assert pernic
        return {"eth0": type("snetio", (), {"bytes_sent": self.sent, "bytes_recv": self.recv})()}

    def carry(self, sent, recv):
        self.sent += sent
        self.recv += recv


def test_meter_counts_the_bytes_of_the_steps_and_not_between_them(monkeypatch):
    nic = FakeCounters()
    monkeypatch.setattr(wire.psutil, "net_io_counters", nic)
    meter = wire.NicMeter("eth0")
    meter.begin()
    nic.carry(4_000, 5_000)
    meter.end(payload=1000, world_size=3)
    nic.carry(20_000_000, 20_000_000)  # between steps (an evaluation, a checkpoint): not counted
    meter.begin()
    nic.carry(2_000, 1_000)
    meter.end(payload=3000, world_size=3)
    model = round((wire.model_bytes(1000, 3) + wire.model_bytes(3000, 3)) / 2)
    assert meter.fields() == {"nic": "eth0", "nic_steps": 2, "nic_sent_bytes": 3_000, "nic_recv_bytes": 3_000,
                              "grad_bytes": 2000, "wire_model_bytes": model}
    again = meter.fields()  # taken: the next record starts anew
    assert again["nic_steps"] == 0 and again["nic_sent_bytes"] is None and again["grad_bytes"] is None
    meter.end(payload=10, world_size=2)  # an end without its begin (a failed attempt before): model only
    assert meter.fields()["nic_steps"] == 0


def test_meter_without_an_interface_counts_the_model_only():
    meter = wire.NicMeter(None)
    meter.begin()
    meter.end(payload=500, world_size=2)
    assert meter.fields() == {"nic": None, "nic_steps": 0, "nic_sent_bytes": None, "nic_recv_bytes": None,
                              "grad_bytes": 500, "wire_model_bytes": 500}


def _run_with_bytes(root: Path) -> Path:
    run = root / "run-wire"
    for rank, host in enumerate(("laptop-a", "laptop-b")):
        recs = []
        for step in (10, 20):
            recs.append({"event": "step", "time": 1_780_000_000.0 + step, "host": host, "rank": rank,
                         "local_rank": 0, "world_size": 2, "restart_count": 0, "step": step, "loss": 2.0,
                         "step_time_s": 1.0, "compute_s": 0.6, "allreduce_s": 0.4, "tokens_per_s": 100.0,
                         "grad_compression": "bf16", "grad_bytes": 1_000_000, "wire_model_bytes": 1_000_000,
                         "nic": "eth0", "nic_steps": 10 if step == 10 else 5,
                         "nic_sent_bytes": 1_040_000 if step == 10 else 1_100_000,
                         "nic_recv_bytes": 1_050_000})
        (run / host / "metrics").mkdir(parents=True)
        (run / host / "metrics" / f"{host}-local0.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in recs))
    return run


def test_report_shows_the_nic_bytes_beside_the_model_per_node(tmp_path):
    run = _run_with_bytes(tmp_path)
    rows = data.wire_rows(load_run(run))
    assert [(r.host, r.world_size, r.engine, r.grad_compression, r.steps, r.nic) for r in rows] == [
        ("laptop-a", 2, "torchelastic", "bf16", 15, "eth0"),
        ("laptop-b", 2, "torchelastic", "bf16", 15, "eth0")]
    assert rows[0].sent == (1_040_000 * 10 + 1_100_000 * 5) / 15 and rows[0].model == 1_000_000
    assert round(rows[0].ratio, 2) == 1.06
    assert report.main([str(run)]) == 0
    page = (run / "report.html").read_text()
    assert "<h2>Bytes on the wire</h2>" in page
    assert "<td>laptop-a</td><td class=\"n\">2</td><td>torchelastic / bf16</td><td>eth0</td>" in page
    assert "1.06 MB" in page and "1 MB" in page
