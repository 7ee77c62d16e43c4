"""The ``diloco`` engine: each laptop trains alone for ``sync_every`` inner steps, then the replicas
average their progress (DiLoCo: Douillard et al., "DiLoCo: Distributed Low-Communication Training
of Language Models", 2023; torchft's ``DiLoCo``).

Every laptop is one torchft replica group under the controller's lighthouse, as under per_step
(ddplab.engines.torchft_replica.Replica; this engine reuses per_step's quorum machinery: start
barrier, min replicas, cut-off waits, the kept group quorum id). What differs is when the replicas
meet:

* **A sync** at every step that is a multiple of ``sync_every`` (and at a worker's start on such a
  step), in :meth:`DiLoCoEngine.plan` before the next inner step: join the quorum (a replica behind
  its peers -- a rejoined or new laptop -- receives a live peer's whole state here, torchft's DiLoCo
  state among it: the last global parameters and the outer optimizer's), one sum over the
  participants (start barrier, cut off), then torchft DiLoCo's fragment sync: the pseudo-gradient
  (last global parameters minus this replica's own) averaged over the participants, the vote, and
  on commit the outer optimizer's step (SGD, Nesterov momentum ``outer_momentum``, lr
  ``outer_lr``) from the global parameters: every replica then holds the new global parameters. A
  sync that does not commit (a peer lost in it) changes nothing: each replica keeps its own
  parameters (no inner step is lost) and the sync is attempted again with the next quorum.
* **Inner steps** with no collective at all: this replica's block of the step's global batch,
  dealt over the replicas of the last sync's quorum (ddplab.data.participant_sample_indices, so
  they train on disjoint samples), its mean loss, and the run's optimizer (AdamW, the inner
  optimizer) at the LR of the block it sees. A replica lost between two syncs stops nobody: the
  others go on and the next sync's quorum leaves it out.

The run ends with a last sync (:meth:`DiLoCoEngine.finish`), so every replica finishes with the
same, averaged model. Evaluations fall on syncs (``eval_interval`` a multiple of ``sync_every``):
the step's evaluation runs right after the sync that follows it, over its quorum, on the common
model, and its periodic checkpoint then holds the new global parameters. A checkpoint holds the
replica's own parameters (the model), the inner optimizer's state, the last global parameters, the
outer optimizer's state and the count of syncs (torchft's Manager step, which a quorum compares to
find who is behind): a resume continues each replica's round where it was, bit for bit.

torchft internals: ``DiLoCo._fragments`` (its one fragment, the whole model) and the fragment's
``original_parameters`` (the global parameters), ``prepare_sync`` and ``perform_sync``, checked by
tests/test_torchft_internals.py (a torchft upgrade's checklist).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch
from torchft.local_sgd import DiLoCo

from ddplab.engines.base import Commit, Decision, LocalResult, Retry, Started, StepPlan
from ddplab.engines.per_step import MIN_REPLICAS_POLL_S, Held, PerStep
from ddplab.metrics import UNCOMMITTED_EVENT

if TYPE_CHECKING:
    from ddplab.config import TrainConfig


class Sync(Enum):
    """Why a sync did not commit (the value of its :class:`Retry`; per_step's :class:`Held` for
    the quorum's own reasons)."""

    NOT_COMMITTED = "the sync's vote failed: every replica keeps its own parameters"


class DiLoCoEngine(PerStep):
    """Inner steps alone, a torchft DiLoCo sync every ``sync_every`` steps (see the module doc)."""

    name = "diloco"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.saved: Mapping[str, Any] | None = None  # this engine's part of the resumed checkpoint
        self.saved_syncs = 0  # its torchft Manager step: the syncs the run had committed
        self.diloco: DiLoCo | None = None
        self.outer: torch.optim.Optimizer | None = None
        # (rank, replicas) of the last committed sync's quorum: how the round's samples are dealt
        self.quorum = (0, 1)
        self.synced_at: int | None = None  # the step of the last committed sync
        self.sync_s = 0.0  # seconds of this attempt's sync (plan)
        self.quorum_s = 0.0  # of which in the quorum (the lighthouse, the wait for the peers, a heal)
        self.synced: dict[str, Any] | None = None  # fields of the sync committed by this attempt

    # --- setup --------------------------------------------------------------------------------
    @classmethod
    def parameter_copies(cls, cfg: TrainConfig, world_size: int) -> int:
        """The global parameters, the outer optimizer's momentum, this replica's own parameters
        kept while a sync runs (to restore them when it fails) and the flat buffer of the sync's
        one all-reduce."""
        return 4

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Keep the checkpoint's DiLoCo state for :meth:`attach` (the global parameters and the
        outer optimizer need the model and the Manager first)."""
        saved = state.get("diloco")
        self.saved = saved if isinstance(saved, Mapping) else None
        manager = state.get("ft_manager")
        self.saved_syncs = int(manager.get("step", 0)) if isinstance(manager, Mapping) else 0

    def manager_step(self) -> int:
        """torchft's step counts the syncs here (DiLoCo commits once per sync), not inner steps."""
        return self.saved_syncs

    def attach(self) -> Started:
        """per_step's replica group, then torchft DiLoCo over the whole model with the run's
        optimizer as the inner one and SGD with Nesterov momentum as the outer one; a resumed
        checkpoint's global parameters, outer state, quorum and last sync restored."""
        started = super().attach()
        cfg, run = self.cfg, self.run
        self.outer = torch.optim.SGD(run.model.parameters(), lr=cfg.outer_lr,
                                     momentum=cfg.outer_momentum, nesterov=True)
        # pin_memory: no accelerator here; the global parameters are kept on the CPU either way.
        # One bucket holding the whole pseudo-gradient: one all-reduce per sync instead of one per
        # parameter tensor (each pays the ring's latency; torchft 0.2.0 packs a tensor only into a
        # bucket it fits in whole, so the bucket is never smaller than the model)
        whole_mb = sum(p.numel() * p.element_size() for p in run.model.parameters()) / 2**20
        self.diloco = DiLoCo(self.replica.manager, [run.model], run.optimizer, self.outer,
                             sync_every=cfg.sync_every, pin_memory=False, use_bucketization=True,
                             bucket_cap_mb=math.ceil(whole_mb) + 1)
        (self.fragment,) = self.diloco._fragments  # one fragment: the whole model
        if self.saved is not None:
            with torch.no_grad():
                for name, tensor in self.saved["global"].items():
                    self.fragment.original_parameters[name].copy_(tensor)
            self.outer.load_state_dict(self.saved["outer_optimizer"])
            self.quorum = tuple(self.saved.get("quorum", (0, 1)))
            self.synced_at = self.saved.get("synced_at")
        fields = {**started.fields, "sync_every": cfg.sync_every, "outer_lr": cfg.outer_lr,
                  "outer_momentum": cfg.outer_momentum, "syncs": self.saved_syncs}
        how = f"checkpoint of step {run.step}" if run.resumed_from is not None else "no checkpoint"
        line = (f"diloco replica {self.replica.replica_id} at {self.replica.addr} ({how}, "
                f"{self.saved_syncs} syncs; a live peer's newer state replaces it at the next sync), "
                f"a sync every {cfg.sync_every} inner steps, outer lr {cfg.outer_lr:g} momentum "
                f"{cfg.outer_momentum:g}")
        return Started(model=run.model, fields=fields, line=line)

    # --- one attempt --------------------------------------------------------------------------
    def sync_due(self) -> bool:
        """A sync before the next inner step: the run is at a multiple of ``sync_every`` it has
        not synced at (rounds stay aligned with the steps: a failed sync is attempted again at
        once, a healed replica takes its peer's step)."""
        step = self.run.step
        return step % self.cfg.sync_every == 0 and self.synced_at != step

    def plan(self) -> StepPlan | Retry:
        """A sync when one is due (:meth:`sync`), then this replica's block of the step's samples
        over the last sync's quorum, for its inner optimizer alone."""
        self.sync_s, self.quorum_s, self.synced = 0.0, 0.0, None
        if self.sync_due():
            held = self.sync()
            if held is not None:
                return held
        else:
            self.run.optimizer.zero_grad(set_to_none=True)
        rank, replicas = self.quorum
        return self.participant_plan(rank, replicas, local=True)

    def sync(self) -> Retry | None:
        """One attempt at a sync (see the module doc); None when it committed.

        Raises:
            CutOffError (ddplab.engines.torchft_replica): a cut-off replica's wait for its group
            is over.
        """
        cfg, run, replica = self.cfg, self.run, self.replica
        t0 = time.perf_counter()
        started = replica.start_step()  # the quorum; a replica behind its peers is healed here
        self.quorum_s = time.perf_counter() - t0
        run.check_signals()
        if started is None:  # no quorum within ft_quorum_timeout_s: ask again
            self.wait_for_a_quorum()
            return Retry(Held.NO_QUORUM)
        self.announced_no_quorum = False
        participants = started[1]
        self.keep_group_quorum_id()
        if replica.cut_off is not None and participants == 1:  # no peer of the group to heal from
            self.wait_for_the_group(participants)
            return Retry(Held.CUT_OFF)
        if participants < cfg.ft_min_replicas:  # every participant sees the count: none commits
            replica.commit()
            time.sleep(MIN_REPLICAS_POLL_S)
            return Retry(Held.TOO_FEW_REPLICAS)
        flags = torch.tensor([float(self.ready_to_start(participants)),
                              float(replica.cut_off is not None)], dtype=torch.float64)
        if not replica.sum(flags):
            return self.not_committed(participants, time.perf_counter() - t0, local=None)
        if flags[0] == 0:
            self.held_by_start_barrier(participants)
            return Retry(Held.START_BARRIER)
        if flags[1] == participants and not replica.exonerated(participants):
            self.wait_for_the_group(participants)
            return Retry(Held.ALL_CUT_OFF)
        own = [p.detach().clone() for p in run.model.parameters()]  # kept if the sync fails
        self.fragment.prepare_sync()
        committed = self.fragment.perform_sync()
        self.sync_s = time.perf_counter() - t0
        if not committed:
            return self.not_committed(participants, self.sync_s, own)
        self.committed_sync(participants)
        return None

    def committed_sync(self, participants: int) -> None:
        """The sync committed: the next round is dealt over every replica of its quorum (a healed
        one too: torchft's process group of the quorum), its fields go to the next step record."""
        replica = self.replica
        first = self.session_commits == 0
        self.session_commits += 1
        self.synced_at = self.run.step
        self.quorum = (replica.pg.quorum_rank, replica.pg.quorum_size)
        self.back_in_the_group(self.run.step)
        self.synced = {"sync": True, "sync_s": round(self.sync_s, 6),
                       "sync_quorum_s": round(self.quorum_s, 6), "sync_participants": participants,
                       "syncs": replica.step, **(self.start_barrier_fields() if first else {})}

    def not_committed(self, participants: int, seconds: float, local: list[torch.Tensor] | None) -> Retry:
        """The sync's vote failed: torchft put the last global parameters back; this replica's own
        (``local``, taken before the sync) are restored, so its inner steps stand and the next
        attempt syncs them. An ``uncommitted`` record (``sync: true``) says why: the error torchft
        reported for the sync's collective (read before this replica votes)."""
        replica, run = self.replica, self.run
        error = replica.error_text()
        if local is None:  # the barrier's sum failed: vote against the sync, nothing was changed
            replica.abstain("the sync's barrier sum failed")
        else:
            with torch.no_grad():
                for p, own in zip(run.model.parameters(), local, strict=True):
                    p.copy_(own)
        run.metrics.write(UNCOMMITTED_EVENT, attempted_step=run.step + 1, committed=False, sync=True,
                          participants=participants, quorum_id=replica.quorum_id, error=error,
                          attempt_s=round(seconds, 6), engine=self.name)
        if self.env.rank == 0:
            print(f"[ddplab] step {run.step}: sync not committed (quorum {replica.quorum_id}, "
                  f"{participants} participant(s){'; ' + error if error else ''}): every replica "
                  "keeps its own parameters; attempted again with the next quorum", flush=True)
        return Retry(Sync.NOT_COMMITTED)

    def reduce_gradients(self, plan: StepPlan) -> float:
        """Nothing to average at an inner step; the seconds of this attempt's sync (made in
        :meth:`plan`: the step's communication)."""
        return self.sync_s

    def decide(self, plan: StepPlan, local: LocalResult) -> Decision:
        """This replica's own figures, no collective: the mean loss of its block and whether its
        gradient norm is finite (a diverging replica stops alone; the others sync without it)."""
        n = sum(len(m.indices) for m in plan.micro_batches)
        loss = sum(loss * len(m.indices) for loss, m in zip(local.losses, plan.micro_batches,
                                                            strict=True)) / max(1, n)
        return Decision(loss, loss, not math.isfinite(local.grad_norm), 0.0)

    def commit(self, plan: StepPlan) -> Commit:
        """The inner optimizer's step (torchft may not read the state for a peer meanwhile). The
        step after a sync is recorded with the sync's fields; a segment opens when the replicas
        of the round changed."""
        run, replica, attempt = self.run, self.replica, self.attempt
        manager = replica.manager
        manager.disallow_state_dict_read()
        try:
            run.optimizer.step()
        finally:
            manager.allow_state_dict_read()
        fields: dict[str, Any] = {"committed": True, "engine": self.name,
                                  "participants": attempt.participants, "quorum_id": replica.quorum_id,
                                  "samples": list(attempt.samples), **(self.synced or {})}
        changed = attempt.participants != self.participants
        self.participants = attempt.participants
        return Commit(committed=True, fields=fields, log=bool(self.synced) or changed,
                      segment=self.segment(attempt.participants, replica.quorum_id))

    def grad_bytes(self, plan: StepPlan) -> int:
        """D of this step: the fp32 pseudo-gradient of every parameter when the attempt synced,
        else nothing (inner steps send no gradient)."""
        if not self.synced:
            return 0
        return super().grad_bytes(plan)

    def evaluates_in_next_step(self, step: int) -> bool:
        """An evaluation step is evaluated after the sync that follows it (at the next attempt,
        over the sync's quorum), the last step after the run's last sync (:meth:`finish`): both
        read the replicas' common model, and the checkpoint that follows holds it."""
        return step > 0 and (step % self.cfg.eval_interval == 0 or step == self.cfg.max_steps)

    # --- end, state ---------------------------------------------------------------------------
    def finish(self) -> None:
        """A last sync at the end of the run, unless the last step was synced: every replica
        ends with the same, averaged model."""
        while self.synced_at != self.run.step:
            if self.sync() is None:
                return

    def state_dict(self) -> dict[str, Any]:
        """per_step's (RNG, the Manager's count of syncs) and the DiLoCo state: the last global
        parameters, the outer optimizer, the last sync's quorum and step."""
        state = super().state_dict()
        if self.diloco is not None:
            state["diloco"] = {
                "global": {name: t.clone() for name, t in self.fragment.original_parameters.items()},
                "outer_optimizer": self.outer.state_dict(), "quorum": list(self.quorum),
                "synced_at": self.synced_at, "sync_every": self.cfg.sync_every,
            }
        return state


ENGINE = DiLoCoEngine
