"""torchrun environment, the gloo process group, checkpoint agreement and timed gradient sync.

Under ``torchrun`` the environment carries ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``TORCHELASTIC_RESTART_COUNT`` and ``MASTER_ADDR``/``MASTER_PORT``; alone, the
program is rank 0 of 1 and needs no process group. The ddp_job role adds ``DDPLAB_GLOO_ADDR``: the
node's address on the route to the rendezvous host, which gloo binds (docs/rendezvous.md).
"""

import ipaddress
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import psutil
import torch
import torch.distributed as dist

from ddplab.checkpoint import CheckpointStore, ScanResult

GLOO_ADDR_ENV = "DDPLAB_GLOO_ADDR"
#: ddplab.agent's ``--rdzv-endpoint``, passed to its workers (the replica store of
#: ddplab.engines.torchft_replica).
RDZV_ENDPOINT_ENV = "DDPLAB_RDZV_ENDPOINT"
# The backend name under which gloo bound to one address is registered (torch.distributed's
# third-party backend interface, Backend.register_backend).
BOUND_GLOO_BACKEND = "ddplab_gloo"


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job (torchrun's environment variables)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    restart_count: int = 0
    host: str = "localhost"
    gloo_addr: str | None = None  # DDPLAB_GLOO_ADDR: the address gloo binds (None: gloo chooses)

    @property
    def distributed(self) -> bool:
        """True when a process group is needed (more than one rank)."""
        return self.world_size > 1

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> "DistEnv":
        """Read torchrun's variables.

        Raises:
            ValueError: a variable is not an integer, the values are inconsistent, or
                ``DDPLAB_GLOO_ADDR`` is not an IPv4/IPv6 address.
        """
        env = os.environ if environ is None else environ

        def read(name: str, default: int) -> int:
            raw = env.get(name)
            if raw in (None, ""):
                return default
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None

        world = read("WORLD_SIZE", 1)
        rank = read("RANK", 0)
        local_rank = read("LOCAL_RANK", 0)
        local_world = read("LOCAL_WORLD_SIZE", 1)
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"inconsistent torchrun environment: RANK={rank} WORLD_SIZE={world}")
        if local_world < 1 or not 0 <= local_rank < local_world:
            raise ValueError(
                f"inconsistent torchrun environment: LOCAL_RANK={local_rank} LOCAL_WORLD_SIZE={local_world}"
            )
        gloo_addr = env.get(GLOO_ADDR_ENV) or None
        if gloo_addr is not None:
            try:
                gloo_addr = str(ipaddress.ip_address(gloo_addr))
            except ValueError:
                raise ValueError(
                    f"environment variable {GLOO_ADDR_ENV}={gloo_addr!r} is not an IP address "
                    "(the node's address on the route to the rendezvous host)"
                ) from None
        return cls(
            rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
            restart_count=read("TORCHELASTIC_RESTART_COUNT", 0), host=socket.gethostname(),
            gloo_addr=gloo_addr,
        )


def register_bound_gloo(addr: str) -> str:
    """Register a gloo backend whose every process group listens on ``addr`` only.

    ``GLOO_SOCKET_IFNAME`` names an interface, and gloo takes that interface's *first* address:
    wrong when the NIC holds a second IPv4 address added before the routed one, or the routed one
    is labelled (``eth0:1``) so the interface's only match is IPv6. torch 2.13's
    ``init_process_group`` ignores ``pg_options`` for ``"gloo"``, so the device is given through
    the public ``Backend.register_backend`` with a creator that builds
    ``ProcessGroupGloo(store, rank, size, options)``, ``options._devices`` holding
    ``ProcessGroupGloo.create_device(hostname=addr)`` (the only device option is that
    underscore field of the pybind options class). Registering again replaces the address.

    Args:
        addr: an IPv4/IPv6 address of this host (not a name: a name may resolve to 127.0.1.1).

    Returns:
        The backend name to pass to ``init_process_group`` / ``new_group``.
    """
    def create(store, group_rank: int, group_size: int, timeout: timedelta):
        return bound_gloo(store, group_rank, group_size, timeout, addr)

    dist.Backend.register_backend(BOUND_GLOO_BACKEND, create, devices=["cpu"])
    return BOUND_GLOO_BACKEND


def bound_gloo(store, group_rank: int, group_size: int, timeout: timedelta,
               addr: str) -> dist.ProcessGroupGloo:
    """A gloo backend ``ProcessGroupGloo(store, rank, size, options)`` whose one device listens
    on ``addr`` (see :func:`register_bound_gloo`; ddplab.engines.torchft_replica builds its
    reconfigurable groups with it). Raises what gloo raises when ``addr`` is not an address of this
    host."""
    gloo = dist.ProcessGroupGloo
    options = gloo._Options()
    options._timeout = timeout
    options._devices = [gloo.create_device(hostname=addr)]
    return gloo(store, group_rank, group_size, options)


