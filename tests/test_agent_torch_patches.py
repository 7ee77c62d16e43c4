"""The torch internals ddplab.agent patches or wraps, and the two the workers set (the gloo options
of ddplab.distributed.bound_gloo, PowerSGD's step count in ddplab.compression): one test per patch,
failing when the patched torch attribute changes shape (it is gone, its signature changed, torch
stopped calling it the way the patch assumes). A torch upgrade runs this file as its checklist;
each failure names the ddplab function to revisit. What each patch does is tested elsewhere (test_agent.py,
test_rdzv_membership.py); the torchft and torch internals of ddplab.engines.torchft_replica and the
diloco engine are in test_torchft_internals.py.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import socket
import time
from datetime import timedelta

from ddplab import agent


def _source_calls(module, name: str) -> list[ast.Call]:
    tree = ast.parse(inspect.getsource(module))
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name) and n.func.id == name]


def test_cheap_event_names_replaces_get_method_name_of_the_same_shape():
    """agent.cheap_event_names: ``dynamic_rendezvous.get_method_name = caller_name``."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    defs = [n for n in ast.parse(inspect.getsource(dynamic_rendezvous)).body
            if isinstance(n, ast.FunctionDef) and n.name == "get_method_name"]
    assert len(defs) == 1, "torch's dynamic_rendezvous.get_method_name is gone"
    args = defs[0].args
    assert [a.arg for a in args.args] == ["depth"] and ast.literal_eval(args.defaults[0]) == 2
    assert list(inspect.signature(agent.caller_name).parameters) == ["depth"]
    assert inspect.signature(agent.caller_name).parameters["depth"].default == 2
    calls = _source_calls(dynamic_rendezvous, "get_method_name")
    # torch names its events from its own frames, with the default depth: what caller_name keeps
    assert calls and all(not c.args and not c.keywords for c in calls)


def test_stop_restarts_on_final_exits_wraps_monitor_workers_of_the_same_shape():
    """agent.stop_restarts_on_final_exits: ``LocalElasticAgent._monitor_workers`` wrapped; it reads
    the RunResult's failures and exit codes, and zeroes ``_remaining_restarts``, which torch's run
    loop reads to decide whether it restarts the workers."""
    from torch.distributed.elastic.agent.server.api import RunResult, SimpleElasticAgent, WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    monitor = inspect.unwrap(LocalElasticAgent._monitor_workers)
    assert list(inspect.signature(monitor).parameters) == ["self", "worker_group"]
    assert "failures" in {f.name for f in dataclasses.fields(RunResult)}
    assert callable(RunResult.is_failed)
    assert "exitcode" in {f.name for f in dataclasses.fields(ProcessFailure)}
    assert "max_restarts" in {f.name for f in dataclasses.fields(WorkerSpec)}
    run_loop = inspect.getsource(SimpleElasticAgent._invoke_run)
    assert "self._monitor_workers(" in run_loop and "if self._remaining_restarts > 0:" in run_loop
    assert "self._remaining_restarts =" in inspect.getsource(SimpleElasticAgent)


def test_the_membership_watch_wraps_torchs_c10d_handler_of_the_same_shape():
    """agent.MembershipWatchedHandler around torch's DynamicRendezvousHandler (created by
    agent._create_watched_handler, registered by agent.watch_membership): every method of torch's
    RendezvousHandler interface is forwarded, and the state it reads (``_state_holder.state``:
    round, complete, participants; ``_this_node``) is there on a real c10d handler."""
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    interface = {name for name, _ in inspect.getmembers(RendezvousHandler) if not name.startswith("_")}
    missing = interface - set(dir(agent.MembershipWatchedHandler))
    assert not missing, f"torch's RendezvousHandler has {missing}: forward them"
    assert list(inspect.signature(registry.register).parameters) == ["backend", "creator"]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    params = RendezvousParameters(backend=agent.WATCHED_BACKEND, endpoint=f"127.0.0.1:{port}",
                                  run_id="patch-check", min_nodes=1, max_nodes=2, is_host=True,
                                  join_timeout=5)
    handler = agent._create_watched_handler(params)
    try:
        current, complete, member = handler.membership()  # the private state, read as the watch does
        assert (current, complete, member) == (0, False, False)
        assert handler.num_nodes_waiting() == 0 and handler.get_run_id() == "patch-check"
        assert handler.get_backend() == agent.WATCHED_BACKEND and not handler.is_closed()
    finally:
        handler.shutdown()


