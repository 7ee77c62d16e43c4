"""ddplab.agent's membership watch: an agent dropped from the rendezvous re-joins, never trains alone.

* unit: :class:`ddplab.agent.MembershipWatchedHandler` on a stand-in for torch's handler state
  (round moved on -> 1 node waiting; dropped from a round that goes on -> 0; torch's own count
  passes through; the switch to the watched backend only for c10d with MAX > 1);
* integration (tests/rdzv_harness.py, real torchrun agents and store): agent 0 trains alone at world
  size 1, its agent process is frozen (SIGSTOP) past the heartbeat window while agent 1 arrives;
  agent 1 drops it and forms round 2 alone. Thawed, agent 0 must re-join so that both train at world
  size 2 (before the watch: agent 0 went on at world size 1 in round 1, a split group).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from ddplab import agent
from rdzv_harness import ToyCluster, read_log


class FakeHandler:
    """The parts of torch's DynamicRendezvousHandler the watch reads, with a settable state."""

    def __init__(self) -> None:
        self._this_node = "node-a"
        self._state_holder = SimpleNamespace(state=SimpleNamespace(round=0, complete=False, participants={}))
        self.waiting = 0

    def set_state(self, round_: int, participants: list[str], complete: bool = True) -> None:
        self._state_holder.state = SimpleNamespace(
            round=round_, complete=complete, participants=dict.fromkeys(participants, 0)
        )

    def next_rendezvous(self) -> str:
        self.set_state(4, ["node-a", "node-b"])
        return "info"

    def num_nodes_waiting(self) -> int:
        return self.waiting


def test_watch_reports_a_waiting_node_when_the_round_moved_on_without_it(capsys):
    inner = FakeHandler()
    h = agent.MembershipWatchedHandler(inner, agent.WATCHED_BACKEND)
    assert h.num_nodes_waiting() == 0  # before any rendezvous: torch's count only
    assert h.next_rendezvous() == "info"
    assert h.joined_round == 4
    assert h.num_nodes_waiting() == 0  # still a participant of the joined round
    inner.set_state(5, ["node-b"], complete=False)  # round 5 open without us: no group yet
    assert h.num_nodes_waiting() == 0
    inner.set_state(5, ["node-b"])  # the others dropped us and formed round 5
    assert h.num_nodes_waiting() == 1
    assert "round 4 but round 5 was formed without it" in capsys.readouterr().err
    inner.waiting = 2  # torch's own count wins when nodes wait
    assert h.num_nodes_waiting() == 2


def test_watch_only_logs_a_drop_from_a_round_that_goes_on(capsys):
    inner = FakeHandler()
    h = agent.MembershipWatchedHandler(inner)
    h.next_rendezvous()
    inner.set_state(4, ["node-b"])  # same round: our workers are still in its group
    assert h.num_nodes_waiting() == 0
    assert h.num_nodes_waiting() == 0
    assert capsys.readouterr().err.count("dropped from the rendezvous state (round 4") == 1
    assert h.get_backend() == "ddplab-c10d"


def test_watch_restarts_nothing_when_every_agent_missed_its_heartbeats(capsys):
    """Seen on the lab at load 20: right after the first round of 3, all three agents' heartbeats
    expired at once; the emptied round 0 was closed (round 1, no participants). The workers are
    still one group of 3: no agent may restart (a first version of the watch restarted all)."""
    inner = FakeHandler()
    h = agent.MembershipWatchedHandler(inner)
    h.next_rendezvous()
    inner.set_state(5, [], complete=False)
    assert h.num_nodes_waiting() == 0
    assert "re-joining" not in capsys.readouterr().err


def test_watch_refuses_a_handler_without_rendezvous_state():
    with pytest.raises(RuntimeError, match="no rendezvous state to watch"):
        agent.MembershipWatchedHandler(object())


