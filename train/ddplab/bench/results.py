"""The results file of a benchmark: ``benchmarks/results/<name>.md``, written by the benchmark.

Every benchmark (``benchmarks/*.py``, bench.yml's report) ends by calling :func:`write` with the
table it printed. The file holds that table and what the figures depend on: the exact command, the
date, the git commit of the code that ran, the machine (CPU model, cores, RAM, system, Python) and
the load average before and after. It is replaced whole at every run (a temp file, then a rename),
so a figure in it is always one the command produced; docs link to the file instead of copying
figures.

Where: :func:`results_dir` -- ``$DDPLAB_RESULTS_DIR`` if set, else the checkout's
``benchmarks/results`` (found from this file's place: ``train/ddplab/bench/results.py``). The
benchmarks' ``--results-dir`` option overrides both; the tests point it at a temporary folder.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import psutil

#: Environment variable naming the folder results go to (overrides the checkout's).
RESULTS_ENV = "DDPLAB_RESULTS_DIR"
#: The checkout this module belongs to (``<checkout>/train/ddplab/bench/results.py``).
CHECKOUT = Path(__file__).resolve().parents[3]
#: A results file's name: ``<name>.md`` with name in this form (no folders, no dots).
NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")
#: Files under this path do not make the checkout "changed" for :func:`git_commit` (a results file
#: left uncommitted by an earlier run is no change to the code that runs).
RESULTS_PATH = "benchmarks/results"

Load = Sequence[float] | str | None


class ResultsError(ValueError):
    """The results file cannot be written: bad name, or no folder to write it to."""


@dataclass(frozen=True)
class Machine:
    """What the figures were measured on (this machine)."""

    cpu_model: str
    logical_cpus: int
    physical_cores: int | None
    ram_bytes: int
    system: str  # e.g. "Linux 6.1.0-18-amd64 x86_64"
    python: str  # e.g. "3.11.2"
    torch: str | None  # torch.__version__ when the benchmark imported torch, else None

    def text(self) -> str:
        """One line, e.g. ``Intel(R) Xeon(R) Processor, 2 logical CPUs (2 physical cores), 23.5 GiB
        RAM, Linux 6.1.0 x86_64, Python 3.11.2, torch 2.13.0``."""
        cores = f"{self.logical_cpus} logical CPUs"
        if self.physical_cores:
            cores += f" ({self.physical_cores} physical cores)"
        parts = [self.cpu_model, cores, f"{self.ram_bytes / 2**30:.1f} GiB RAM", self.system,
                 f"Python {self.python}"]
        if self.torch:
            parts.append(f"torch {self.torch}")
        return ", ".join(parts)


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``; psutil does not report it), else
    :func:`platform.processor`, else ``"unknown CPU"``."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> Machine:
    """This machine's :class:`Machine` (psutil for CPUs and RAM)."""
    torch = sys.modules.get("torch")
    return Machine(
        cpu_model=cpu_model(),
        logical_cpus=psutil.cpu_count(logical=True) or os.cpu_count() or 1,
        physical_cores=psutil.cpu_count(logical=False),
        ram_bytes=psutil.virtual_memory().total,
        system=f"{platform.system()} {platform.release()} {platform.machine()}",
        python=platform.python_version(),
        torch=getattr(torch, "__version__", None),
    )


def loadavg() -> tuple[float, float, float]:
    """The 1-, 5- and 15-minute load averages now (:func:`os.getloadavg`)."""
    one, five, fifteen = os.getloadavg()
    return one, five, fifteen


def load_text(load: Load) -> str:
    """``1.57 1.08 0.53`` for three load averages, a text as given, ``not measured`` for None."""
    if load is None:
        return "not measured"
    if isinstance(load, str):
        return load
    return " ".join(f"{v:.2f}" for v in load)


def git_commit(checkout: Path = CHECKOUT) -> str:
    """The commit of ``checkout`` the benchmark ran from: its full hash, followed by ``with
    uncommitted changes`` when tracked files (other than the results files) differ from it;
    ``unknown (...)`` when it is not a git checkout or git is missing."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                      f":(exclude){RESULTS_PATH}")
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({checkout} is not a git checkout: {type(exc).__name__})"
    return commit + (" with uncommitted changes" if changed else "")


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as it was typed, shell-quoted: ``argv`` if given, else the interpreter's own
    command line (:data:`sys.orig_argv`, e.g. ``.venv/bin/python benchmarks/recovery.py
    --repeat 3`` or ``python -m ddplab.controller.bench_report runs/bench-x``)."""
    return shlex.join(list(argv) if argv is not None else sys.orig_argv)


def ancestor_command(program: str) -> str | None:
    """The command line of the nearest ancestor process running ``program`` (e.g.
    ``ansible-playbook``: the command a user typed when this process is a task of it), None when
    there is none."""
    try:
        for proc in psutil.Process().parents():
            try:
                argv = proc.cmdline()
            except psutil.Error:
                continue
            if any(Path(a).name == program for a in argv[:2]):
                return shlex.join(argv)
    except psutil.Error:
        return None
    return None


