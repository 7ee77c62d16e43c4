"""The ``per_step`` engine: a torchft quorum before every step; survivors keep training.

The worker is the one worker of its node's replica group (ddplab.engines.torchft_replica.Replica:
torchft's Manager under the lighthouse on the controller). One attempt at a step:

1. :meth:`PerStep.plan` joins the quorum of the live replica groups (a replica behind its peers
   receives a live peer's state here) and plans this participant's block of the step's samples
   (ddplab.data.participant_sample_indices over the participants; the global batch follows the
   participants under keep_per_rank, ddplab.lr.participants_global_batch). No quorum, a replica
   cut off from its group with no peer of it, or fewer than ``ft_min_replicas`` participants:
   :class:`Held`, nothing computed.
2. :meth:`PerStep.reduce_gradients` averages the gradients over the participants (one all-reduce).
3. :meth:`PerStep.decide` sums [loss, "a gradient norm is not finite", "ready to start",
   "cut off"] over the participants in one all-reduce: the start barrier (the first step of a job
   waits for ``ft_start_replicas``) and a quorum of cut-off replicas hold the step back.
4. :meth:`PerStep.commit` votes; the optimizer steps only when every participant commits (torchft's
   ``should_commit``), otherwise nothing changes and the step is attempted with the next quorum (an
   ``uncommitted`` record). A commit with a new participant count opens a history segment.

The evaluation of an eval step runs inside the next step's quorum, dealt over its participants
(:meth:`PerStep.evaluates_in_next_step`): no participant is late for the next quorum, and a joiner
is healed before it evaluates. A cut-off replica (:meth:`Replica.follow_quorum`) never trains
alone; it waits ``ft_rejoin_wait_s`` for a peer of the group, then ends with exit 4
(:data:`ddplab.exit_codes.EXIT_CUT_OFF`; ddplab.agent does not restart it). The last quorum the
replica took part in with the group is kept beside the checkpoints (:data:`GROUP_QUORUM_FILE`), so a
restarted worker can tell it was cut off.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

from ddplab.balance import weighted_micro_batches
from ddplab.data import participant_sample_indices
from ddplab.engines.base import (
    Commit,
    Decision,
    Engine,
    Failure,
    Group,
    LocalResult,
    Retry,
    Segment,
    Started,
    StepPlan,
)
from ddplab.engines.torchft_replica import CutOffError, Replica, endpoint, no_quorum_error
from ddplab.exit_codes import EXIT_CUT_OFF
from ddplab.lr import BatchPlan, participants_global_batch
from ddplab.outputs import atomic_write_text
from ddplab.records import read_jsonl

if TYPE_CHECKING:
    from ddplab.config import TrainConfig

#: The last quorum the replica took part in with the group, kept beside the checkpoints
#: (Replica.follow_quorum), so that a restarted worker can tell it was cut off.
GROUP_QUORUM_FILE = "ft-group-quorum.json"
#: Pause between two quorums while a step is held back (too few replicas, the start barrier, a
#: replica cut off or without a quorum).
MIN_REPLICAS_POLL_S = 0.5


class Held(Enum):
    """Why an attempt computed or committed nothing (the value of its :class:`Retry`)."""

    NO_QUORUM = "no quorum from the lighthouse within ft_quorum_timeout_s"
    CUT_OFF = "cut off from the group: waiting for a peer of the group"
    TOO_FEW_REPLICAS = "fewer participants than ft_min_replicas"
    START_BARRIER = "waiting for ft_start_replicas"
    ALL_CUT_OFF = "every participant cut off"


@dataclass(frozen=True)
class Attempt:
    """The attempt in flight: its participants and the [first, stop) sample indices of this
    participant's block (the ``samples`` of its record)."""

    participants: int
    samples: tuple[int, int]


def agent_identity() -> str:
    """``"<pid>:<start time>"`` of this worker's parent, the torchrun agent that started it: the
    same for every worker one agent starts (its restarts), another for each launch of the job."""
    import psutil

    parent = psutil.Process(os.getppid())
    return f"{parent.pid}:{parent.create_time():.3f}"