def gloo_backend(env: DistEnv) -> str:
    """The backend name for ``init_process_group``: gloo bound to ``env.gloo_addr``
    (:func:`register_bound_gloo`) when the ddp_job role gave one, else plain ``"gloo"`` (gloo picks
    ``GLOO_SOCKET_IFNAME``'s first address, else the host name's). Used by training and benchmarks."""
    return register_bound_gloo(env.gloo_addr) if env.gloo_addr else "gloo"


def init_process_group(env: DistEnv, timeout_s: float, peer_timeout_s: float | None = None) -> None:
    """Join the gloo process group (env:// rendezvous from torchrun) with an explicit timeout.

    gloo's default timeout is 30 min: a peer that vanishes without a TCP reset would stall the
    survivors that long, so every collective here fails after ``timeout_s`` instead. With
    ``env.gloo_addr`` gloo binds exactly that address (:func:`gloo_backend`). With
    ``peer_timeout_s``, every TCP connection the group's start opened (gloo's pairs, the env://
    store) gives up on a peer whose network stack answers nothing for that long
    (:func:`bound_unanswered`).
    """
    if env.distributed and not dist.is_initialized():
        before = tcp_connections() if peer_timeout_s else set()
        dist.init_process_group(
            backend=gloo_backend(env), rank=env.rank, world_size=env.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        if peer_timeout_s:
            bound_unanswered(tcp_connections() - before, peer_timeout_s)


#: Keepalive probes of :func:`bound_unanswered`: one per second, this many unanswered before the
#: connection is given up on (the first one at ``peer_timeout_s`` minus this).
KEEPALIVE_PROBES = 3


def tcp_connections() -> set[int]:
    """File descriptors of this process's established TCP connections (psutil)."""
    return {c.fd for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_ESTABLISHED and c.fd >= 0}


def bound_unanswered(fds: set[int], timeout_s: float) -> None:
    """Make each TCP connection in ``fds`` fail when its peer's network stack answers nothing for
    ``timeout_s`` seconds: sent data unacknowledged (``TCP_USER_TIMEOUT``, RFC 5482), or, on an
    idle connection, :data:`KEEPALIVE_PROBES` keepalive probes one second apart unanswered
    (``SO_KEEPALIVE``; with a user timeout set, Linux gives up once ``timeout_s`` passed since
    the peer's last packet and a probe is out).

    A peer that is cut off (a partition, a pulled cable) or powered off without a reset answers
    nothing: the connection fails with ``ETIMEDOUT`` (gloo: the collective raises), as a crashed
    peer's reset makes it fail, instead of waiting for the process-group timeout, or for TCP's
    retransmission back-off (0.2 s doubling: 25 s, then 51 s after the first loss) long after
    the network is back. A peer whose processes are stopped (SIGSTOP) or busy still has its
    kernel acknowledge data and answer probes: it is waited for, up to the process-group
    timeout. One caveat of ``TCP_USER_TIMEOUT``: a peer that keeps its receive window closed for
    ``timeout_s`` (stopped in the middle of reading a message larger than its socket buffer) is
    given up on too.

    The descriptors are used in place (not duplicated, not closed); one that is no TCP socket
    any more (closed since it was listed) is skipped. Linux only (the constants are in
    :mod:`socket` there).
    """
    idle_s = max(1, round(timeout_s) - KEEPALIVE_PROBES)
    for fd in sorted(fds):
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, round(timeout_s * 1000)))
        except OSError:
            pass  # not a TCP socket (the descriptor was reused)
        finally:
            sock.detach()


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def wait(work: dist.Work | torch.futures.Future) -> None:
    """Wait for an async collective (a ``Work``, or a future such as a comm hook's chain of
    collectives) while staying responsive to signals.

    ``Work.wait()`` blocks inside C++, where Python signal handlers cannot run: a worker stuck
    on a frozen peer would ignore the agent's SIGTERM until the process-group timeout, and the
    agent kills it (SIGKILL) after its own grace period, before it can save its last step.
    Polling with short sleeps (50 us doubling to 1 ms) lets SIGTERM interrupt the wait.

    Raises:
        RuntimeError (DistBackendError): the collective failed or timed out (``pg_timeout_s``).
    """
    done = work.is_completed if isinstance(work, dist.Work) else work.done
    delay = 5e-5
    while not done():
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)
    work.wait()


