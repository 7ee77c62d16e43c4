"""Run configuration of the training program: one validated dataclass, presets, JSON and CLI.

Precedence, lowest to highest: dataclass defaults < preset < JSON file (``--config``) < CLI flags.
The preset is itself chosen by the same precedence (CLI ``--preset`` beats the JSON's ``preset``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import types
import typing
import urllib.parse
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ddplab.engines import ENGINES, LIGHTHOUSE_ENGINES

CANONICAL_DATA_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
CANONICAL_DATA_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"

BATCH_POLICIES = ("keep_per_rank", "keep_global")
#: Gradient compression of the torchelastic engine's all-reduce (ddplab.compression): ``none``
#: (fp32), ``fp16``/``bf16`` (the bucket cast to 16 bits: half the bytes), ``powersgd`` (low-rank,
#: Vogels et al. 2019, error feedback on).
GRAD_COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
#: How a step's global batch is dealt to its group: equal shares, or by measured speed
#: (ddplab.balance.MODES; standard library here).
BATCH_BALANCES = ("off", "speed")

#: Model/batch presets. ``small`` is the default CPU configuration; ``medium`` is the larger one
#: (the size of the classic character-level Shakespeare GPT, practical on a fast multi-core node);
#: ``tiny`` is for tests and smoke runs.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, "dropout": 0.0,
        "per_rank_batch_size": 4,
    },
    "small": {
        "n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "dropout": 0.0,
        "per_rank_batch_size": 12,
    },
    "medium": {
        "n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 256, "dropout": 0.2,
        "per_rank_batch_size": 16,
    },
    # GPT-2 small (Radford et al. 2019), the seed's 124M-parameter model: its vocabulary of 50257
    # tokens is kept by padding the character vocabulary (vocab_size), so that the gradients are
    # the seed's 496 MB. For measuring the exchange (a few steps); loss comparisons use the others.
    "gpt2": {
        "n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "dropout": 0.0,
        "vocab_size": 50257, "per_rank_batch_size": 1, "base_lr": 6e-4, "reference_batch_size": 3,
    },
}

#: Fields that fix the shape of the model: a checkpoint can only be resumed with the same values.
MODEL_SHAPE_FIELDS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")

#: The largest value of any integer key: torch and numpy hold sizes, counts and the seed in 64 bits
#: (``torch.manual_seed`` of more fails the run with "Overflow when unpacking long long").
INT64_MAX = 2**63 - 1
#: Upper bounds tighter than :data:`INT64_MAX` (inclusive), with why. ``threads``: the OpenMP pool
#: of that many threads must be created (libgomp aborts the process far above it); no node has
#: that many CPUs.
INT_MAX = {"threads": 1024}


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key, the value and the fix."""


