"""The report's page: figures of :mod:`ddplab.controller.report.data` formatted and laid out by the jinja2
template ``templates/report.html.j2`` (no scripts, no CDN, inline CSS: opens offline)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import jinja2

from ddplab.controller import straggler
from ddplab.controller.report.data import (
    Fault,
    Restart,
    band_rule,
    distinct_samples,
    engine,
    fault_step,
    faults,
    first_set,
    no_training_bands,
    per_world_size,
    rebalances,
    restarts,
    run_status,
    start_line,
    time_span,
    train_loss,
    wire_rows,
    ws_sequence,
)
from ddplab.controller.rundir import RunFolder
from ddplab.controller.summary import launches, partial_line, restarts_within_launches
from ddplab.engines import replica_groups
from ddplab.records import as_int, num

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "templates"


def environment() -> jinja2.Environment:
    """The jinja2 environment of the report templates (autoescape, strict undefined)."""
    return jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATE_DIR), autoescape=True,
                              undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)


def _fmt_s(v: float | None, digits: int = 1) -> str:
    return "—" if v is None else f"{v:.{digits}f} s"


def fmt_bytes(v: float | None, none: str = "—") -> str:
    """Bytes in decimal units (B, KB, MB, GB), three significant digits; ``none`` for None (the
    report's "—"; benchmarks/lowcomm.py's text table passes "-")."""
    if v is None:
        return none
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(v) >= size:
            return f"{v / size:.3g} {unit}"
    return f"{v:.0f} B"


def _fmt_clock(t: float | None, t0: float) -> str:
    if t is None:
        return "—"
    d = t - t0
    return f"{'-' if d < 0 else ''}{int(abs(d)) // 60}:{int(abs(d)) % 60:02d}"


def _fmt_wall(s: float | None) -> str:
    if s is None:
        return "—"
    s = int(round(s))
    return f"{s // 3600}h {s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m {s % 60:02d}s"


def _fmt_params(n: float | None) -> str:
    if not n:
        return "—"
    return f"{n / 1e6:.2f} M params" if n >= 1e6 else f"{n / 1e3:.1f} k params"


def _fmt_loss(v: Any) -> str:
    x = num(v)
    return "—" if x is None else f"{x:.3f}"


def key_figures(run: RunFolder, rs: list[Restart], fl: list[Fault],
                findings: list[straggler.StragglerFinding], t0: float, t1: float,
                live: bool = False, gain: straggler.BalanceGain | None = None) -> list[tuple[str, str]]:
    """The figures shown as cards (label, value): summary.json values, else derived from the
    metrics; ``gain``: :func:`ddplab.controller.straggler.balance_gain` of the run (None: off).
    The train loss is given twice, each labelled with its step: the last minibatch's (what the
    progress lines and the loss plot show) and the evaluation estimate
    (:class:`ddplab.controller.report.data.TrainLoss`)."""
    s = run.summary
    steps = [r["step"] for r in run.by_event("step") if isinstance(r.get("step"), int)]
    hosts = s.get("hosts") or sorted({str(r["host"]) for r in run.records if r.get("host")})
    if isinstance(hosts, dict):
        hosts = sorted(hosts)
    unread = set(s.get("unread") or ())
    hosts = [f"{h} (not read)" if h in unread else h for h in hosts]
    tl = train_loss(run)
    # the evaluation summary.json gives (the newest when the run ended without its final one)
    final_val, val_step = tl.val_loss, tl.estimate_step
    start = next(iter(run.by_event("start")), {})
    tok = [w.tokens_per_s for w in per_world_size(run) if w.tokens_per_s is not None]
    params = num(start.get("params"))
    newest_start = run.by_event("start")[-1] if run.by_event("start") else {}
    max_steps = first_set(newest_start.get("max_steps"), s.get("max_steps"))
    of = f" of {max_steps}" if max_steps is not None else ""
    if "steps_completed" in s and not live:
        done = ("steps completed", f"{s['steps_completed']}{of}")
    else:
        done = ("last step", f"{max(steps)}{of}" if steps else "—")

    def at(step: int | None) -> str:
        return "" if step is None else f", step {step}"

    figures = [
        done,
        (f"train loss: last minibatch{at(tl.minibatch_step)}", _fmt_loss(tl.minibatch)),
        (f"train loss: evaluation estimate{at(tl.estimate_step)}", _fmt_loss(tl.estimate)),
        (f"val loss: evaluation{at(val_step)}", _fmt_loss(final_val)),
        ("wall time", _fmt_wall(num(s.get("wall_s")) or (t1 - t0 if steps else None))),
        ("nodes", f"{len(hosts)}: {', '.join(map(str, hosts))}" if hosts else "—"),
        ("world sizes", " → ".join(str(w) for w in ws_sequence(run)) or "—"),
        restarts_figure(run, rs),
        ("launches", _launches(run)),
        ("faults injected", str(len(fl))),
        ("batch policy", str(s.get("batch_policy") or start.get("batch_policy") or "—")),
        ("model", _fmt_params(params)),
        ("tokens/s (max N)", f"{tok[-1]:,.0f}" if tok else "—"),
        ("stragglers", ", ".join(sorted({f.host for f in findings})) or "none"),
        balance_figure(run, gain),
    ]
    return figures


def balance_figure(run: RunFolder, gain: straggler.BalanceGain | None) -> tuple[str, str]:
    """The batch balance card: off, or speed with what it gained (``gain``:
    :func:`ddplab.controller.straggler.balance_gain` of the run)."""
    start = run.by_event("start")[-1] if run.by_event("start") else {}
    if gain is None:
        return "batch balance", str(start.get("batch_balance") or "off")
    return "batch balance", f"speed ({gain.gain:.0%} less waiting)" if gain.steps else "speed"


def balance_section(run: RunFolder, fl: list[Fault], gain: straggler.BalanceGain | None
                    ) -> dict[str, Any] | None:
    """The straggler section's balanced batches (``gain``:
    :func:`ddplab.controller.straggler.balance_gain` of the run): what balancing gained, each
    node's share and speed, the plans (the last 30) and how each fault was re-balanced; None when
    balancing is off."""
    if gain is None:
        return None
    fastest = max((w.speed for w in gain.workers), default=0.0)
    return {
        "line": straggler.format_balance(gain),
        "workers": [{"node": w.host + (f"/local{w.local_rank}" if w.local_rank else ""),
                     "share": f"{w.share:g}", "speed": f"{w.speed:.1f}",
                     "relative": f"{w.speed / fastest:.2f}" if fastest else "—"} for w in gain.workers],
        "plans": [{"step": p.step, "reason": p.reason,
                   "shares": ", ".join(f"{h}{f'/local{lr}' if lr else ''} {n}"
                                       for (h, lr), n in sorted(p.shares.items()))}
                  for p in gain.plans[-30:]],
        "more_plans": max(0, len(gain.plans) - 30),
        "faults": [{"what": r.what, "at": r.at_step, "plan": first_set(r.plan_step, "—"),
                    "steps": first_set(r.steps, "—"), "reason": r.reason or "not re-planned",
                    "shares": ", ".join(f"{h} {n}" for h, n in r.shares.items())}
                   for r in rebalances(run, fl, gain)],
    }


def restarts_figure(run: RunFolder, rs: list[Restart]) -> tuple[str, str]:
    """The restarts card, labelled with what it counts: summary.json's ``restarts`` rule
    (:func:`ddplab.controller.summary.restarts_within_launches`) on the run's records, so the live
    and the final page and summary.json agree; without records, summary.json's value (else the
    non-initial starts of ``rs``)."""
    what = ("replica processes started again" if replica_groups(engine(run)) else "group re-formed")
    if run.records:
        n = restarts_within_launches(run.records, run.events)
    else:
        n = as_int(run.summary.get("restarts"))
        n = sum(1 for r in rs if not r.initial) if n is None else n
    return f"restarts ({what}; launches not counted)", str(n)


def _launches(run: RunFolder) -> str:
    kinds = launches(run.events, run.records)
    return f"{len(kinds)} ({', '.join(kinds)})" if len(kinds) > 1 else str(len(kinds))


def live_banner(run: RunFolder, now: float | None = None) -> str:
    """The live page's banner: ``live, step S of M, updated HH:MM:SS`` (S: the newest step any
    record names, M: max_steps of the newest start record; local time ``now``, default the clock)."""
    steps = [s for r in run.records if r.get("event") in ("step", "val", "checkpoint", "end", "failure")
             and isinstance(s := r.get("step"), int)]
    starts = run.by_event("start")
    total = starts[-1].get("max_steps") if starts else None
    step = f"step {max(steps)} of {total if total is not None else '?'}" if steps else "no step yet"
    return f"live, {step}, updated {time.strftime('%H:%M:%S', time.localtime(now))}"


def ended_banner(run: RunFolder) -> str:
    """The banner of the page the watch leaves when it saw the job end (not collected yet): ``the
    job ended: step S of M, last record HH:MM:SS; not collected yet: ansible-playbook
    playbooks/collect.yml -e collect_run_id=<run id> writes the final report``."""
    times = [t for r in run.records if (t := num(r.get("time"))) is not None]
    when = time.strftime("%H:%M:%S", time.localtime(max(times))) if times else "?"
    step = live_banner(run).split(", updated ")[0].removeprefix("live, ")
    return (f"the job ended: {step}, last record {when}; not collected yet: ansible-playbook "
            f"playbooks/collect.yml -e collect_run_id={run.run_id} writes the final report")


def render_page(run: RunFolder, findings: list[straggler.StragglerFinding], plots: dict[str, str],
                cpu_has: tuple[bool, bool], margin: float, window: int, clock_drop: float,
                refresh_s: int | None = None, ended: bool = False) -> str:
    """The report page (HTML text) of ``run``: key figures, recoveries, restarts, straggler
    findings, per-world-size figures, the generated sample and events, linking the ``plots``
    (name -> relative path).

    ``refresh_s``: a live page (the job runs): a banner (:func:`live_banner`) and a
    ``<meta http-equiv="refresh">`` of that many seconds; None: the final page, neither.
    ``ended``: the page the watch leaves when the job ended, before collect: no reload, a banner
    that says so (:func:`ended_banner`).
    """
    t0, t1 = time_span(run)
    rs, fl = restarts(run), faults(run)
    gain = straggler.balance_gain(run.records)  # one pass over the records for the card and the section
    live = refresh_s is not None
    recoveries = []
    for f in fl:
        recoveries.append({
            "mode": f.mode, "node": f.node, "rank": "—" if f.rank is None else f.rank,
            "injected": _fmt_clock(f.time, t0), "step": first_set(fault_step(run, f), "—"),
            "detected": _fmt_s(f.detected_s), "recovered": _fmt_s(f.recovered_s),
            "steps_lost": "—" if f.steps_lost is None else f.steps_lost, "ws": f.ws_text,
            "outcome": "; ".join(x for x in (f.outcome, f.interim_text) if x),
        })
    status, status_class = run_status(run, fl, findings, live=live)
    known = {"time", "kind", "mode", "node"}
    events = [{"t": _fmt_clock(num(e.get("time")), t0),
               "clock": time.strftime("%H:%M:%S", time.localtime(num(e.get("time")) or 0))
               if num(e.get("time")) is not None else "—", "kind": e.get("kind") or "",
               "mode": e.get("mode") or "", "node": e.get("node") or "",
               "rest": ", ".join(f"{k}={v}" for k, v in e.items() if k not in known and v is not None)}
              for e in run.events]
    per_ws = [{"world_size": w.world_size, "steps": w.steps, "step": _fmt_s(w.step_s, 3),
               "compute": "—" if w.compute_share is None else f"{w.compute_share:.0%}",
               "allreduce": "—" if w.allreduce_share is None else f"{w.allreduce_share:.0%}",
               "tokens": "—" if w.tokens_per_s is None else f"{w.tokens_per_s:,.0f}"}
              for w in per_world_size(run)]
    wire = [{"host": w.host, "world_size": w.world_size, "mode": f"{w.engine} / {w.grad_compression}",
             "nic": w.nic or "—", "steps": w.steps, "sent": fmt_bytes(w.sent), "recv": fmt_bytes(w.recv),
             "model": fmt_bytes(w.model), "ratio": "—" if w.ratio is None else f"{w.ratio:.2f}"}
            for w in wire_rows(run)]
    bands = [{"from": _fmt_clock(b.start, t0), "seconds": f"{b.seconds:.1f}", "cause": b.cause,
              "steps": f"{b.from_step} → {b.to_step}", "label": b.label} for b in no_training_bands(run)]
    start_txt = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t0))
    return environment().get_template("report.html.j2").render(
        run_id=run.run_id, status=status, status_class=status_class,
        subtitle=f"started {start_txt} · {len(run.metrics_files)} metrics file(s) · folder {run.path}",
        # collect could not read every trainer (summary.json's unread; the watch's pages have none)
        notes=[*([partial_line(run.summary["unread"])] if run.summary.get("unread") else []), *run.notes],
        no_metrics=not run.by_event("step"), path=str(run.path),
        metrics_files=run.metrics_files, n_records=len(run.records),
        key_figures=key_figures(run, rs, fl, findings, t0, t1, live, gain), plots=plots,
        recoveries=recoveries, refresh_s=refresh_s,
        banner=live_banner(run) if live else (ended_banner(run) if ended else ""),
        samples=distinct_samples(run.samples),
        restarts=[start_line(r, _fmt_clock(r.time, t0)) for r in rs],
        findings=[{"kind": f.kind.replace("_", " "), "host": f.host, "rank": f.rank,
                   "steps": f"{f.from_step}–{f.to_step}", "ratio": f"{f.ratio:.2f} ({f.worst_ratio:.2f})",
                   "text": straggler.format_finding(f)} for f in findings],
        margin_pct=f"{margin:.0%}", window=window, clock_pct=f"{clock_drop:.0%}",
        per_ws=per_ws, wire=wire, cpu_has=cpu_has, events=events, made=time.strftime("%Y-%m-%d %H:%M:%S"),
        engine=engine(run), bands=bands, balance=balance_section(run, fl, gain),
        band_rule=band_rule(),
    )