def all_reduce_scalar(value: float, op: str = "sum") -> float:
    """Reduce one number over all ranks (``sum``, ``max`` or ``min``); identity when alone."""
    if not dist.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.float64)
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    wait(dist.all_reduce(tensor, op=ops[op], async_op=True))
    return float(tensor.item())


def sum_over_world(tensor: torch.Tensor) -> bool:
    """Sum ``tensor`` in place over all ranks (identity when alone); True (a failure raises, as
    :func:`wait` does). The ``sum`` of the world group (ddplab.engines.base.Group)."""
    if dist.is_initialized():
        wait(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True))
    return True


def broadcast_bytes(data: bytes | None, src: int) -> bytes:
    """Send ``data`` from rank ``src`` to every rank (size first, then a uint8 tensor)."""
    if not dist.is_initialized():
        assert data is not None
        return data
    is_src = dist.get_rank() == src
    size = torch.tensor([len(data) if is_src and data is not None else 0], dtype=torch.int64)
    wait(dist.broadcast(size, src=src, async_op=True))
    if is_src:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
    wait(dist.broadcast(buf, src=src, async_op=True))
    return data if is_src else buf.numpy().tobytes()


@dataclass
class Agreement:
    """Result of :func:`agree_on_checkpoint`."""

    step: int | None  # the newest step any node holds a valid checkpoint of (None: fresh start)
    holder: int | None  # lowest rank that holds it; it broadcast the state
    data: bytes | None  # the checkpoint bytes (identical on every rank)
    local: ScanResult  # what this rank found in its own node's folder
    local_has_it: bool  # this node already holds the agreed checkpoint


def agree_on_checkpoint(store: CheckpointStore) -> Agreement:
    """Agree on the newest valid step across all nodes and share that state with every rank.

    Each rank scans its node's folder for the newest checkpoint that verifies; an all-reduce MAX
    picks the newest step anywhere; an all-reduce MIN over "ranks holding it" picks the sender,
    which broadcasts the verified bytes. A node that rejoins with an empty folder catches up.
    """
    scan, data = store.newest_valid()
    mine = -1 if scan.step is None else scan.step
    newest = int(all_reduce_scalar(float(mine), "max"))
    if newest < 0:
        return Agreement(None, None, None, scan, False)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    holder = int(all_reduce_scalar(float(rank if mine == newest else world), "min"))
    shared = broadcast_bytes(data if rank == holder else None, src=holder)
    return Agreement(newest, holder, shared, scan, mine == newest)


class TimedAllReduce:
    """DDP communication hook state: an all-reduce (mean) per gradient bucket, overlapped with the
    rest of the backward pass, and the time the step waited for it.

    DDP calls the hook when a bucket's gradients are ready (the last layers' first). The hook
    starts the bucket's all-reduce and returns its future at once, so a bucket travels while the
    backward pass computes the gradients of the layers before it. The hook of the step's last
    bucket (``GradBucket.is_last``) waits for every bucket of the step before it returns, polling
    (see :func:`wait`) so that SIGTERM can interrupt it. ``seconds`` is the wall time spent inside
    the hooks: the step's communication that the backward pass did not hide, including the wait for
    the slowest rank. An exception from a collective propagates out of ``backward()``, before the
    optimizer step, so the parameters stay those of the last completed step.

    The ranks add the same bytes in the same order whether or not a bucket overlaps: the result
    equals the synchronous all-reduce's bit for bit.
    """

    def __init__(self, world_size: int, group=None) -> None:
        self.world_size = world_size
        self.group = group
        self.seconds = 0.0
        self.calls = 0
        self.pending: list[torch.futures.Future] = []

    def reset(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.pending = []

    def launch(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Start the bucket's synchronisation; a future of the averaged bucket."""
        return all_reduce_mean(self, bucket)

    # (annotations evaluated eagerly: DDP's register_comm_hook checks them by identity)
    @staticmethod
    def hook(state: "TimedAllReduce", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        t0 = time.perf_counter()
        fut = state.launch(bucket)
        state.pending.append(fut)
        if bucket.is_last():
            pending, state.pending = state.pending, []
            for each in pending:
                wait(each)
        state.seconds += time.perf_counter() - t0
        state.calls += 1
        return fut


def all_reduce_mean(state: TimedAllReduce, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Start the all-reduce (sum) of the bucket's buffer over ``state.group``; a future that
    divides it by ``state.world_size`` in place once the sum arrived and holds it. The future
    raises what the collective raised."""
    buf = bucket.buffer()
    world = state.world_size

    def mean(done: torch.futures.Future) -> torch.Tensor:
        done.value()  # raises the collective's error
        return buf.div_(world)

    return dist.all_reduce(buf, group=state.group, async_op=True).get_future().then(mean)