def results_dir(given: str | Path | None = None) -> Path:
    """The folder results go to: ``given``, else ``$DDPLAB_RESULTS_DIR``, else the checkout's
    ``benchmarks/results``. Raises ResultsError when none applies (an installed copy of ddplab,
    away from a checkout)."""
    if given:
        return Path(given)
    if os.environ.get(RESULTS_ENV):
        return Path(os.environ[RESULTS_ENV])
    if (CHECKOUT / "benchmarks").is_dir():
        return CHECKOUT / RESULTS_PATH
    raise ResultsError(f"no benchmarks/ folder in {CHECKOUT} (ddplab is not run from a checkout): "
                       f"set {RESULTS_ENV} or pass --results-dir")


def code_block(text: str) -> str:
    """``text`` (a fixed-width table as printed) as a Markdown code block."""
    return f"```text\n{text.rstrip()}\n```"


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table: ``head`` then one line per row (cells as ``str``; ``|`` escaped)."""
    def line(cells: Sequence[object]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(head), "|" + "---|" * len(head), *(line(r) for r in rows)])


def render(title: str, body: str, *, command: str, date: str, commit: str, machine_text: str,
           load_before: Load, load_after: Load, notes: Sequence[str] = ()) -> str:
    """The file's text (see :func:`write`)."""
    lines = [
        f"# {title}",
        "",
        "<!-- Written by the benchmark (ddplab.bench.results); run the command again to replace it. -->",
        "",
        f"- command: `{command}`",
        f"- date: {date}",
        f"- git commit: {commit}",
        f"- machine: {machine_text}",
        f"- load average (1, 5, 15 min): before {load_text(load_before)}; after {load_text(load_after)}",
        "",
        body.rstrip(),
        "",
    ]
    if notes:
        lines += [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


def provenance() -> dict[str, str]:
    """Where and when figures are measured: ``{"date", "commit", "machine"}`` as a results page
    shows them (now, :func:`git_commit`, :func:`machine`). A benchmark that keeps raw figures
    records it beside them, so that a page written again from them (:func:`write`'s ``made``)
    shows the measurements' date, commit and machine, not the rewrite's."""
    return {"date": datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": git_commit(),
            "machine": machine().text()}


def raw_figures_problem(path: Path, exc: Exception, example: str) -> str:
    """One line on the ``--table`` file ``path`` a benchmark could not take as its raw figures:
    ``exc`` is what reading, parsing or tabling them raised; ``example`` names a file the benchmark
    writes (e.g. ``runs/bench-scaling-<time>.json``). A plain ValueError carries its own fix."""
    if type(exc) is ValueError:
        return f"--table {path}: {exc}"
    return (f"--table {path}: not raw figures of this benchmark ({type(exc).__name__}: {exc}); fix: give a "
            f"{example} it wrote")


#: What reading, parsing and tabling a --table file that is not a benchmark's raw figures raises.
RAW_FIGURES_ERRORS = (OSError, ValueError, LookupError, TypeError, AttributeError)


def recorded_provenance(raw: Mapping) -> dict[str, str] | None:
    """The :func:`provenance` that raw figures ``raw`` recorded under ``"made"``; None when they
    did not record one.

    Raises:
        ValueError: ``"made"`` is not a mapping of the one-line, non-empty strings ``date``,
            ``commit`` and ``machine``.
    """
    made = raw.get("made")
    if made is None:
        return None
    keys = ("date", "commit", "machine")
    if not (isinstance(made, Mapping) and all(isinstance(made.get(k), str) and made[k].strip()
                                              and "\n" not in made[k] for k in keys)):
        raise ValueError(f'"made" is {made!r}, not the date, commit and machine strings a benchmark records;'
                         ' fix: give the raw figures as the benchmark wrote them (or drop "made")')
    return dict(made)


def write(name: str, body: str, *, title: str, load_before: Load, load_after: Load = None,
          command: str | None = None, notes: Sequence[str] = (), out_dir: str | Path | None = None,
          extra_machine: str | None = None, made: Mapping[str, str] | None = None) -> Path:
    """Write ``<results dir>/<name>.md`` and return its path.

    Args:
        name: the file's name without ``.md`` (:data:`NAME`: lower case, digits, ``-``, ``_``).
        body: the results in Markdown (:func:`code_block` of a printed table, or
            :func:`markdown_table`).
        title: the heading, e.g. ``"Recovery of both engines, side by side"``.
        load_before: the load averages sampled before the measurements (:func:`loadavg`), or a
            text when the benchmark sampled them elsewhere (e.g. per node).
        load_after: the same after them; None: sampled now.
        command: the command that produced the figures; None: this process's
            (:func:`command_line`).
        notes: lines listed after the body.
        out_dir: the folder (:func:`results_dir`'s ``given``).
        extra_machine: appended to the machine line (e.g. the cluster's nodes).
        made: the :func:`provenance` recorded when the figures were measured; None: now, this
            checkout's commit and this machine.

    Raises:
        ResultsError: ``name`` is not of the form :data:`NAME`, or no results folder (see
            :func:`results_dir`).
        OSError: the folder cannot be made or written.
    """
    if not NAME.fullmatch(name):
        raise ResultsError(f"results name {name!r}: use lower-case letters, digits, '-' and '_' "
                           "(it becomes <name>.md)")
    folder = results_dir(out_dir)
    after = loadavg() if load_after is None else load_after
    made = made or provenance()
    text = render(title, body, command=command if command is not None else command_line(),
                  date=made["date"], commit=made["commit"], machine_text=made["machine"] + (
                      f"; {extra_machine}" if extra_machine else ""),
                  load_before=load_before, load_after=after, notes=notes)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.md"
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep it from other readers of the checkout
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