@pytest.mark.parametrize(
    ("argv", "watched"),
    [
        (["--nnodes", "1:3", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "x.py"], True),
        (["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "x.py"], False),
        (["--standalone", "--nnodes", "1:2", "x.py"], False),
        (["--nnodes", "2", "--rdzv-backend", "static", "--master-addr", "h", "x.py"], False),
    ],
)
def test_watched_backend_only_for_c10d_with_more_than_one_node(argv, watched):
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    args = torchrun.parse_args(argv)
    backend = args.rdzv_backend
    assert agent.watch_membership(args) is watched
    assert args.rdzv_backend == (agent.WATCHED_BACKEND if watched else backend)
    if watched:
        assert agent.watch_membership(torchrun.parse_args(argv))  # registering twice is fine
        assert rendezvous_handler_registry._registry[agent.WATCHED_BACKEND] is agent._create_watched_handler


def _steps(c: ToyCluster, i: int, after: float) -> list[dict]:
    return [r for r in read_log(c.log_path(i)) if r.get("event") == "step" and r["time"] > after]


@pytest.mark.slow
def test_agent_frozen_past_its_heartbeats_rejoins_instead_of_training_alone(tmp_path: Path):
    c = ToyCluster(tmp_path, nnodes=2)
    try:
        c.start(agents=[0])
        assert c.wait_world(1, [0], 120) is not None, (tmp_path / "agent0.out").read_text()[-3000:]
        os.kill(c.agents[0].pid, signal.SIGSTOP)  # the agent only: its worker goes on at world size 1
        frozen = time.time()
        c.start_agent(1)
        # agent 1 waits for round 1 to end, drops agent 0 after 3 heartbeats and forms round 2 alone
        alone = c.wait_world(1, [1], 120, after=frozen)
        assert alone is not None, (tmp_path / "agent1.out").read_text()[-3000:]
        time.sleep(1.0)  # a few steps of each
        assert _steps(c, 0, alone), "agent 0's worker stopped while only its agent was frozen"
        os.kill(c.agents[0].pid, signal.SIGCONT)
        thawed = time.time()
        both = c.wait_world(2, [0, 1], 90, after=thawed)
        out0 = (tmp_path / "agent0.out").read_text(errors="replace")
        assert both is not None, (
            "split group: after the thaw agent 0 never trained with agent 1 at world size 2 "
            f"(agent 0's last step {c.latest(0)}, agent 1's {c.latest(1)})\n{out0[-3000:]}"
        )
        assert "re-joining" in out0
        time.sleep(2.0)
        late = time.time() - 1.5
        assert {r["world_size"] for i in (0, 1) for r in _steps(c, i, late)} == {2}
    finally:
        if c.agents:
            os.kill(c.agents[0].pid, signal.SIGCONT)
        c.close()


def test_event_names_match_torchs_without_inspecting_the_stack():
    """ddplab.agent.caller_name returns what torch's get_method_name returns, at every depth, in
    microseconds instead of about a millisecond (inspect.stack())."""
    import time

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    torch_names = dynamic_rendezvous.get_method_name

    class Executor:
        def _record(self, namer, depth):
            return namer(depth)

        def _keep_alive(self, namer, depth):
            return self._record(namer, depth)

    ex = Executor()
    for depth in (1, 2, 3, 500):  # 0 is each function itself
        assert ex._keep_alive(agent.caller_name, depth) == ex._keep_alive(torch_names, depth), depth
    assert ex._keep_alive(agent.caller_name, 2) == "_keep_alive"
    t = time.process_time()
    for _ in range(1000):
        ex._keep_alive(agent.caller_name, 2)
    assert time.process_time() - t < 0.5  # 1000 calls; torch's takes ~1 ms each


def test_agent_installs_the_cheap_event_names():
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    before = dynamic_rendezvous.get_method_name
    try:
        agent.cheap_event_names()
        assert dynamic_rendezvous.get_method_name is agent.caller_name
    finally:
        dynamic_rendezvous.get_method_name = before
