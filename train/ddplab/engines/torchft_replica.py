"""This node's torchft replica group: what the ``per_step`` and ``diloco`` engines
(ddplab.engines.per_step, ddplab.engines.diloco) use of torchft (docs/training.md).

Each node runs one replica group of one worker. Before every optimizer step the replica's torchft
``Manager`` asks the lighthouse (on the controller) for a quorum: the replica groups alive now.
The gradients are averaged over the quorum's participants through a reconfigurable gloo group,
and the step is applied only when every participant votes to commit it; a failed collective (a
peer died, froze or was cut off) makes the vote fail, the step is thrown away and retried with
the next quorum, without restarting any process. A replica that joins (a restarted node, or one
that fell behind) receives the whole training state from a live peer over the gloo group
(torchft's ``PGTransport``: no extra port, no checkpoint file).

Addresses: every address a replica advertises is ``DDPLAB_GLOO_ADDR`` (the node's address on the
route to the controller), never the host name (Ubuntu maps it to 127.0.1.1): the Manager's
``hostname``, the store address handed to the peers, and the gloo device
(:func:`ddplab.distributed.bound_gloo`; torchft's own ``ProcessGroupGloo`` builds its device from
the host name or ``GLOO_SOCKET_IFNAME``). Ports: the Manager listens on ``ft_manager_port``; the
replica's store, where the peers meet to build each quorum's gloo group, is the node's torchrun
rendezvous store (``--rdzv-endpoint ADDR:PORT --rdzv-conf is_host=true``, hosted by the agent, so
it outlives a worker restart), whose port ddplab.agent passes as ``DDPLAB_RDZV_ENDPOINT``. Without
it: torchrun's shared worker store (``TORCHELASTIC_USE_AGENT_STORE=True``, ``MASTER_PORT``), else
a store this worker hosts on ``MASTER_PORT`` or, without torchrun, an OS-chosen port.

torchft and torch internals this module relies on, each checked by one test (the checklist of a
torchft or torch upgrade: tests/test_torchft_internals.py, and test_ft_quorum.py for the two that
need a lighthouse frozen or a heal): the Manager's private ``_quorum_future``
(:meth:`Replica._forget_failed_quorum`), ``_connect_timeout`` and ``_executor``
(:meth:`Replica._masked_manager`) and ``_quorum_id`` (:attr:`Replica.quorum_id`); torchft's
``ProcessGroupGloo._create_pg`` and ``_timeout``, and torch's ``ProcessGroup._set_default_backend``
/ ``_register_backend`` and the backend's ``_set_sequence_number_for_group``
(:class:`BoundProcessGroupGloo`).
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import TCPStore
from torchft import Manager, ProcessGroupGloo
from torchft import Optimizer as OptimizerWrapper
from torchft.checkpointing.pg_transport import PGTransport

from ddplab.distributed import GLOO_ADDR_ENV, RDZV_ENDPOINT_ENV, bound_gloo

#: Set by torchrun in the worker's environment when the workers share the agent's store.
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
#: torchft Manager ``quorum_retries``: how often its server asks the lighthouse again within one
#: quorum call when the call to the lighthouse fails (a lighthouse restarted under a pending call
#: fails it with "transport error"; without a retry the worker's call then waits out the whole
#: ``ft_quorum_timeout_s``). A retry blocks connecting until the lighthouse listens again, so the
#: count is not what bounds the call: its deadline, ``ft_quorum_timeout_s``, is.
#: tests/test_ft_quorum.py restarts a lighthouse under a pending call.
LIGHTHOUSE_RETRIES = 1000


def _not_flight_recorder(record: logging.LogRecord) -> bool:
    """torchft warns at every quorum change that it cannot reset NCCL's flight recorder: there
    is no NCCL on these CPU nodes, the line is noise in the worker log."""
    return "flight recorder" not in record.getMessage()


logging.getLogger("torchft.manager").addFilter(_not_flight_recorder)


class FaultToleranceError(ValueError):
    """The per_step engine cannot start with this environment (one line naming the fix)."""


@dataclass(frozen=True)
class CutOff:
    """This replica was cut off from the group: the lighthouse formed quorums without it, or it
    could not reach the lighthouse at all.

    ``last_quorum_id`` is the last quorum it took part in with the group (None: none yet),
    ``quorum_id`` the first one it was given after the gap (ids ``last_quorum_id + 1 ..
    quorum_id - 1`` went on without it; None when no quorum came: ``unreachable_s``), ``since``
    the ``time.monotonic()`` of that quorum (or of the last quorum before the lighthouse went
    out of reach), ``unreachable_s`` the seconds without any quorum (None: a quorum came).
    """

    last_quorum_id: int | None
    quorum_id: int | None
    since: float
    unreachable_s: float | None = None


class CutOffError(RuntimeError):
    """A replica cut off from the group found no peer of the group within ``ft_rejoin_wait_s``
    (one message naming the quorums it missed and the fix)."""

    def __init__(self, message: str, cut_off: CutOff) -> None:
        super().__init__(message)
        self.cut_off = cut_off


def no_quorum_error(cfg: Any, replica_id: str, last_quorum_id: int | None, since: float, waited: float,
                    why: str | None, step: int) -> CutOffError:
    """The end of a replica that got no quorum at all (the lighthouse out of reach) for
    ``waited`` s, at least ``ft_quorum_timeout_s + ft_rejoin_wait_s``: one message naming the
    lighthouse, the wait, the last quorum it shared with the group and the fix."""
    after = f" after quorum {last_quorum_id}" if last_quorum_id is not None else ""
    return CutOffError(
        f"replica {replica_id} got no quorum from the lighthouse {cfg.ft_lighthouse} for {waited:.0f} s "
        f"(ft_quorum_timeout_s {cfg.ft_quorum_timeout_s:g} + ft_rejoin_wait_s {cfg.ft_rejoin_wait_s:g} s; "
        f"{why}): the group went on without it{after} or is gone; nothing trained alone, its state "
        f"of step {step} and its checkpoints are kept. Fix: if the group finished, its result is the "
        "run's (this node's is not); else check this node's route to the controller and start it "
        "again (kill-node.yml -e fault=rejoin: it heals from a peer ahead), or raise "
        "ft_rejoin_wait_s (playbook: ddp_job_ft_rejoin_wait_s)",
        CutOff(last_quorum_id, None, since, round(waited, 1)))


class BoundProcessGroupGloo(ProcessGroupGloo):
    """torchft's reconfigurable gloo group whose device listens on one address only.

    Every quorum change reconfigures the group: torchft calls :meth:`_create_pg` with the quorum's
    store, this replica's rank among the participants and their number.
    """

    def __init__(self, addr: str, timeout: timedelta) -> None:
        super().__init__(timeout=timeout)
        self.addr = addr
        # this replica's rank among every replica of the configured quorum (healing ones too) and
        # their number (the diloco engine deals its next round's samples over them)
        self.quorum_rank, self.quorum_size = 0, 1

    def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
        self.quorum_rank, self.quorum_size = rank, world_size
        base = torch.distributed.ProcessGroup
        backend = bound_gloo(store, rank, world_size, self._timeout, self.addr)
        backend._set_sequence_number_for_group()
        pg = base(store, rank, world_size)
        pg._set_default_backend(base.BackendType.GLOO)
        pg._register_backend(torch.device("cpu"), base.BackendType.GLOO, backend)
        return pg


@dataclass(frozen=True)
class Endpoint:
    """Where this replica is reached: ``addr`` (advertised), the store port and whether this
    process hosts the store (no torchrun agent store)."""

    addr: str
    store_port: int
    host_store: bool


def endpoint(environ: dict[str, str] | None = None) -> Endpoint:
    """The address and store of this replica from the environment (see the module doc).

    Raises:
        FaultToleranceError: ``DDPLAB_GLOO_ADDR`` is unset, or a port is not a number.
    """
    env = os.environ if environ is None else environ
    addr = env.get(GLOO_ADDR_ENV, "")
    if not addr:
        raise FaultToleranceError(
            f"fault_tolerance per_step needs {GLOO_ADDR_ENV}: the node's address on the route to "
            "the controller, advertised to the other replicas (the ddp_job unit sets it)")

    def port_of(name: str, raw: str) -> int:
        try:
            return int(raw) if raw else 0
        except ValueError:
            raise FaultToleranceError(f"environment variable {name}={env.get(name)!r}: "
                                      "the port is not a number") from None

    rdzv = env.get(RDZV_ENDPOINT_ENV, "")
    if rdzv:  # the agent's rendezvous store, on the node's address (--rdzv-endpoint ADDR:PORT)
        host, _, port = rdzv.rpartition(":")
        if host.strip("[]") not in (addr, "localhost") and not _is_loopback(host.strip("[]")):
            raise FaultToleranceError(
                f"fault_tolerance per_step: --rdzv-endpoint {rdzv} is not on this node's address "
                f"{addr} ({GLOO_ADDR_ENV}): each replica group uses a local store "
                f"(--rdzv-endpoint {addr}:PORT --rdzv-conf is_host=true)")
        return Endpoint(addr=addr, store_port=port_of(RDZV_ENDPOINT_ENV, port), host_store=False)
    port = port_of("MASTER_PORT", env.get("MASTER_PORT", ""))
    return Endpoint(addr=addr, store_port=port, host_store=env.get(AGENT_STORE_ENV) != "True" or not port)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Replica:
    """This node's replica group: the torchft Manager, its gloo group and the wrapped optimizer.

    Args:
        cfg: the run configuration (``ft_*`` keys).
        optimizer: the local optimizer; ``self.optimizer`` wraps it (``zero_grad`` starts the
            quorum, ``step`` applies the update only when the step commits).
        state_dict: returns the whole training state a joining replica needs.
        load_state_dict: applies a state received from a live peer.
        step: the committed step this replica starts from (its checkpoint's, else 0).
        group_quorum_id: the last quorum this replica took part in with the group before this
            process started (kept on disk by the trainer), None for a first start.

    Raises:
        FaultToleranceError: see :func:`endpoint`.
        CutOffError: the lighthouse did not answer within ``ft_quorum_timeout_s +
            ft_rejoin_wait_s`` (:func:`no_quorum_error`).
        RuntimeError: the store or the Manager's port cannot be used (torchft).
    """

    def __init__(self, cfg: Any, optimizer: torch.optim.Optimizer,
                 state_dict: Callable[[], dict[str, Any]],
                 load_state_dict: Callable[[dict[str, Any]], None], step: int = 0,
                 group_quorum_id: int | None = None) -> None:
        where = endpoint()
        self.group_quorum_id = group_quorum_id
        self.last_quorum_id: int | None = None  # the last quorum this replica was given
        self.present_since: int | None = None  # while cut off: see follow_quorum
        # participants of quorum group_quorum_id (None: not known, e.g. restored from disk)
        self.group_participants: int | None = None
        self.cut_off: CutOff | None = None
        self.quorum_at = time.monotonic()  # the last quorum this replica got (see no_quorum_s)
        self.quorum_error: str | None = None  # why the last quorum call failed (start_step)
        self.replica_id = cfg.ft_replica_id or socket.gethostname()
        self.addr = where.addr
        timeout = timedelta(seconds=cfg.ft_timeout_s)
        quorum_timeout = timedelta(seconds=cfg.ft_quorum_timeout_s)
        self._store = None
        port = where.store_port
        if where.host_store:  # no agent store to share: this worker hosts the replica's store
            self._store = TCPStore(where.addr, port, is_master=True, wait_for_workers=False,
                                   timeout=quorum_timeout)
            port = self._store.port
        self.store_port = port
        self.pg = BoundProcessGroupGloo(where.addr, timeout)
        # A worker started while the lighthouse is out of reach (a partition, a rejoin before the
        # route is back) waits for it in this life instead of spending a torchrun restart per
        # connect timeout: torchft's own connect retries with backoff (100 ms growing to 10 s)
        # for up to the Manager's ``connect_timeout``, set to the bound of a replica without
        # quorum, ft_quorum_timeout_s + ft_rejoin_wait_s. That bound is for the first connect
        # only: the Manager then keeps ``_connect_timeout`` for the client that fetches a peer's
        # state when healing, which is set back to ft_quorum_timeout_s (see _masked_manager).
        bound = cfg.ft_quorum_timeout_s + cfg.ft_rejoin_wait_s
        started = time.monotonic()
        try:
            self.manager = self._masked_manager(cfg, where.addr, port, timeout, quorum_timeout,
                                                timedelta(seconds=bound), state_dict, load_state_dict)
        except RuntimeError as exc:
            waited = time.monotonic() - started
            if waited < bound:  # not the connect running out (e.g. the Manager's port is taken)
                raise
            why = f"RuntimeError: {str(exc).split(';')[0]}"
            raise no_quorum_error(cfg, self.replica_id, group_quorum_id, started, waited, why,
                                  step) from None
        if step:
            self.manager.load_state_dict({"step": step, "batches_committed": 0})
        self.optimizer = OptimizerWrapper(self.manager, optimizer)

    def _masked_manager(self, cfg: Any, *args: Any) -> Manager:
        """:meth:`_manager`, with the quorum thread started. Threads started in here (torchft's
        Rust runtime, its quorum thread, gloo's, the announcement's timer) are born with
        SIGTERM/SIGINT blocked: the kernel then delivers them to this thread, and a wait for a
        quorum (a lock wait) is interrupted at once instead of up to the quorum timeout.

        If building the Manager (its store, its server, its connect to the lighthouse) takes
        longer than ``ft_timeout_s``, one line says so (torchft keeps trying, see ``__init__``).

        The longer connect bound given to the Manager is for its first connect only: torchft
        0.2.0 keeps the Manager's ``connect_timeout`` (private ``_connect_timeout``) for the
        client that fetches a peer's state when healing, so that is set back to
        ``ft_quorum_timeout_s`` here: a heal from a peer that was just powered off fails within
        it, not within ft_quorum_timeout_s + ft_rejoin_wait_s. torchft has no public setter."""
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        bound = cfg.ft_quorum_timeout_s + cfg.ft_rejoin_wait_s
        announce = threading.Timer(cfg.ft_timeout_s, lambda: print(
            f"[ddplab] replica {self.replica_id}: its start is taking longer than "
            f"{cfg.ft_timeout_s:g} s (ft_timeout_s; lighthouse at {cfg.ft_lighthouse}); torchft "
            f"keeps trying to connect for at most {bound:g} s (ft_quorum_timeout_s + "
            "ft_rejoin_wait_s)", flush=True))
        announce.daemon = True
        try:
            announce.start()
            manager = self._manager(cfg, *args)
            manager._connect_timeout = timedelta(seconds=cfg.ft_quorum_timeout_s)  # the heal's
            # torchft has no public way to start the quorum thread: one no-op task on its
            # private executor starts it now, with the signals masked
            manager._executor.submit(int).result()
            return manager
        finally:
            announce.cancel()
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def _manager(self, cfg: Any, addr: str, port: int, timeout: timedelta, quorum_timeout: timedelta,
                 connect_timeout: timedelta, state_dict: Callable[[], dict[str, Any]],
                 load_state_dict: Callable[[dict[str, Any]], None]) -> Manager:
        return Manager(
            pg=self.pg, load_state_dict=load_state_dict, state_dict=state_dict,
            min_replica_size=cfg.ft_min_replicas,
            # the quorum is known before the batch is chosen, and a joiner is healed before it
            # computes: every participant of a step holds the same state and knows its rank
            use_async_quorum=False,
            timeout=timeout, quorum_timeout=quorum_timeout, connect_timeout=connect_timeout,
            rank=0, world_size=1, store_addr=addr, store_port=port,
            lighthouse_addr=cfg.ft_lighthouse, replica_id=self.replica_id,
            port=cfg.ft_manager_port, hostname=addr,
            checkpoint_transport=PGTransport(self.pg, timeout=timeout, device=torch.device("cpu")),
            quorum_retries=LIGHTHOUSE_RETRIES,
        )

    # --- one step ------------------------------------------------------------------------------
    def start_step(self) -> tuple[int, int] | None:
        """Join the quorum of the next step; a replica behind its peers is healed here.

        Returns ``(participant rank, participants)``: this replica's rank among the quorum's
        participants and their number. Zeroes the gradients (``optimizer.zero_grad``). Sets
        :attr:`cut_off` when the quorum's id skips ids since the last quorum this replica took
        part in with the group (:meth:`follow_quorum`).

        Returns None when no quorum came within ``ft_quorum_timeout_s`` (torchft raises
        TimeoutError: the lighthouse is out of reach, e.g. a partition, or this worker was frozen
        in the call past its deadline): nothing was computed or applied, the caller asks again
        (:attr:`no_quorum_s` says for how long there has been none) instead of ending the worker.
        torchft keeps the failed call's future, so it is dropped (:meth:`_forget_failed_quorum`).
        """
        try:
            self.optimizer.zero_grad(set_to_none=True)
            participants = self.manager.num_participants()
            rank = self.manager.participating_rank()
        except TimeoutError as exc:
            self._forget_failed_quorum()
            # tonic's status text ends in call metadata (", details: [], metadata: MetadataMap {...}")
            self.quorum_error = f"{type(exc).__name__}: {str(exc).split(', details:')[0]}"
            return None
        self.quorum_error = None
        self.quorum_at = time.monotonic()
        self.follow_quorum(self.quorum_id, max(1, participants))
        return (0 if rank is None else rank), max(1, participants)

    def _forget_failed_quorum(self) -> None:
        """Drop the Manager's future of a quorum call that raised, so the next ``start_quorum``
        asks the lighthouse again.

        torchft 0.2.0's ``Manager.start_quorum`` first waits on the previous call's future and so
        raises its TimeoutError again, at once, at every later quorum: the worker could never get
        a quorum in this life. torchft has no public reset. Its public ``quorum_retries`` (a
        Manager argument) does not do the job: the Manager server retries the lighthouse call, but
        each attempt gets the whole quorum timeout, which is also the Python call's deadline, so
        the call still raises TimeoutError after ``ft_quorum_timeout_s`` and the future is kept
        (measured with torchft 0.2.0 and a lighthouse frozen, or killed and started again, past
        the timeout: the same with quorum_retries 0 and 5). tests/test_ft_quorum.py checks both
        facts against the real torchft, so an upgrade that changes them shows.
        """
        self.manager._quorum_future = None

    @property
    def no_quorum_s(self) -> float:
        """Seconds since this replica last got a quorum (or since it started, before its first)."""
        return time.monotonic() - self.quorum_at

    def follow_quorum(self, quorum_id: int, participants: int | None = None) -> None:
        """Track the quorums this replica takes part in with the group.

        The lighthouse bumps the quorum id each time it forms a quorum whose members changed (or
        after a failed commit), and a replica is in every quorum formed while its request is
        pending: an id more than one above :attr:`group_quorum_id` means quorums were formed
        without this replica, so the group may have committed steps it does not hold. It is then
        :attr:`cut_off` (kept until :meth:`rejoined`), and :attr:`group_quorum_id` stays the last
        quorum before the gap. An id not above it is a new lighthouse (ids start again at 1: a
        restart of the whole job) or the same quorum: followed on.

        While cut off, :attr:`present_since` is the first id from which this replica has been in
        every quorum (it commits nothing then): quorums a returning peer missed within that
        range were formed by this waiting replica, not by a group that trained
        (:meth:`exonerated`). ``participants``: the quorum's, kept as :attr:`group_participants`
        with the group quorum id.
        """
        last, seen = self.group_quorum_id, self.last_quorum_id
        self.last_quorum_id = quorum_id
        if self.cut_off is not None:
            if seen is not None and quorum_id > seen + 1:  # a further gap while cut off
                self.present_since = quorum_id
            return
        if last is not None and quorum_id > last + 1:
            self.cut_off = CutOff(last, quorum_id, time.monotonic())
            self.present_since = quorum_id
        else:
            self.group_quorum_id = quorum_id
            self.group_participants = participants

    def exonerated(self, participants: int) -> bool:
        """For a quorum of ``participants`` that are all cut off: whether they are the group after
        all, so nothing was committed without them. True when either

        * one of them missed only quorums formed while another participant waited, cut off, in
          every quorum (e.g. a peer frozen for a while after this one was cut off and had been
          waiting): the largest group quorum id + 1 reaches the smallest ``present_since``; or
        * all of them were cut off from the same group quorum and they are all of its
          participants (:attr:`group_participants`, known from this process's own quorums): none
          of them took part in a quorum since, so no quorum since held the group's state; the
          skipped ids were quorums nobody of the group received, e.g. calls that timed out while
          the lighthouse was frozen and that it answered when it came back.

        One MIN all-reduce of [present_since, -group quorum id, group quorum id, -group
        participants] over the participants. Every participant gets the same answer (False when
        it failed: the step then does not commit anyway).
        """
        cut, group = self.cut_off, self.group_quorum_id
        mine = torch.tensor([float(self.present_since if cut else math.inf),
                             -float(group if group is not None else -1),
                             float(group if group is not None else -1),
                             -float(self.group_participants or math.inf)], dtype=torch.float64)
        self.manager.allreduce(mine, reduce_op=torch.distributed.ReduceOp.MIN).wait()
        if self.errored():
            return False
        newest_group, oldest_group = -float(mine[1]), float(mine[2])
        whole_group = (newest_group == oldest_group >= 0
                       and participants >= -float(mine[3]))
        return newest_group + 1 >= float(mine[0]) or whole_group

    def rejoined(self) -> None:
        """A step was committed with a participant that was not cut off (whose state this
        replica now holds, healed by torchft when it was behind): it belongs to the group again."""
        self.cut_off = None
        self.group_quorum_id = self.quorum_id

    def average_gradients(self, params: Iterable[torch.nn.Parameter]) -> float:
        """Average the gradients of ``params`` over the participants in one all-reduce; return
        the seconds it took. A parameter without gradient contributes zeros (and gets them).

        A failed collective does not raise: torchft records the error and the step's commit
        vote fails (:meth:`commit` returns False); the gradients are then meaningless.
        """
        params = [p for p in params if p.requires_grad]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in params])
        t0 = time.perf_counter()
        self.manager.allreduce(flat).wait()
        seconds = time.perf_counter() - t0
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        return seconds

    def sum(self, tensor: torch.Tensor) -> bool:
        """Sum ``tensor`` in place over the participants; return False when this or an earlier
        collective of the step failed (the tensor is then meaningless, the step will not commit;
        failures do not raise, as in :meth:`average_gradients`)."""
        self.manager.allreduce(tensor, reduce_op=torch.distributed.ReduceOp.SUM).wait()
        return not self.errored()

    def errored(self) -> bool:
        """A collective of this step failed: the step will not commit."""
        return self.manager.errored() is not None

    def error_text(self) -> str | None:
        """Why this step will not commit, on one line (``Type: message``, torchft's traceback
        left out), or None when no error was reported in it."""
        err = self.manager.errored()
        if err is None:
            return None
        exc = getattr(err, "original_exception", err)
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")

    def abstain(self, why: str) -> None:
        """Vote against this step (every participant does: nothing is applied, the step is
        attempted again with the next quorum). ``why`` names the reason in torchft's error."""
        self.manager.report_error(RuntimeError(why))
        self.commit()

    def commit(self) -> bool:
        """Vote on the step; apply the optimizer update when every participant commits.

        Returns True when the step was committed (the Manager's step advanced by one); False
        when it was not, also when the vote's call to this replica group's own Manager server
        outlived ``ft_timeout_s`` (torchft raises TimeoutError): a worker frozen in the vote
        (SIGSTOP, a closed lid) finds its deadline passed when it is thawed. Nothing was applied
        then (the update comes after the vote), so the step is retried with the next quorum,
        as for any failed vote, instead of ending the worker.
        """
        before = self.manager.current_step()
        try:
            self.optimizer.step()
        except TimeoutError as exc:
            self.manager.report_error(exc)
            return False
        return self.manager.current_step() == before + 1

    @property
    def quorum_id(self) -> int:
        """The lighthouse's id of the current quorum (torchft 0.2.0 has no public accessor)."""
        return self.manager._quorum_id

    @property
    def step(self) -> int:
        """The committed step count of this replica (torchft's, moved by commits and healing)."""
        return self.manager.current_step()

    def state(self) -> dict[str, int]:
        """The Manager's own state (its step count), kept in checkpoints."""
        return self.manager.state_dict()

    def shutdown(self) -> None:
        """Stop the Manager server without waiting (a quorum call in flight is abandoned)."""
        self.manager.shutdown(wait=False)
