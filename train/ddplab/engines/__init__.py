"""The recovery engines: the registry of how the replicas of a run keep in step.

A run's ``fault_tolerance`` names one of :data:`ENGINES`. Each value is the module that holds
the engine, a class :data:`ENGINE` implementing :class:`ddplab.engines.base.Engine`; the module is
imported only when a run chooses it (the torchft engine's imports cost seconds and are needed by
its runs alone). Adding an engine is a new module and one line here: the trainer core
(ddplab.train) calls every engine through the same interface (docs/training.md, "Engines").

Standard library only: ddplab.config validates the names against this table.
"""

from __future__ import annotations

import importlib
import sys

#: Engine name (``fault_tolerance``) -> the module holding its ``ENGINE`` class.
ENGINES: dict[str, str] = {
    "torchelastic": "ddplab.engines.torchelastic",
    "per_step": "ddplab.engines.per_step",
    "diloco": "ddplab.engines.diloco",
}
#: The engines whose every laptop is one torchft replica group under the controller's lighthouse
#: (the ``ft_*`` keys; the playbooks start the lighthouse for them: ddp_lab_lighthouse_engines).
LIGHTHOUSE_ENGINES = ("per_step", "diloco")


def replica_groups(name: object) -> bool:
    """Whether the engine ``name`` runs one torchft replica group per laptop under the lighthouse
    (:data:`LIGHTHOUSE_ENGINES`): no group restart, ``participants`` per committed step, a joiner
    healed from a live peer. The one rule of the readers of records and settings."""
    return name in LIGHTHOUSE_ENGINES


def engine_class(name: str) -> type:
    """The engine class of ``name`` (its module imported now): a subclass of
    :class:`ddplab.engines.base.Engine` (not imported here, so that ddplab.config, which reads the
    registry, is no part of an import cycle).

    Raises:
        KeyError: ``name`` is not in :data:`ENGINES` (ddplab.config refuses such a run first).
    """
    return importlib.import_module(ENGINES[name]).ENGINE


def exit_may_block() -> bool:
    """Whether an engine imported in this process may block the interpreter's exit after a
    failure (its class's ``exit_may_block``: background threads waiting on a peer that is gone).
    Only the modules already imported are asked: importing one would not make it true."""
    loaded = (sys.modules.get(module) for module in ENGINES.values())
    return any(getattr(getattr(m, "ENGINE", None), "exit_may_block", False) for m in loaded)