def test_the_forked_launch_reads_torchruns_arguments_and_launch_config():
    """agent.forks_worker / fork_launch / watch_membership read and set torchrun's parsed
    arguments and build the launch with ``config_from_args`` (returns config, command, args)."""
    import torch.distributed.run as torchrun
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    args = torchrun.parse_args(["--standalone", "--nproc-per-node", "1", "--start-method", "fork",
                                "-m", agent.WORKER_MODULE, "--preset", "tiny"])
    for name in ("standalone", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "master_port", "module",
                 "training_script", "training_script_args", "no_python", "run_path", "start_method",
                 "nnodes"):
        assert hasattr(args, name), name
    assert torchrun.parse_min_max_nnodes("1:3") == (1, 3)
    config, entrypoint, worker_args = agent.fork_launch(args)
    assert isinstance(config, LaunchConfig) and worker_args == ("--preset", "tiny")
    assert list(inspect.signature(elastic_launch).parameters)[:2] == ["config", "entrypoint"]


def test_gloo_bound_to_one_address_uses_gloos_private_options():
    """ddplab.distributed.bound_gloo (the workers' gloo, and ddplab.engines.torchft_replica's):
    ``ProcessGroupGloo._Options`` with ``_timeout`` and ``_devices``, ``create_device(hostname=...)``
    and the public ``Backend.register_backend(name, creator, devices=...)``."""
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=3)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    assert options._timeout == timedelta(seconds=3) and len(options._devices) == 1
    assert "devices" in inspect.signature(dist.Backend.register_backend).parameters


def test_a_restarted_powersgd_state_counts_the_runs_steps_in_torchs_iter():
    """ddplab.compression.CompressedAllReduce.start: a (re)started worker's PowerSGD state counts
    the steps done in ``PowerSGDState.iter`` (one of its slots), which torch's hooks compare with
    ``start_powerSGD_iter`` (plain all-reduce before it) and ``maybe_increase_iter`` advances."""
    from ddplab import compression
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    assert "iter" in psgd.PowerSGDState.__slots__
    state = compression.CompressedAllReduce(1, "powersgd", powersgd_start_step=10)
    state.start(12)
    assert state.powersgd.iter == 12 and state.powersgd.start_powerSGD_iter == 10
    for hook in (psgd.powerSGD_hook, psgd.batched_powerSGD_hook):
        assert "if state.iter < state.start_powerSGD_iter:" in inspect.getsource(hook)
    assert "self.iter += 1" in inspect.getsource(psgd.PowerSGDState.maybe_increase_iter)


def test_the_store_reconnect_uses_torchs_c10d_backend_of_the_same_shape():
    """agent.StoreReconnect on torch's C10dRendezvousBackend (installed by
    agent._create_watched_handler): it wraps ``_call_store``, writes ``_key`` /
    ``_NULL_SENTINEL`` to a new store and hands the new client to ``backend._store`` and the
    handler's ``_store``. A store server stopped and started again on its port (empty): the next
    call goes through the new one."""
    import gc

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True)
    params = RendezvousParameters(backend=agent.WATCHED_BACKEND, endpoint=f"127.0.0.1:{port}",
                                  run_id="patch-check", min_nodes=1, max_nodes=2, is_host=False,
                                  join_timeout=5, read_timeout=10)
    handler = agent._create_watched_handler(params)
    inner = handler._inner
    backend = inner._state_holder._backend
    reconnect = backend._call_store.__self__
    assert isinstance(reconnect, agent.StoreReconnect) and inner._store is backend._store
    assert isinstance(backend._key, str) and isinstance(backend._NULL_SENTINEL, str)
    assert handler.num_nodes_waiting() == 0 and reconnect.reconnects == 0
    del server
    gc.collect()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True)
    time.sleep(1.5)  # past the state holder's cache (1 s): the next call reads the store
    try:
        assert handler.num_nodes_waiting() == 0 and reconnect.reconnects == 1
        assert inner._store is backend._store and server.check([backend._key])
    finally:
        handler.shutdown()
