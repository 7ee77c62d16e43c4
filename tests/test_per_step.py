"""per_step engine, pure parts: its run.json keys, the sampler over changing participants, the
per-step global batch and LR, and where a replica's addresses come from
(ddplab.engines.torchft_replica.endpoint)."""

from __future__ import annotations

import json
import random
import time
import types

import numpy as np
import pytest
from ddplab.config import ConfigError, build_config
from ddplab.data import participant_sample_indices, rank_sample_indices
from ddplab.lr import participants_global_batch

PER_STEP = {"fault_tolerance": "per_step", "ft_lighthouse": "http://10.89.0.1:29510"}


def test_defaults_keep_torchelastic_and_the_contract_values():
    cfg = build_config()
    assert cfg.fault_tolerance == "torchelastic" and cfg.ft_lighthouse is None
    assert (cfg.ft_replica_id, cfg.ft_manager_port, cfg.ft_min_replicas) == (None, 29520, 1)
    assert (cfg.ft_timeout_s, cfg.ft_quorum_timeout_s) == (1.5, 60.0)
    assert (cfg.ft_start_replicas, cfg.ft_start_timeout_s) == (1, 60.0)
    assert cfg.ft_rejoin_wait_s == 60.0
    cfg = build_config({**PER_STEP, "ft_replica_id": "laptop-a", "ft_timeout_s": 3})
    assert cfg.fault_tolerance == "per_step" and cfg.ft_timeout_s == 3.0


@pytest.mark.parametrize(("values", "message"), [
    ({"fault_tolerance": "torchft"}, "'fault_tolerance' = 'torchft': must be one of torchelastic, per_step"),
    ({"fault_tolerance": "per_step"}, "'ft_lighthouse' = None: fault_tolerance per_step needs"),
    ({**PER_STEP, "ft_lighthouse": "10.89.0.1:29510"}, "must be 'http://ADDR:PORT'"),
    ({**PER_STEP, "ft_lighthouse": "http://10.89.0.1"}, "must be 'http://ADDR:PORT'"),
    ({**PER_STEP, "ft_lighthouse": "http://10.89.0.1:29510/x"}, "must be 'http://ADDR:PORT'"),
    ({**PER_STEP, "ft_lighthouse": "http://10.89.0.1:70000"}, "must be 'http://ADDR:PORT'"),
    ({**PER_STEP, "ft_manager_port": 0}, "'ft_manager_port' = 0: must be a TCP port"),
    ({**PER_STEP, "ft_manager_port": 65536}, "must be a TCP port"),
    ({**PER_STEP, "ft_manager_port": "x"}, "'ft_manager_port' = 'x': must be int"),
    ({**PER_STEP, "ft_min_replicas": 0}, "'ft_min_replicas' = 0: must be a positive integer"),
    ({**PER_STEP, "ft_timeout_s": 0}, "'ft_timeout_s' = 0.0: must be a number > 0"),
    ({**PER_STEP, "ft_quorum_timeout_s": -1}, "'ft_quorum_timeout_s' = -1.0: must be a number > 0"),
    ({**PER_STEP, "ft_start_replicas": 0}, "'ft_start_replicas' = 0: must be a positive integer"),
    ({**PER_STEP, "ft_start_timeout_s": 0}, "'ft_start_timeout_s' = 0.0: must be a number > 0"),
    ({**PER_STEP, "ft_rejoin_wait_s": 0}, "'ft_rejoin_wait_s' = 0.0: must be a number > 0"),
    ({**PER_STEP, "ft_replica_id": "laptop a"}, "'ft_replica_id' = 'laptop a': must be a non-empty name"),
    ({**PER_STEP, "ft_replica_id": "a:b"}, "without spaces or ':'"),
    ({**PER_STEP, "ft_lighthouses": "http://x:1"}, "unknown config key(s) in config file: ft_lighthouses"),
])
def test_bad_per_step_keys_are_one_line_errors(values, message):
    with pytest.raises(ConfigError) as err:
        build_config(values)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_per_step_cli_flags(tmp_path):
    from ddplab.config import parse_args

    cfg, _ = parse_args(["--fault-tolerance", "per_step", "--ft-lighthouse", "http://127.0.0.1:29510",
                         "--ft-manager-port", "29600", "--ft-replica-id", "laptop-b"])
    assert (cfg.ft_manager_port, cfg.ft_replica_id) == (29600, "laptop-b")


