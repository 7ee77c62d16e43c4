"""ddp-lab: an elastic PyTorch DDP lab for CPU-only laptops, as a Python package.

Training program: ``config`` (TrainConfig, presets, CLI), ``model`` (GPT), ``data`` (dataset and
deterministic sampler), ``lr`` (batch policy and schedule), ``checkpoint`` (atomic per-node
checkpoints), ``distributed`` (torchrun environment, gloo, checkpoint agreement, timed all-reduce),
``telemetry``, ``metrics`` and ``train`` (the entry point: ``python -m ddplab.train``). The other
modules (rendezvous store, report, cost model, benchmarks, fault analysis) serve the cluster side.
"""

__version__ = "0.1.0"