@dataclass
class TrainConfig:
    """Every knob of one training run (JSON keys and CLI flags carry the same snake_case names).

    Units: learning rates per optimizer step; batch sizes in samples (one sample = one window of
    ``block_size`` characters); times in seconds; intervals in optimizer steps.
    """

    run_id: str = "local"
    out_dir: str = "out"
    # data
    data_path: str = "data/tinyshakespeare/input.txt"
    data_url: str | None = CANONICAL_DATA_URL
    data_sha256: str | None = CANONICAL_DATA_SHA256
    # model
    preset: str = "small"
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    dropout: float = 0.0
    # rows of the embedding and output head: null = the dataset's characters; a larger number pads
    # them (the extra tokens never occur in the data), e.g. GPT-2's 50257 (preset gpt2)
    vocab_size: int | None = None
    # batch and learning rate
    per_rank_batch_size: int = 12
    global_batch_size: int | None = None
    batch_policy: str = "keep_per_rank"
    # off: every rank gets an equal share of the global batch; speed: shares follow each rank's
    # measured throughput (ddplab.balance; per_rank_batch_size caps a micro-batch)
    batch_balance: str = "off"
    # Tuned for the small preset at 3 ranks x 12 (global batch 36 = reference): validation loss
    # below 2.0 in the fewest steps (benchmarks/lr_sweep.py, docs/training.md "Default schedule").
    base_lr: float = 1e-2
    reference_batch_size: int = 36
    warmup_steps: int = 30
    # steps over which the LR moves from its old to its new value after a world-size change
    # (Goyal et al. 2017 gradual warmup, re-applied); null = warmup_steps, 0 = jump at once
    lr_ramp_steps: int | None = None
    min_lr_ratio: float = 0.1
    max_steps: int = 350
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    # divergence guard: after warmup, a training loss above ln(vocab_size) + this margin (nats)
    # stops the run (exit 3) before the step is applied; non-finite loss/gradients always do
    divergence_margin: float = 3.0
    # evaluation, checkpoints, logging
    eval_interval: int = 100
    eval_iters: int = 20
    ckpt_interval: int = 100
    keep_checkpoints: int = 3
    log_interval: int = 10
    sample_chars: int = 500
    # runtime
    pg_timeout_s: float = 60.0
    # torchelastic: a peer whose network stack answers nothing for this long (sent data not
    # acknowledged, keepalive probes unanswered: cut off or powered off) is given up on as if it
    # had crashed (ddplab.distributed.bound_unanswered); null: wait for pg_timeout_s
    peer_timeout_s: float | None = 5.0
    seed: int = 1337
    threads: int | None = None
    # checkpoints were found but none is usable: start over (True) or stop with an error (False)
    allow_fresh_start: bool = False
    # checkpoints carry the run id that wrote them; one of another run is refused (never replaced)
    # unless its run id is this one: continue training from that run's newest checkpoint
    adopt_run_id: str | None = None
    # recovery engine, a name of the registry ddplab.engines.ENGINES: torchelastic restarts every
    # worker on a membership change; per_step (torchft) keeps the survivors running and re-forms
    # the quorum before each step; diloco (torchft DiLoCo) lets each replica train alone for
    # sync_every inner steps, then averages their progress with an outer optimizer. The ft_* keys
    # apply to per_step and diloco (LIGHTHOUSE_ENGINES)
    fault_tolerance: str = "torchelastic"
    ft_lighthouse: str | None = None  # "http://ADDR:PORT" of the torchft lighthouse
    ft_replica_id: str | None = None  # this replica group's name (null: the host name)
    ft_manager_port: int = 29520  # TCP port of this replica's torchft Manager
    ft_min_replicas: int = 1  # a step commits only with at least this many participants
    # per operation: gloo collectives, commit vote, state transfer; a frozen peer is left out after
    # it + the lighthouse's join timeout (docs/faults.md)
    ft_timeout_s: float = 1.5
    ft_quorum_timeout_s: float = 60.0  # longest wait for a quorum
    # the first step of a (re)started job waits for this many participants, at most
    # ft_start_timeout_s from a replica's start (then it goes on with those present)
    ft_start_replicas: int = 1
    ft_start_timeout_s: float = 60.0
    # a replica cut off from the group (the lighthouse formed quorums without it) that finds no
    # peer of the group waits this long for one to heal from, then stops (it never trains alone)
    ft_rejoin_wait_s: float = 60.0
    # this launch of the run (the role writes a new one at each launch and resume; a rejoin keeps
    # the run.json, so its new agent reads the group quorum id its node kept: ddplab.engines.per_step)
    ft_launch_id: str | None = None
    # torchelastic: gradient compression of DDP's all-reduce (GRAD_COMPRESSIONS; ddplab.compression);
    # powersgd: the rank of its low-rank approximation, and the steps of plain fp32 all-reduce before
    # it starts compressing (torch's start_powerSGD_iter; >= 2 with error feedback)
    grad_compression: str = "none"
    # torchelastic: DDP's gradient bucket size, MB. Each bucket's all-reduce starts when its
    # gradients are ready and travels while the backward pass computes the layers before it; the
    # last bucket's is the part that cannot overlap (ddplab.distributed.TimedAllReduce)
    bucket_cap_mb: float = 25.0
    powersgd_rank: int = 4
    powersgd_start_step: int = 10
    # diloco (Douillard et al. 2023): inner steps (the inner optimizer, AdamW, alone on each
    # replica) between two syncs, and the outer optimizer (SGD with Nesterov momentum) that applies
    # the replicas' averaged progress at each sync; the paper's outer lr 0.7 and momentum 0.9
    sync_every: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.9

    def validate(self) -> TrainConfig:
        """Check every field; return ``self``.

        Raises:
            ConfigError: naming the first invalid key, its value and what is allowed.
        """
        def bad(key: str, why: str) -> ConfigError:
            return ConfigError(f"config key '{key}' = {getattr(self, key)!r}: {why}")

        self._validate_int_ranges(bad)
        positive_ints = ("n_layer", "n_head", "n_embd", "block_size", "per_rank_batch_size",
                         "reference_batch_size", "max_steps", "eval_interval", "eval_iters",
                         "ckpt_interval", "keep_checkpoints", "log_interval")
        for key in positive_ints:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(key, "must be an integer")
            if value <= 0:
                raise bad(key, "must be a positive integer (> 0)")
        for key in ("warmup_steps", "sample_chars"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise bad(key, "must be an integer >= 0")
        if self.global_batch_size is not None and (
            isinstance(self.global_batch_size, bool) or not isinstance(self.global_batch_size, int)
            or self.global_batch_size <= 0
        ):
            raise bad("global_batch_size", "must be a positive integer or null")
        if self.threads is not None and (
            isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads <= 0
        ):
            raise bad("threads", "must be a positive integer or null (= one per CPU of the node's share)")
        if self.lr_ramp_steps is not None and (
            isinstance(self.lr_ramp_steps, bool) or not isinstance(self.lr_ramp_steps, int)
            or self.lr_ramp_steps < 0
        ):
            raise bad("lr_ramp_steps", "must be an integer >= 0 or null (= warmup_steps)")
        if not isinstance(self.allow_fresh_start, bool):
            raise bad("allow_fresh_start", "must be true or false")
        if self.adopt_run_id is not None and (not isinstance(self.adopt_run_id, str)
                                              or not self.adopt_run_id.strip()):
            raise bad("adopt_run_id", "must be a run id (of the checkpoints to continue from) or null")
        if self.peer_timeout_s is not None and (not _is_real(self.peer_timeout_s) or self.peer_timeout_s < 1):
            raise bad("peer_timeout_s", "must be a number >= 1 (seconds) or null (= wait for pg_timeout_s)")
        for key in ("base_lr", "pg_timeout_s", "divergence_margin", "bucket_cap_mb"):
            value = getattr(self, key)
            if not _is_real(value) or value <= 0:
                raise bad(key, "must be a number > 0")
        for key in ("weight_decay", "grad_clip"):
            value = getattr(self, key)
            if not _is_real(value) or value < 0:
                raise bad(key, "must be a number >= 0 (grad_clip 0 disables clipping)")
        for key in ("dropout", "beta1", "beta2"):
            value = getattr(self, key)
            if not _is_real(value) or not 0 <= value < 1:
                raise bad(key, "must be a number in [0, 1)")
        if not _is_real(self.min_lr_ratio) or not 0 <= self.min_lr_ratio <= 1:
            raise bad("min_lr_ratio", "must be a number in [0, 1]")
        if self.n_embd % self.n_head:
            raise bad("n_embd", f"must be divisible by n_head = {self.n_head}")
        if self.batch_policy not in BATCH_POLICIES:
            raise bad("batch_policy", f"must be one of {', '.join(BATCH_POLICIES)}")
        if self.batch_balance not in BATCH_BALANCES:
            raise bad("batch_balance", f"must be one of {', '.join(BATCH_BALANCES)}")
        if self.batch_balance == "speed" and self.fault_tolerance == "diloco":
            raise bad("batch_balance", "speed needs a group that meets every step (torchelastic, "
                      "per_step); diloco's inner steps run alone: use off")
        if self.preset not in PRESETS:
            raise bad("preset", f"must be one of {', '.join(PRESETS)}")
        if self.warmup_steps >= self.max_steps:
            raise bad("warmup_steps", f"must be smaller than max_steps = {self.max_steps}")
        if self.data_sha256 is not None and (
            len(self.data_sha256) != 64 or any(c not in "0123456789abcdef" for c in self.data_sha256)
        ):
            raise bad("data_sha256", "must be 64 lowercase hex digits or null")
        for key in ("run_id", "out_dir", "data_path"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise bad(key, "must be a non-empty string")
        if "/" in self.run_id or self.run_id in (".", ".."):
            raise bad("run_id", "must not contain '/' (it names folders)")
        self._validate_fault_tolerance(bad)
        self._validate_compression(bad)
        return self

    def _validate_int_ranges(self, bad: Any) -> None:
        """The upper bound of every integer key (:data:`INT64_MAX`, :data:`INT_MAX`) and the seed's
        range, so that no value the program cannot hold gets past ``--check`` (the lower bounds
        and the types follow in :meth:`validate`)."""
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= INT64_MAX:
            raise bad("seed", f"must be an integer in [0, {INT64_MAX}] (0 to 2**63-1: torch and numpy "
                      "seed with 64 bits)")
        for key, want in FIELD_TYPES.items():
            value = getattr(self, key)
            if want is not int or isinstance(value, bool) or not isinstance(value, int):
                continue
            high = INT_MAX.get(key, INT64_MAX)
            if value > high:
                why = ("no node has that many CPUs, and the OpenMP pool of that many threads cannot be "
                       "made" if key == "threads" else "2**63-1: torch and numpy hold it in 64 bits")
                raise bad(key, f"must be at most {high} ({why})")

    def _validate_compression(self, bad: Any) -> None:
        """``vocab_size`` and the gradient compression keys (checked whatever the compression)."""
        if self.vocab_size is not None and (
            isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < 1
        ):
            raise bad("vocab_size", "must be a positive integer or null (= the dataset's characters)")
        if self.grad_compression not in GRAD_COMPRESSIONS:
            raise bad("grad_compression", f"must be one of {', '.join(GRAD_COMPRESSIONS)}")
        for key, low in (("powersgd_rank", 1), ("powersgd_start_step", 2)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise bad(key, f"must be an integer >= {low}" + (
                    " (PowerSGD's error feedback needs two plain all-reduces first)" if low == 2 else ""))
        if self.grad_compression != "none" and self.fault_tolerance != "torchelastic":
            raise bad("grad_compression", f"compresses the gradients of the torchelastic engine's DDP "
                      f"all-reduce; fault_tolerance {self.fault_tolerance} averages them itself: set "
                      "grad_compression none (playbook: ddp_job_grad_compression)")

    def _validate_fault_tolerance(self, bad: Any) -> None:
        """The engine and its ``ft_*`` keys (checked whatever the engine, required for per_step)."""
        if self.fault_tolerance not in ENGINES:
            raise bad("fault_tolerance", f"must be one of {', '.join(ENGINES)}")
        port = self.ft_manager_port
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise bad("ft_manager_port", "must be a TCP port (1-65535)")
        for key in ("ft_min_replicas", "ft_start_replicas"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(key, "must be a positive integer (> 0)")
        for key in ("ft_timeout_s", "ft_quorum_timeout_s", "ft_start_timeout_s", "ft_rejoin_wait_s"):
            value = getattr(self, key)
            if not _is_real(value) or value <= 0:
                raise bad(key, "must be a number > 0")
        if self.ft_replica_id is not None and (
            not isinstance(self.ft_replica_id, str) or not self.ft_replica_id
            or any(c.isspace() or c == ":" for c in self.ft_replica_id)
        ):
            raise bad("ft_replica_id", "must be a non-empty name without spaces or ':' "
                      "(the node's inventory name), or null (= the host name)")
        if self.ft_launch_id is not None and (
            not isinstance(self.ft_launch_id, str) or not self.ft_launch_id
            or any(c.isspace() for c in self.ft_launch_id)
        ):
            raise bad("ft_launch_id", "must be a non-empty name without spaces (the role writes one "
                      "per launch), or null")
        if self.ft_lighthouse is not None and lighthouse_error(self.ft_lighthouse):
            raise bad("ft_lighthouse", lighthouse_error(self.ft_lighthouse))
        if self.fault_tolerance in LIGHTHOUSE_ENGINES and self.ft_lighthouse is None:
            raise bad("ft_lighthouse", f"fault_tolerance {self.fault_tolerance} needs the lighthouse "
                      "address 'http://ADDR:PORT' (playbook: the rendezvous host and "
                      "rendezvous_lighthouse_port)")
        self._validate_diloco(bad)

    def _validate_diloco(self, bad: Any) -> None:
        """``sync_every`` and the outer optimizer's keys (checked whatever the engine); under diloco
        the evaluations fall on syncs (they evaluate the replicas' common model)."""
        if isinstance(self.sync_every, bool) or not isinstance(self.sync_every, int) or self.sync_every < 1:
            raise bad("sync_every", "must be a positive integer (inner steps between two syncs)")
        if not _is_real(self.outer_lr) or self.outer_lr <= 0:
            raise bad("outer_lr", "must be a number > 0")
        if not _is_real(self.outer_momentum) or not 0 <= self.outer_momentum < 1:
            raise bad("outer_momentum", "must be a number in [0, 1)")
        if self.fault_tolerance == "diloco" and self.eval_interval % self.sync_every:
            raise bad("eval_interval", f"must be a multiple of sync_every = {self.sync_every} under "
                      "fault_tolerance diloco (an evaluation reads the replicas' common model, which "
                      "they hold right after a sync); fix: eval_interval "
                      f"{max(self.sync_every, self.eval_interval // self.sync_every * self.sync_every)}"
                      " or another sync_every")

    def to_dict(self) -> dict[str, Any]:
        """The configuration as a JSON-ready dict."""
        return dataclasses.asdict(self)

    def ramp_steps(self) -> int:
        """Length of the LR ramp after a world-size change (``lr_ramp_steps``, else warmup)."""
        return self.warmup_steps if self.lr_ramp_steps is None else self.lr_ramp_steps

    def model_shape(self) -> dict[str, int]:
        """The fields that a checkpoint must match to be resumed."""
        return {key: getattr(self, key) for key in MODEL_SHAPE_FIELDS}


#: What a resume takes from the run it resumes (its run.json, resolved by :func:`build_config`)
#: unless given again: every field that shapes training. The first group cannot change within a run
#: (the engine, the model's shape, the seed that orders the data and initialises the weights, the
#: dataset that gives the vocabulary: a checkpoint of another value is refused, :class:`ddplab.train`;
#: diloco's sync_every, to which its rounds are aligned);
#: a given value that differs is a conflict. The others may change (e.g. a larger max_steps): the
#: given value is used and reported. Per-node and per-launch keys (paths, run id, threads, ft_* of
#: the launch, allow_fresh_start, adopt_run_id) are the launch's own.
RESUME_FIXED = ("fault_tolerance", "preset", *MODEL_SHAPE_FIELDS, "seed", "data_sha256", "sync_every")
RESUME_CHANGEABLE = (
    "max_steps", "dropout", "per_rank_batch_size", "global_batch_size", "batch_policy",
    "batch_balance", "base_lr",
    "reference_batch_size", "warmup_steps", "lr_ramp_steps", "min_lr_ratio", "weight_decay", "beta1",
    "beta2", "grad_clip", "divergence_margin", "eval_interval", "eval_iters", "ckpt_interval",
    "keep_checkpoints", "log_interval", "sample_chars", "grad_compression", "powersgd_rank",
    "powersgd_start_step", "outer_lr", "outer_momentum",
)
RESUME_FIELDS = RESUME_FIXED + RESUME_CHANGEABLE


@dataclass
class ResumePlan:
    """What a resume of run ``run_id`` trains with (:func:`resume_plan`).

    ``settings``: the run's values of the :data:`RESUME_FIELDS` not given again (run.json keys);
    ``changes``: ``key: run's value -> given value`` per given changeable value that differs;
    ``conflicts``: one line per problem (a fixed setting given with another value, a max_steps the
    run has already reached, a merged configuration the training program refuses); empty: the
    resume may go ahead.
    """

    run_id: str
    settings: dict[str, Any]
    changes: list[str]
    conflicts: list[str]


def resume_plan(run_id: str, recorded: dict[str, Any], given: dict[str, Any],
                reached_step: int | None = None, names: dict[str, str] | None = None) -> ResumePlan:
    """Merge a run's recorded configuration with the settings given for its resume.

    ``recorded``: the run's run.json values (as ddp-lab wrote them at its launch); ``given``: the
    TrainConfig keys given explicitly for this resume (JSON/CLI values, coerced like
    :func:`build_config`); ``reached_step``: the newest checkpoint step on the nodes (None: unknown),
    which a given max_steps must exceed; ``names``: how the messages name a key (the playbook
    variable that gives it, e.g. ``fault_tolerance`` -> ``ddp_job_fault_tolerance``), default the key.

    Raises:
        ConfigError: ``recorded`` is not a valid configuration (unknown key, bad value).
    """
    try:
        run = build_config(recorded)
    except ConfigError as exc:
        raise ConfigError(f"the recorded configuration of run {run_id} is not valid: {exc}") from None
    conflicts: list[str] = []
    changes: list[str] = []
    names = names or {}
    given = {k: v for k, v in given.items() if v is not None}
    coerced: dict[str, Any] = {}
    for key in sorted(set(given) & set(RESUME_FIELDS)):
        try:
            value = coerced[key] = _coerce(key, given[key])
        except ConfigError as exc:
            conflicts.append(str(exc))
            continue
        old, shown = getattr(run, key), names.get(key, key)
        if value == old:
            continue
        if key in RESUME_FIXED:
            conflicts.append(f"{shown}: run {run_id} was trained with {old!r}, given {value!r}; fix: leave "
                             f"{shown} out to resume with the run's value (or start a new run)")
        else:
            changes.append(f"{shown} {old!r} -> {value!r}")
    settings = {k: getattr(run, k) for k in RESUME_FIELDS if k not in given}
    max_steps = coerced.get("max_steps")
    shown = names.get("max_steps", "max_steps")
    if reached_step is not None and isinstance(max_steps, int) and max_steps <= reached_step:
        rest = (f", or leave it out to resume to the run's {run.max_steps}"
                if run.max_steps > reached_step else "")
        conflicts.append(f"{shown}: given {max_steps}, run {run_id} has reached step {reached_step} (its "
                         f"newest checkpoint); fix: a max_steps above {reached_step}{rest}")
    elif reached_step is not None and max_steps is None and run.max_steps <= reached_step:
        # the run's own max_steps, taken when none is given: nothing is left to train
        conflicts.append(f"run {run_id} has reached its max_steps {run.max_steps} (newest checkpoint "
                         f"step {reached_step}): nothing to resume; fix: give {shown} above "
                         f"{reached_step} to train it further")
    if not conflicts:
        try:
            build_config({**recorded, **settings, **given})
        except ConfigError as exc:
            conflicts.append(f"the resumed configuration is refused: {exc}")
    return ResumePlan(run_id, settings, changes, conflicts)


def lighthouse_error(url: Any) -> str | None:
    """Why ``url`` is not a lighthouse address ``http://HOST:PORT`` (None when it is one)."""
    if not isinstance(url, str):
        return "must be a string 'http://ADDR:PORT'"
    parsed = urllib.parse.urlsplit(url)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if (parsed.scheme != "http" or not parsed.hostname or port is None or port == 0
            or parsed.path not in ("", "/") or parsed.query or parsed.fragment):
        return "must be 'http://ADDR:PORT' (the lighthouse's address and port, nothing else)"
    return None


def _is_real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _field_types() -> tuple[dict[str, type], frozenset[str]]:
    hints = typing.get_type_hints(TrainConfig)
    out: dict[str, type] = {}
    optional = set()
    for f in fields(TrainConfig):
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
            hint = args[0]
            optional.add(f.name)
        out[f.name] = hint
    return out, frozenset(optional)


FIELD_TYPES, OPTIONAL_FIELDS = _field_types()


def _coerce(key: str, value: Any) -> Any:
    """Convert a JSON/CLI value to the field's type; ``None``/"null"/"none" clears optional fields."""
    want = FIELD_TYPES[key]
    if key == "batch_balance" and value is False:
        return "off"  # YAML reads an unquoted off as false (Ansible's choices accept it as off)
    if isinstance(value, str) and value.lower() in ("null", "none") and key in OPTIONAL_FIELDS:
        return None
    if value is None:
        return None
    if want is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "false", "no", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"config key '{key}' = {value!r}: must be true or false")
    try:
        if want is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float):
                if not value.is_integer():
                    raise ValueError
                return int(value)
            return int(value)
        if want is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
    except (TypeError, ValueError, OverflowError):
        allowed = ""
        if want is int:
            allowed = f" (an integer in [0, {INT64_MAX}])" if key == "seed" else (
                f" (an integer, at most {INT_MAX.get(key, INT64_MAX)})")
        raise ConfigError(f"config key '{key}' = {value!r}: must be {want.__name__}{allowed}") from None
    if want is str:
        return str(value)
    return value


def build_config(
    json_values: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None
) -> TrainConfig:
    """Merge defaults < preset < ``json_values`` < ``overrides`` and validate.

    Raises:
        ConfigError: an unknown key, a value of the wrong type or an invalid value.
    """
    json_values = dict(json_values or {})
    overrides = dict(overrides or {})
    known = {f.name for f in fields(TrainConfig)}
    for source, values in (("config file", json_values), ("command line", overrides)):
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"unknown config key(s) in {source}: {', '.join(unknown)} "
                f"(known: {', '.join(sorted(known))})"
            )
    preset = overrides.get("preset", json_values.get("preset", TrainConfig.preset))
    if preset not in PRESETS:
        raise ConfigError(f"config key 'preset' = {preset!r}: must be one of {', '.join(PRESETS)}")
    merged: dict[str, Any] = {"preset": preset, **PRESETS[preset]}
    for values in (json_values, overrides):
        for key, value in values.items():
            merged[key] = _coerce(key, value)
    return TrainConfig(**merged).validate()


def load_json(path: str | Path) -> dict[str, Any]:
    """Read a run config JSON object.

    Raises:
        ConfigError: the file is missing, unreadable, not JSON, or not an object.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid JSON: {exc}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} must hold a JSON object, not {type(values).__name__}")
    return values


def make_parser() -> argparse.ArgumentParser:
    """The CLI: ``--config run.json`` plus one ``--<key>`` flag per TrainConfig field."""
    parser = argparse.ArgumentParser(
        prog="python -m ddplab.train",
        description="Elastic, exactly-resumable character-level GPT training (torchrun or alone).",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", help="JSON file of config keys (CLI flags override it)")
    parser.add_argument(
        "--check", action="store_true",
        help="validate config, dataset and checkpoint folder, print the resolved config, exit",
    )
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        alias = "--" + f.name
        names = [flag] if flag == alias else [flag, alias]
        if FIELD_TYPES[f.name] is bool:  # --allow-fresh-start, or --allow-fresh-start false
            parser.add_argument(*names, dest=f.name, nargs="?", const=True, metavar="BOOL",
                                help=f"(default {f.default!r})")
            continue
        parser.add_argument(
            *names, dest=f.name, metavar=FIELD_TYPES[f.name].__name__.upper(),
            help=f"(default {f.default!r})",
        )
    return parser


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, bool]:
    """Parse the command line into a validated config; return ``(config, check_only)``.

    Raises:
        ConfigError: see :func:`build_config` and :func:`load_json`.
    """
    ns = vars(make_parser().parse_args(argv))
    check = bool(ns.pop("check", False))
    config_path = ns.pop("config", None)
    json_values = load_json(config_path) if config_path else {}
    return build_config(json_values, ns), check