def blocks(samples_seen: int, participants: int, global_batch: int) -> list[np.ndarray]:
    return [participant_sample_indices(samples_seen, r, participants, global_batch)
            for r in range(participants)]


@pytest.mark.parametrize("policy", ["keep_per_rank", "keep_global"])
def test_committed_steps_take_every_sample_once_whatever_the_participants(policy):
    """A random run of quorums (participants 1..5, failed attempts retried at another count):
    the samples of the committed steps are exactly 0..samples_seen-1, each once."""
    rng = random.Random(7)
    samples_seen, taken = 0, []
    for _ in range(300):
        participants = rng.randint(1, 5)
        global_batch = participants_global_batch(policy, participants, 4, 14)
        step = blocks(samples_seen, participants, global_batch)
        if rng.random() < 0.2:
            continue  # not committed: nothing advances, the next attempt starts from the same place
        taken.extend(np.concatenate(step).tolist())
        samples_seen += global_batch
    assert sorted(taken) == list(range(samples_seen)) and len(taken) == len(set(taken))


def test_blocks_split_the_remainder_and_match_torchelastic_per_rank_layout():
    assert [b.tolist() for b in blocks(100, 3, 14)] == [
        [100, 101, 102, 103, 104], [105, 106, 107, 108, 109], [110, 111, 112, 113]]
    assert [len(b) for b in blocks(0, 3, 2)] == [1, 1, 0]  # more participants than samples
    for rank in range(3):  # keep_per_rank: the same windows as the torchelastic engine's
        np.testing.assert_array_equal(participant_sample_indices(48, rank, 3, 12),
                                      rank_sample_indices(48, rank, 3, 4))
    with pytest.raises(ValueError, match="rank 3 is not a participant rank of 3"):
        participant_sample_indices(0, 3, 3, 12)


def test_goyal_global_batch_follows_the_participants():
    assert [participants_global_batch("keep_per_rank", p, 12, None) for p in (1, 2, 3)] == [12, 24, 36]
    assert participants_global_batch("keep_global", 2, 12, 36) == 36
    with pytest.raises(ValueError, match="keep_global needs a global_batch_size"):
        participants_global_batch("keep_global", 2, 12, None)


