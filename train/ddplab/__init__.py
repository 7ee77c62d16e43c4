"""ddp-lab: an elastic PyTorch DDP lab for CPU-only laptops, as a Python package.

Training program: ``config`` (TrainConfig, presets, CLI), ``model`` (GPT), ``data`` (dataset and
deterministic sampler), ``lr`` (batch policy and schedule), ``checkpoint`` (atomic per-node
checkpoints), ``distributed`` (torchrun environment, gloo, checkpoint agreement, timed all-reduce),
``telemetry``, ``metrics`` and ``train`` (the entry point: ``python -m ddplab.train``), run by
``agent``; ``records`` (the JSONL reader), ``faults`` (recovery of an injected fault, from records)
and ``status`` (the job's state on a node). These and ``ddplab.bench`` (the node-side benchmarks)
are the node runtime, shipped to the laptops as a wheel; ``ddplab.controller`` (run folder,
summary, stragglers, report, rendezvous store) stays on the controller. See docs/ARCHITECTURE.md.
"""

__version__ = "0.1.0"