class PerStep(Engine):
    """One torchft replica group per node (see the module doc)."""

    name = "per_step"
    # torchft's quorum thread, blocked in a call to a peer that is gone, would hold the exit
    exit_may_block = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.started_at = time.time()  # the start barrier's clock (ft_start_timeout_s)
        self.replica: Any = None  # Replica, from attach
        self.attempt: Attempt | None = None
        self.participants = self.env.world_size  # participants of the last committed step
        self.session_commits = 0  # the first commit of this session waits for the start barrier
        self.start_wait_began: float | None = None  # first attempt held back by the barrier
        self.waiting_for_replicas = False  # fewer participants than ft_min_replicas, announced
        # the group quorum id last kept on disk (GROUP_QUORUM_FILE); see previous_cut_off
        self.kept_quorum_id: int | None = None
        self.waited_for_quorum_id: int | None = None
        self.announced_cut_off = False  # a cut-off replica's wait for a peer has been announced
        self.announced_no_quorum = False  # a failed quorum call was announced

    # --- setup --------------------------------------------------------------------------------
    @classmethod
    def parameter_copies(cls, cfg: TrainConfig, world_size: int) -> int:
        """The flat buffer of every gradient that one all-reduce averages
        (:meth:`Replica.average_gradients`)."""
        return 1

    def check(self, check_only: bool) -> None:
        """One worker per replica group, and (not under ``--check``) the node's address.

        Raises:
            ValueError: WORLD_SIZE is not 1.
            FaultToleranceError: DDPLAB_GLOO_ADDR unset.
        """
        if self.env.world_size != 1:
            raise ValueError(f"fault_tolerance {self.name} runs one worker per replica group, not "
                             f"WORLD_SIZE={self.env.world_size}: launch torchrun with "
                             "--nnodes 1 --nproc-per-node 1 on each node")
        if not check_only:  # --check runs outside the unit, without its environment
            endpoint()

    def attach(self) -> Started:
        """Start this node's replica group (:class:`Replica`): it wraps the optimizer and joins
        the lighthouse; the ``start`` record says where it is reached."""
        cfg, run = self.cfg, self.run
        self.kept_quorum_id = self.read_group_quorum_id()
        self.waited_for_quorum_id = self.previous_cut_off()
        self.replica = Replica(cfg, run.optimizer, lambda: run.state_dict("transfer"),
                               run.load_peer_state, step=self.manager_step(),
                               group_quorum_id=self.kept_quorum_id)
        fields = {"ft_group_quorum_id": self.kept_quorum_id, "ft_rejoin_wait_s": cfg.ft_rejoin_wait_s,
                  "replica_id": self.replica.replica_id, "ft_addr": self.replica.addr,
                  "ft_manager_port": cfg.ft_manager_port, "ft_store_port": self.replica.store_port,
                  "ft_lighthouse": cfg.ft_lighthouse, "ft_start_replicas": cfg.ft_start_replicas,
                  "ft_start_timeout_s": cfg.ft_start_timeout_s, "ft_timeout_s": cfg.ft_timeout_s}
        how = f"checkpoint of step {run.step}" if run.resumed_from is not None else "no checkpoint"
        line = (f"per_step replica {self.replica.replica_id} at {self.replica.addr} ({how}; a live "
                "peer's newer state replaces it at the first quorum)")
        return Started(model=run.model, fields=fields, line=line)

    def manager_step(self) -> int:
        """The step torchft's Manager starts from (its count of committed quorum steps, which a
        quorum compares to find who is behind): here the run's committed step."""
        return self.run.step

    def read_group_quorum_id(self) -> int | None:
        """The last quorum this replica took part in with the group before this worker started,
        as GROUP_QUORUM_FILE keeps it (at every change), when it was written in the same launch:
        by the same agent (a worker torchrun restarted) or, with ``ft_launch_id``, by any agent of
        the same launch (a rejoin's new agent: the rejoin keeps run.json). Then a rejoin after the
        group went on, or finished, sees the gap and never trains alone (a new agent would count
        as a first start). None otherwise: a first start, an unreadable file, or a file of another
        launch: a resume (a new ``ft_launch_id``) may have a new lighthouse that numbers its
        quorums from 1 again, and compared with ids of another lighthouse every replica would be
        'cut off' and none would train. Checkpoints carry no quorum id for the same reason."""
        try:
            kept = json.loads((self.run.out / GROUP_QUORUM_FILE).read_text())
        except (OSError, ValueError):
            return None
        launch = self.cfg.ft_launch_id
        if not isinstance(kept, dict) or not (
                kept.get("agent") == agent_identity() or (launch and kept.get("launch") == launch)):
            return None
        return kept["quorum_id"] if isinstance(kept.get("quorum_id"), int) else None

    def previous_cut_off(self) -> int | None:
        """When the attempt before this torchrun restart stopped cut off (its ``failure``
        record, cause ``cut_off``), the last group quorum id it waited from, else None. It waited
        ``ft_rejoin_wait_s`` already: cut off from the same quorum, this attempt stops at once
        (``--max-restarts`` attempts would each wait again)."""
        env, path = self.env, self.run.metrics.path
        if env.restart_count == 0 or not path.exists():
            return None
        failures = [r for r in read_jsonl(path)[0] if r.get("event") == "failure"]
        last = failures[-1] if failures else {}
        if last.get("cause") == "cut_off" and last.get("restart_count") == env.restart_count - 1:
            quorum_id = last.get("last_group_quorum_id")
            return quorum_id if isinstance(quorum_id, int) else None
        return None

    # --- one attempt --------------------------------------------------------------------------
    def plan(self) -> StepPlan | Retry:
        """Join the quorum (``optimizer.zero_grad``: a replica behind the others is healed here),
        keep the group's quorum id, then plan this participant's block of the step's samples."""
        cfg, run, replica = self.cfg, self.run, self.replica
        started = replica.start_step()
        run.check_signals()
        if started is None:  # no quorum within ft_quorum_timeout_s: nothing computed, ask again
            self.wait_for_a_quorum()
            return Retry(Held.NO_QUORUM)
        if self.announced_no_quorum:
            print(f"[ddplab] step {run.step + 1}: a quorum again (quorum {replica.quorum_id})",
                  flush=True)
            self.announced_no_quorum = False
        rank, participants = started
        if replica.step != run.step:
            raise RuntimeError(f"torchft is at step {replica.step}, the training state at step "
                               f"{run.step}: the state transfer did not apply")
        self.keep_group_quorum_id()
        if replica.cut_off is not None and participants == 1:  # no peer of the group to heal from
            self.wait_for_the_group(participants)
            return Retry(Held.CUT_OFF)
        if participants < cfg.ft_min_replicas:
            # every participant sees the same count: none computes and the vote fails for all
            replica.commit()
            if not self.waiting_for_replicas:
                print(f"[ddplab] step {run.step + 1}: {participants} participant(s), waiting for "
                      f"ft_min_replicas {cfg.ft_min_replicas}", flush=True)
            self.waiting_for_replicas = True
            time.sleep(MIN_REPLICAS_POLL_S)
            return Retry(Held.TOO_FEW_REPLICAS)
        self.waiting_for_replicas = False
        return self.participant_plan(rank, participants)

    def participant_plan(self, rank: int, participants: int, local: bool = False) -> StepPlan:
        """This participant's contiguous block of the step's global batch (equal blocks, or its
        share when ``run.balance`` splits: ddplab.balance), in micro-batches of at most
        ``per_rank_batch_size``; each weighted by its samples x participants / global batch (the
        average over participants is then the mean over the global batch), its dropout seeded by
        (seed, step, first sample).

        ``local``: the participant steps its own optimizer on its block alone (diloco's inner
        steps, equal blocks): each micro-batch weighted by its share of the block (the gradient is
        the block's mean) and the LR scale that of the block, ``samples / reference_batch_size``
        (Goyal et al. for the batch this optimizer sees)."""
        cfg, run = self.cfg, self.run
        global_batch = participants_global_batch(
            cfg.batch_policy, participants, cfg.per_rank_batch_size,
            # keep_global without a size: the global batch of the run's first start
            cfg.global_batch_size or run.first_global_batch or participants * cfg.per_rank_batch_size)
        group = Group(rank, participants, self.replica.sum,
                      key=f"{cfg.ft_launch_id}/{self.replica.quorum_id}")
        split = None if local else run.balance.split(group, global_batch)
        indices = (split.indices if split is not None
                   else participant_sample_indices(run.samples_seen, rank, participants, global_batch))
        # local: weighted as a group of one whose global batch is the block (the block's mean)
        micro = weighted_micro_batches(indices, cfg.per_rank_batch_size, 1 if local else participants,
                                       len(indices) if local else global_batch, cfg.seed, run.step)
        optimized = len(indices) if local else global_batch  # the batch one optimizer step sees
        batch = BatchPlan(cfg.batch_policy, participants, len(indices), len(micro), global_batch,
                          cfg.reference_batch_size, optimized / cfg.reference_batch_size)
        first = int(indices[0]) if len(indices) else run.samples_seen
        self.attempt = Attempt(participants, (first, first + len(indices)))
        return StepPlan(group, batch, micro)

    @property
    def member_name(self) -> str:
        """The replica group's id (``ft_replica_id``, else the host name)."""
        return self.replica.replica_id if self.replica else super().member_name

    def reduce_gradients(self, plan: StepPlan) -> float:
        """One all-reduce of every gradient over the participants (a failure does not raise: the
        vote fails)."""
        return self.replica.average_gradients(self.run.model.parameters())

    def decide(self, plan: StepPlan, local: LocalResult) -> Decision | Retry:
        """One sum over the participants of [loss sum, "gradient norm not finite", "ready to
        go", "cut off"]; every participant sees the same sums, so all hold back or none:
        :attr:`Held.START_BARRIER` (:meth:`ready_to_start`), :attr:`Held.ALL_CUT_OFF` (no
        participant took part in the group's last quorums, and none missed only quorums formed by
        another one waiting: Replica.exonerated; :meth:`wait_for_the_group`). A failed
        sum decides nothing (``mean_loss`` None): the step will not commit.

        Raises:
            CutOffError: a cut-off replica's wait is over.
        """
        t0 = time.perf_counter()
        participants, global_batch = plan.group.size, plan.batch.global_batch_size
        loss_sum = sum((loss * len(m.indices) for loss, m in zip(local.losses, plan.micro_batches,
                                                                strict=True)), 0.0)
        local_loss = loss_sum / max(1, plan.batch.per_rank_batch_size)
        bad = 0.0 if math.isfinite(local.grad_norm) else 1.0
        sums = torch.tensor([loss_sum, bad, float(self.ready_to_start(participants)),
                             float(self.replica.cut_off is not None)], dtype=torch.float64)
        if not self.replica.sum(sums):
            return Decision(None, local_loss, bool(bad), time.perf_counter() - t0)
        if sums[2] == 0:
            self.held_by_start_barrier(participants)
            return Retry(Held.START_BARRIER)
        if sums[3] == participants and not self.replica.exonerated(participants):
            self.wait_for_the_group(participants)
            return Retry(Held.ALL_CUT_OFF)
        return Decision(float(sums[0]) / global_batch, local_loss, bool(sums[1] > 0),
                        time.perf_counter() - t0)

    def commit(self, plan: StepPlan) -> Commit:
        """The vote: the optimizer steps only when every participant commits. A committed step
        gets a ``step`` record at every new participant count and at the session's first commit
        (with the start barrier's ``start_replicas`` and ``start_wait_s``); an attempt that did
        not commit (torchft's ``should_commit`` False: nothing changed) gets an ``uncommitted``
        record with why the vote failed."""
        replica, run, attempt = self.replica, self.run, self.attempt
        committed = replica.commit()
        fields: dict[str, Any] = {"participants": attempt.participants, "quorum_id": replica.quorum_id}
        if not committed:
            error = replica.error_text()
            fields.update(error=error, samples=list(attempt.samples), engine=self.name)
            return Commit(committed=False, fields=fields, note=(
                f"(quorum {replica.quorum_id}, {attempt.participants} participant(s)"
                f"{'; ' + error if error else ''}): attempted again with the next quorum"))
        first_commit = self.session_commits == 0
        self.session_commits += 1
        changed = attempt.participants != self.participants
        self.participants = attempt.participants
        self.back_in_the_group(run.step + 1)
        fields.update(committed=True, engine=self.name, samples=list(attempt.samples),
                      **(self.start_barrier_fields() if first_commit else {}))
        return Commit(committed=True, fields=fields, log=changed or first_commit,
                      segment=self.segment(attempt.participants, replica.quorum_id))

    def back_in_the_group(self, step: int) -> None:
        """A step (diloco: a sync) was committed at ``step``: a replica that was cut off did it
        with a peer of the group, whose state it holds now (healed when behind), so it belongs to
        the group again; said once when its wait was announced."""
        replica = self.replica
        if replica.cut_off is None:
            return
        replica.rejoined()
        if self.announced_cut_off:
            print(f"[ddplab] step {step}: replica {replica.replica_id} is back in the group "
                  f"(quorum {replica.quorum_id})", flush=True)
        self.announced_cut_off = False

    def segment(self, participants: int, quorum_id: int) -> Segment | None:
        """A history segment at each change of the participants (its LR scale drives the ramp)."""
        history = self.run.history
        if history and history[-1].get("participants") == participants:
            return None
        return Segment(participants, {"participants": participants, "quorum_id": quorum_id})

    def evaluates_in_next_step(self, step: int) -> bool:
        """Each ``eval_interval``-th committed step but the last (evaluated locally: no step
        follows) is evaluated inside the next step's quorum. A function of the committed step
        only, which every participant of a quorum shares (a joiner is healed before it asks):
        all of them run the same collectives."""
        return 0 < step < self.cfg.max_steps and step % self.cfg.eval_interval == 0

    def replays(self, failure: Mapping[str, Any]) -> bool:
        """Any failure record: its world_size is the participants of that step, and a restarted
        replica joins whatever quorum is live (its peers diverged too)."""
        return True

    # --- the start barrier --------------------------------------------------------------------
    def ready_to_start(self, participants: int) -> bool:
        """This replica's vote on the start barrier: the first step of a job waits until
        ``ft_start_replicas`` replicas participate, at most ``ft_start_timeout_s`` from the
        replica's start. A replica that committed a step in this session is always ready, so a
        joiner never holds live peers back: the barrier binds only when every participant is
        new (the start of the job, or a restart of the whole cluster). The step goes when any
        participant is ready (the first one to time out releases all)."""
        cfg = self.cfg
        return (self.session_commits > 0 or participants >= cfg.ft_start_replicas
                or time.time() - self.started_at >= cfg.ft_start_timeout_s)

    def held_by_start_barrier(self, participants: int) -> None:
        """The start barrier held this attempt back; say so once, vote against it, pause."""
        cfg = self.cfg
        if self.start_wait_began is None:
            self.start_wait_began = time.time()
            print(f"[ddplab] step {self.run.step + 1}: {participants} of ft_start_replicas "
                  f"{cfg.ft_start_replicas} replicas participate, waiting for the others (at most "
                  f"ft_start_timeout_s {cfg.ft_start_timeout_s:g} s from a replica's start)",
                  flush=True)
        self.replica.abstain(Held.START_BARRIER.value)
        time.sleep(MIN_REPLICAS_POLL_S)

    def start_barrier_fields(self) -> dict[str, Any]:
        """Fields of the first committed step record of a session: the start barrier's target
        (``start_replicas``) and how long this replica was held back by it (``start_wait_s``)."""
        began = self.start_wait_began
        return {"start_replicas": self.cfg.ft_start_replicas,
                "start_wait_s": round(time.time() - began, 3) if began is not None else 0.0}

    # --- cut off, no quorum -------------------------------------------------------------------
    def keep_group_quorum_id(self) -> None:
        """Write the replica's group quorum id to GROUP_QUORUM_FILE when it changed (a quorum
        change or a failed commit: rare but for the waits, at most one per 0.5 s)."""
        quorum_id = self.replica.group_quorum_id
        if quorum_id is None or quorum_id == self.kept_quorum_id:
            return
        atomic_write_text(self.run.out / GROUP_QUORUM_FILE, json.dumps(
            {"quorum_id": quorum_id, "replica_id": self.replica.replica_id, "step": self.run.step,
             "lighthouse": self.cfg.ft_lighthouse, "agent": agent_identity(),
             "launch": self.cfg.ft_launch_id,
             "time": round(time.time(), 3)}) + "\n")
        self.kept_quorum_id = quorum_id

    def wait_for_the_group(self, participants: int) -> None:
        """This replica was cut off (Replica.follow_quorum) and no participant of this
        quorum took part in the group's quorums since: its state may be behind steps the group
        committed, so it commits nothing, alone or with others cut off like it. It votes against
        the step and waits for a peer of the group to heal from, at most ``ft_rejoin_wait_s``
        from the quorum that showed the gap (not again after a torchrun restart that followed
        such a wait: :meth:`previous_cut_off`).

        Raises:
            CutOffError: the wait is over (the group finished or is gone).
        """
        cfg, cut, step = self.cfg, self.replica.cut_off, self.run.step
        waited = time.monotonic() - cut.since
        who = "alone" if participants == 1 else f"with {participants - 1} other cut-off replica(s)"
        again = self.waited_for_quorum_id == cut.last_quorum_id  # the attempt before waited
        if again or waited >= cfg.ft_rejoin_wait_s:
            missed = (f"quorum {cut.last_quorum_id + 1}" if cut.quorum_id - cut.last_quorum_id == 2
                      else f"quorums {cut.last_quorum_id + 1}-{cut.quorum_id - 1}")
            raise CutOffError(
                f"replica {self.replica.replica_id} was cut off from quorum {cut.last_quorum_id} to "
                f"quorum {cut.quorum_id}: the group went on without it ({missed}) and no peer of "
                f"the group came back within ft_rejoin_wait_s {cfg.ft_rejoin_wait_s:g} s"
                f"{' (waited by the attempt before this restart)' if again else ''}; nothing "
                f"trained alone, its state of step {step} and its checkpoints are kept. Fix: "
                "if the group finished, its result is the run's (this node's is not); else start "
                "the group again (this replica heals from a peer ahead), or raise "
                "ft_rejoin_wait_s (playbook: ddp_job_ft_rejoin_wait_s)", cut)
        if not self.announced_cut_off:
            self.announced_cut_off = True
            print(f"[ddplab] step {step + 1}: replica {self.replica.replica_id} was cut off "
                  f"from quorum {cut.last_quorum_id} to quorum {cut.quorum_id} and is {who}: it "
                  f"trains nothing until a peer of the group is back (at most ft_rejoin_wait_s "
                  f"{cfg.ft_rejoin_wait_s:g} s)", flush=True)
        self.replica.abstain(Held.CUT_OFF.value)
        time.sleep(MIN_REPLICAS_POLL_S)

    def wait_for_a_quorum(self) -> None:
        """The quorum call got no quorum within ``ft_quorum_timeout_s`` (the lighthouse is out of
        reach, e.g. a partition, or this worker was frozen in the call): nothing was computed or
        voted. The worker asks again within its own life: a torchrun restart would meet the same
        partition and spend one of ``--max-restarts`` per timeout. After ``ft_quorum_timeout_s +
        ft_rejoin_wait_s`` without a quorum the group has gone on without this replica, or is gone.

        Raises:
            CutOffError: no quorum for that long (``unreachable_s`` set).
        """
        cfg, replica = self.cfg, self.replica
        waited, bound = replica.no_quorum_s, cfg.ft_quorum_timeout_s + cfg.ft_rejoin_wait_s
        if waited >= bound:
            raise no_quorum_error(cfg, replica.replica_id, replica.group_quorum_id,
                                     replica.quorum_at, waited, replica.quorum_error, self.run.step)
        if not self.announced_no_quorum:
            self.announced_no_quorum = True
            print(f"[ddplab] step {self.run.step + 1}: no quorum from the lighthouse within "
                  f"ft_quorum_timeout_s {cfg.ft_quorum_timeout_s:g} s ({replica.quorum_error}); "
                  f"asking again, nothing trained (at most {bound:g} s without a quorum)",
                  flush=True)
        time.sleep(MIN_REPLICAS_POLL_S)

    # --- state, failure, end ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's RNG state (the draws are seeded per step, this carries the rest) and the
        torchft Manager's counters. No quorum id: ids belong to one lighthouse and one launch
        (:meth:`read_group_quorum_id` keeps the group's beside the checkpoints); checkpoints
        written with the former ``ft_group_quorum_id`` field load as before (it is not read)."""
        return {"rng": {"scheme": "stateless", "seed": self.cfg.seed, "torch": torch.get_rng_state()},
                "ft_manager": self.replica.state() if self.replica else {"step": self.run.step}}

    def failure(self, exc: BaseException) -> Failure | None:
        """A cut-off replica's end: exit 4, cause ``cut_off``, the quorums of the gap."""
        if not isinstance(exc, CutOffError):
            return None
        return Failure(EXIT_CUT_OFF, "cut_off", {
            "last_group_quorum_id": exc.cut_off.last_quorum_id, "quorum_id": exc.cut_off.quorum_id,
            "rejoin_wait_s": self.cfg.ft_rejoin_wait_s, "unreachable_s": exc.cut_off.unreachable_s})

    def close(self) -> None:
        """Stop the Manager server without waiting (a quorum call in flight is abandoned)."""
        if self.replica:
            self.replica.shutdown()


ENGINE = PerStep