def test_endpoint_advertises_the_gloo_address_and_the_agents_store():
    from ddplab.engines.torchft_replica import Endpoint, FaultToleranceError, endpoint

    env = {"DDPLAB_GLOO_ADDR": "10.89.0.11", "DDPLAB_RDZV_ENDPOINT": "10.89.0.11:29521",
           "MASTER_ADDR": "10.89.0.11", "MASTER_PORT": "41234", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert endpoint(env) == Endpoint("10.89.0.11", 29521, host_store=False)
    del env["DDPLAB_RDZV_ENDPOINT"]  # plain torchrun: its shared worker store
    assert endpoint(env) == Endpoint("10.89.0.11", 41234, host_store=False)
    env["TORCHELASTIC_USE_AGENT_STORE"] = "False"  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: host it
    assert endpoint(env) == Endpoint("10.89.0.11", 41234, host_store=True)
    assert endpoint({"DDPLAB_GLOO_ADDR": "127.0.0.1"}) == Endpoint("127.0.0.1", 0, host_store=True)
    with pytest.raises(FaultToleranceError, match="per_step needs DDPLAB_GLOO_ADDR"):
        endpoint({"MASTER_PORT": "1"})
    # a remote store (the torchelastic engine's, on the controller) is not a replica's store
    with pytest.raises(FaultToleranceError, match="--rdzv-endpoint 10.89.0.1:29400 is not on this"):
        endpoint({"DDPLAB_GLOO_ADDR": "10.89.0.11", "DDPLAB_RDZV_ENDPOINT": "10.89.0.1:29400"})
    local = {"DDPLAB_GLOO_ADDR": "10.89.0.11", "DDPLAB_RDZV_ENDPOINT": "localhost:29521"}
    assert endpoint(local) == Endpoint("10.89.0.11", 29521, host_store=False)


def test_per_step_without_gloo_addr_is_a_one_line_error_before_anything(tmp_path, data_path, tiny,
                                                                         clean_env):
    from ddplab.train import main

    clean_env.delenv("DDPLAB_GLOO_ADDR", raising=False)
    code = main(tiny(tmp_path / "out", data_path, fault_tolerance="per_step",
                     ft_lighthouse="http://127.0.0.1:9"))
    assert code == 2 and not (tmp_path / "out" / "metrics").exists()


def test_check_validates_per_step_without_the_units_environment(tmp_path, data_path, tiny, clean_env,
                                                                 capsys):
    """``--check`` (run by the ddp_job role outside the unit) does not need DDPLAB_GLOO_ADDR."""
    from ddplab.train import main

    clean_env.delenv("DDPLAB_GLOO_ADDR", raising=False)
    args = tiny(tmp_path / "out", data_path, fault_tolerance="per_step",
                ft_lighthouse="http://127.0.0.1:9")
    assert main([*args, "--check"]) == 0
    assert '"fault_tolerance": "per_step"' in capsys.readouterr().out


def test_a_signal_whose_exception_was_swallowed_still_stops_the_per_step_loop():
    """torchft runs torch future callbacks in the training thread and turns what they raise into
    a failed collective: the SIGTERM handler's exception can be lost there; the guard's check
    between steps raises it again."""
    import os
    import signal

    from ddplab.train import SignalGuard, Terminated

    guard = SignalGuard()
    guard.install()
    try:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # the handler raises here, inside "a callback"
        except BaseException:  # noqa: BLE001 (what the future machinery does)
            pass
        with pytest.raises(Terminated, match="SIGTERM"):
            guard.check()
    finally:
        guard.uninstall()


class FakeManager:
    """The Manager's quorum id only (what Replica.follow_quorum and rejoined read)."""

    def __init__(self) -> None:
        self._quorum_id = -1


def replica_at(group_quorum_id: int | None):
    """A ddplab.engines.torchft_replica.Replica without a lighthouse: the quorum bookkeeping of its
    __init__ only."""
    from ddplab.engines.torchft_replica import Replica

    replica = Replica.__new__(Replica)
    replica.group_quorum_id, replica.cut_off, replica.manager = group_quorum_id, None, FakeManager()
    replica.last_quorum_id = replica.present_since = replica.group_participants = None
    return replica


def quorum(replica, quorum_id: int) -> None:
    replica.manager._quorum_id = quorum_id
    replica.follow_quorum(quorum_id)


def test_a_quorum_id_that_skips_ids_marks_the_replica_cut_off_until_it_rejoins():
    replica = replica_at(None)  # a first start: any first quorum, then each id follows on
    for quorum_id in (7, 8, 8, 9):
        quorum(replica, quorum_id)
        assert replica.cut_off is None and replica.group_quorum_id == quorum_id
    quorum(replica, 12)  # the lighthouse formed 10 and 11 without this replica
    cut = replica.cut_off
    assert (cut.last_quorum_id, cut.quorum_id) == (9, 12) and replica.group_quorum_id == 9
    assert replica.present_since == 12
    quorum(replica, 13)  # its own lone quorums follow on: still cut off, from the same gap
    assert replica.cut_off is cut and replica.group_quorum_id == 9 and replica.present_since == 12
    quorum(replica, 16)  # 14 and 15 went on without it too: present in every quorum from 16 on
    assert replica.cut_off is cut and replica.present_since == 16
    replica.rejoined()  # a step committed with a peer of the group
    assert replica.cut_off is None and replica.group_quorum_id == 16
    quorum(replica, 17)
    assert replica.cut_off is None and replica.group_quorum_id == 17


class MinGroup:
    """A MIN all-reduce among the replicas of one test, each calling from its own thread."""

    def __init__(self, size: int) -> None:
        import threading

        self.barrier = threading.Barrier(size)
        self.tensors: list = []

    def allreduce(self, tensor, reduce_op=None):
        import torch

        self.tensors.append(tensor)
        self.barrier.wait()
        low = torch.stack(self.tensors).min(dim=0).values
        self.barrier.wait()
        tensor.copy_(low)
        return types.SimpleNamespace(wait=lambda: None)


def exonerations(replicas) -> list[bool]:
    """Each replica's ``exonerated(len(replicas))`` over one MIN group, as torchft's would run."""
    import threading

    group, answers = MinGroup(len(replicas)), {}
    for replica in replicas:
        replica.manager.allreduce = group.allreduce
        replica.manager.errored = lambda: None

    def ask(i, replica):
        answers[i] = replica.exonerated(len(replicas))

    threads = [threading.Thread(target=ask, args=(i, r)) for i, r in enumerate(replicas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return [answers[i] for i in range(len(replicas))]


def test_the_whole_group_cut_off_by_quorums_nobody_received_is_the_group():
    """Both replicas of the group (quorum 6, 2 participants) skip quorum 7, which neither
    received (their calls timed out while the lighthouse was frozen; it answered them when it
    came back), and meet in quorum 8: no quorum since 6 held the group's state, so they train on.
    Before, each waited ft_rejoin_wait_s for 'a peer of the group' that was the other one."""
    pair = [replica_at(None), replica_at(None)]
    for replica in pair:
        quorum(replica, 6)
        replica.group_participants = 2  # what start_step passes: follow_quorum(6, 2)
        quorum(replica, 8)
        assert replica.cut_off is not None and replica.group_quorum_id == 6
    assert exonerations(pair) == [True, True]


@pytest.mark.parametrize(("groups", "participants_of_group", "expect"), [
    ((6, 6), (3, 3), False),  # two of the three of quorum 6: the third may have trained on
    ((6, 5), (2, 2), False),  # cut off from different quorums: one of them missed the other's
    ((6, 6), (None, None), False),  # quorum 6's size unknown (restored from disk after a restart)
])
def test_cut_off_replicas_that_are_not_the_whole_group_wait(groups, participants_of_group, expect):
    pair = [replica_at(None), replica_at(None)]
    for replica, group, size in zip(pair, groups, participants_of_group, strict=True):
        quorum(replica, group)
        replica.group_participants = size
        quorum(replica, 9)
        assert replica.cut_off is not None
    assert exonerations(pair) == [expect, expect]


def test_follow_quorum_keeps_the_group_quorums_participants():
    replica = replica_at(None)
    replica.follow_quorum(4, 3)
    assert (replica.group_quorum_id, replica.group_participants) == (4, 3)
    replica.follow_quorum(7, 1)  # a gap: the group's quorum and its size stay
    assert (replica.group_quorum_id, replica.group_participants) == (4, 3)


@pytest.mark.parametrize(("kept", "first", "cut_off"), [
    (None, 40, False),  # no quorum kept: a first start trains (alone too: min_replicas 1)
    (9, 10, False),  # the next quorum: it was in the last one (its peers were killed)
    (9, 9, False),  # the same quorum (no change since)
    (9, 1, False),  # ids started again: a new lighthouse, a restart of the whole job
    (9, 11, True),  # quorum 10 went on without it (a restarted worker whose group went on)
])
def test_a_restarted_worker_compares_its_first_quorum_with_the_kept_one(kept, first, cut_off):
    replica = replica_at(kept)
    quorum(replica, first)
    assert (replica.cut_off is not None) == cut_off
    assert replica.group_quorum_id == (kept if cut_off else first)


def test_the_group_quorum_id_is_read_from_the_file_this_agent_wrote_only(tmp_path):
    """A worker torchrun restarted knows the last group quorum (same agent); a new launch does
    not: a per_step resume starts a new lighthouse whose ids start again, and compared with the
    old ids every replica was 'cut off from quorum 1 to quorum 46' and none trained (newcomer,
    2026-12-01: before this, the file and the checkpoint's id were read by any launch)."""
    from ddplab.config import build_config
    from ddplab.distributed import DistEnv
    from ddplab.engines.per_step import GROUP_QUORUM_FILE, agent_identity
    from ddplab.train import Trainer

    trainer = Trainer(build_config({**PER_STEP, "out_dir": str(tmp_path)}), DistEnv.from_environ()).engine
    assert trainer.read_group_quorum_id() is None
    kept = tmp_path / GROUP_QUORUM_FILE
    kept.write_text(json.dumps({"quorum_id": 8, "step": 120, "agent": agent_identity()}) + "\n")
    assert trainer.read_group_quorum_id() == 8  # this agent's: a torchrun restart
    kept.write_text(json.dumps({"quorum_id": 1, "step": 500, "agent": "4242:1764570000.000"}) + "\n")
    assert trainer.read_group_quorum_id() is None  # an earlier launch's (a resume, a rejoin)
    replica = replica_at(trainer.read_group_quorum_id())
    quorum(replica, 46)  # the new lighthouse's first quorum this replica sees
    assert replica.cut_off is None and replica.group_quorum_id == 46
    kept.write_text(json.dumps({"quorum_id": 8, "step": 120}) + "\n")  # written before agents were named
    assert trainer.read_group_quorum_id() is None
    kept.write_text("{")  # torn
    assert trainer.read_group_quorum_id() is None


class VoteOutlivedItsDeadline:
    """A Manager whose vote call raises as torchft's does when the worker was frozen in it."""

    def __init__(self) -> None:
        self.errors: list[Exception] = []

    def current_step(self) -> int:
        return 4

    def should_commit(self) -> bool:
        raise TimeoutError('status: Cancelled, message: "Timeout expired"')

    def report_error(self, exc: Exception) -> None:
        self.errors.append(exc)


def test_a_vote_whose_call_timed_out_is_a_step_not_committed_not_a_crash():
    """CI, 2026-12-01: a replica frozen while it voted was thawed after its ft_timeout_s; the
    TimeoutError ended its worker (exit 1) instead of the step being retried."""
    import torch
    from ddplab.engines.torchft_replica import Replica
    from torchft.optim import OptimizerWrapper

    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    replica = Replica.__new__(Replica)
    replica.manager = VoteOutlivedItsDeadline()
    replica.optimizer = OptimizerWrapper(replica.manager, torch.optim.SGD([param], lr=0.5))
    assert replica.commit() is False
    assert torch.equal(param.detach(), torch.ones(3))  # no update applied
    assert [type(e) for e in replica.manager.errors] == [TimeoutError]


def test_checkpoints_carry_no_quorum_id_and_old_ones_still_load(tmp_path):
    """Review: since a293867 nothing read the checkpoint's ``ft_group_quorum_id`` (quorum ids
    belong to one lighthouse and launch; ft-group-quorum.json keeps the group's): dropped."""
    from types import SimpleNamespace

    from ddplab.config import build_config
    from ddplab.distributed import DistEnv
    from ddplab.train import Trainer

    trainer = Trainer(build_config({**PER_STEP, "out_dir": str(tmp_path)}), DistEnv.from_environ())
    trainer.engine.replica = SimpleNamespace(state=lambda: {"step": 3, "batches_committed": 0},
                                             group_quorum_id=7)
    extra = trainer.engine.state_dict()
    assert set(extra) == {"rng", "ft_manager"} and extra["ft_manager"]["step"] == 3
    import torch

    model = torch.nn.Linear(2, 2)
    trainer.model, trainer.optimizer = model, torch.optim.SGD(model.parameters(), lr=0.1)
    old = {"model": model.state_dict(), "optimizer": trainer.optimizer.state_dict(), "step": 12,
           "samples_seen": 96, "ft_group_quorum_id": 46, **extra}  # written before the change
    trainer.apply_state(old)
    assert (trainer.step, trainer.samples_seen) == (12, 96)


def test_a_new_agent_of_the_same_launch_reads_the_kept_group_quorum_id(tmp_path):
    """A rejoin's new agent (same run.json, same ft_launch_id) knows the last group quorum its
    node took part in, so after the group went on or finished it is cut off instead of counting
    as a first start (and training alone); another launch (a resume: a new ft_launch_id, maybe a
    new lighthouse) does not read it."""
    from ddplab.config import build_config
    from ddplab.distributed import DistEnv
    from ddplab.engines.per_step import GROUP_QUORUM_FILE
    from ddplab.train import Trainer

    def trainer(launch):
        cfg = build_config({**PER_STEP, "out_dir": str(tmp_path), "ft_launch_id": launch})
        return Trainer(cfg, DistEnv.from_environ()).engine

    kept = tmp_path / GROUP_QUORUM_FILE
    kept.write_text(json.dumps({"quorum_id": 8, "step": 120, "agent": "4242:1764570000.000",
                                "launch": "R-1"}) + "\n")  # written by the node's previous agent
    assert trainer("R-1").read_group_quorum_id() == 8  # a rejoin in the same launch
    assert trainer("R-2").read_group_quorum_id() is None  # a resume
    assert trainer(None).read_group_quorum_id() is None  # no launch id: the agent rule alone
    replica = replica_at(trainer("R-1").read_group_quorum_id())
    quorum(replica, 30)  # alone under the lighthouse after the group went on to quorum 29
    assert replica.cut_off is not None and replica.cut_off.last_quorum_id == 8


def test_ft_launch_id_is_a_name_without_spaces():
    with pytest.raises(ConfigError, match="'ft_launch_id' = 'a b': must be a non-empty name"):
        build_config({**PER_STEP, "ft_launch_id": "a b"})
