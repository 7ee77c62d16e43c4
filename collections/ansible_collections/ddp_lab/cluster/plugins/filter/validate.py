"""Filters of the validate role: what the read-only checks read, as facts (routes, lock holders,
clock offsets, unit properties, the doctor's table), and the judgement of a resume
(:func:`resume_plan`); the helpers the action ``validate_check`` builds its records with.
:data:`SETTINGS`: the role's rules for its own settings. Every function is pure."""

from __future__ import annotations

import base64
import io
import ipaddress
import json
import os
import re
import shlex
from datetime import UTC, datetime
from pathlib import Path

from ddplab import config as ddplab_config
from ddplab import units as ddplab_units
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text


def _shared(values: dict) -> dict[str, list[str]]:
    """``{value: [keys]}`` of the values of ``values`` (``{host: value}``; None and '' ignored) that
    more than one key has, in the dict's order."""
    seen: dict[str, list[str]] = {}
    for key, value in values.items():
        if value not in (None, ""):
            seen.setdefault(str(value), []).append(str(key))
    return {value: keys for value, keys in seen.items() if len(keys) > 1}


def shared_values(values: dict) -> list[str]:
    """:func:`_shared` as text: ``["a and b share 10.0.0.5"]``."""
    return [f"{' and '.join(keys)} share {value}" for value, keys in _shared(values).items()]


def sharing_keys(values: dict) -> dict[str, list[str]]:
    """``{key: [other keys with the same value]}`` for every key of :func:`_shared`."""
    return {key: [k for k in keys if k != key] for keys in _shared(values).values() for key in keys}


def connection_targets(hosts: list, hostvars) -> dict:
    """``{host: machine}``: each host's ``ansible_host``, or its inventory name when unset."""
    return {h: (hostvars[h].get("ansible_host") if h in hostvars else None) or h for h in hosts}


def is_loopback(address) -> bool:
    """True for an IPv4/IPv6 loopback address; False for anything else."""
    try:
        return ipaddress.ip_address(str(address).strip()).is_loopback
    except ValueError:
        return False


def loopbacks(addresses: list) -> list:
    """The loopback addresses among ``addresses`` (see :func:`is_loopback`)."""
    return [a for a in addresses or [] if is_loopback(a)]


def is_ipv4(address) -> bool:
    """True for a dotted-quad IPv4 address (no surrounding spaces, no leading zeros)."""
    try:
        ipaddress.IPv4Address(str(address))
    except ValueError:
        return False
    return True


# The playbook variables that give run.json keys (roles/ddp_job/vars/main.yml __ddp_job_config);
# any other key comes from ddp_job_train_overrides, which is combined last.
RESUME_VARS = {"ddp_job_preset": "preset", "ddp_job_max_steps": "max_steps",
               "ddp_job_lr_ramp_steps": "lr_ramp_steps", "ddp_job_fault_tolerance": "fault_tolerance",
               "ddp_job_dataset_sha256": "data_sha256", "ddp_job_grad_compression": "grad_compression",
               "ddp_job_powersgd_rank": "powersgd_rank", "ddp_job_powersgd_start_step": "powersgd_start_step",
               "ddp_job_sync_every": "sync_every", "ddp_job_outer_lr": "outer_lr",
               "ddp_job_outer_momentum": "outer_momentum", "ddp_job_batch_balance": "batch_balance"}
CHECKPOINT = re.compile(r"^ckpt-(\d{8,})\.pt$")  # ddplab.checkpoint's file names


def _first_difference(plans: dict) -> str:
    """``key: host a, host b`` for the first run.json key the trainers' resume plans disagree on."""
    hosts = sorted(plans)
    for key in sorted({k for p in plans.values() for k in p.settings}):
        values = [plans[h].settings.get(key) for h in hosts]
        if len({json.dumps(v, default=str) for v in values}) > 1:
            return f"{key}: " + ", ".join(f"{h} {v!r}" for h, v in zip(hosts, values, strict=True))
    return "-"


def resume_plan(nodes: dict, run_id: str, given_vars: dict, looked_in: str = "") -> dict:
    """What a resume of ``run_id`` trains with, judged before anything starts.

    ``nodes``: trainer -> ``{checkpoints: [file names in runs/<run_id>/checkpoints], run_json: the
    text of its run.json ('' when missing)}``; ``given_vars``: the variables the user set (a host's
    ``hostvars``), of which :data:`RESUME_VARS` and ``ddp_job_train_overrides`` are read;
    ``looked_in``: the checkpoint folder, for the message.

    Returns ``{problems, warnings, settings, changes, engine, step, holders}``: ``problems`` one line
    each (none: go ahead); ``settings`` the run.json keys taken from the run
    (``ddplab.config.resume_plan``); ``changes`` the given values that differ from the run's;
    ``engine`` the run's engine (None: unknown); ``step`` the newest checkpoint step on any node.
    """
    out: dict = {"problems": [], "warnings": [], "settings": {}, "changes": [], "engine": None,
                 "step": None, "holders": []}
    steps = {h: [int(m.group(1)) for n in (v or {}).get("checkpoints") or []
                 if (m := CHECKPOINT.match(str(n)))] for h, v in nodes.items()}
    out["holders"] = sorted(h for h, s in steps.items() if s)
    if not out["holders"]:
        out["problems"].append(
            f"no trainer holds a checkpoint of run {run_id} (looked in {looked_in or run_id + '/checkpoints'}"
            f" on {', '.join(sorted(nodes))}); fix: pick a run id from runs/ on the controller or leave"
            " ddp_job_resume_run_id empty to start a new run")
        return out
    out["step"] = max(max(s) for s in steps.values() if s)
    given_vars = {k: given_vars[k] for k in (*RESUME_VARS, "ddp_job_train_overrides") if k in given_vars}
    given = {RESUME_VARS[k]: v for k, v in given_vars.items() if k in RESUME_VARS and v is not None}
    overrides = given_vars.get("ddp_job_train_overrides") or {}
    given.update(overrides if isinstance(overrides, dict) else {})
    names = {key: var for var, key in RESUME_VARS.items() if key not in overrides}
    names.update({key: f"ddp_job_train_overrides.{key}" for key in overrides if isinstance(overrides, dict)})
    plans, unreadable = {}, []
    for host in out["holders"]:
        text = str((nodes[host] or {}).get("run_json") or "")
        try:
            recorded = json.loads(text) if text.strip() else None
            plans[host] = None if recorded is None else ddplab_config.resume_plan(
                run_id, recorded, given, out["step"], names)
        except (ValueError, TypeError, ddplab_config.ConfigError) as exc:
            unreadable.append(f"{host} ({exc})")
    found = {h: p for h, p in plans.items() if p is not None}
    if unreadable:
        out["problems"].append(
            f"run {run_id}: the run's settings cannot be read on {', '.join(unreadable)}; fix: restore its"
            f" runs/{run_id}/run.json from the controller's runs/{run_id}/<laptop>/run.json")
        return out
    if not found:
        out["warnings"].append(
            f"run {run_id}: no trainer holding its checkpoints has its run.json; the resume trains with the"
            " settings given now (give the run's max_steps, preset, engine and overrides again)")
        return out
    distinct = {json.dumps(p.settings, sort_keys=True, default=str) for p in found.values()}
    if len(distinct) > 1:
        out["problems"].append(
            f"run {run_id}: the trainers hold different settings for it in runs/{run_id}/run.json"
            f" ({_first_difference(found)});"
            " fix: copy one laptop's run.json to the others, or give the settings explicitly")
        return out
    plan = found[sorted(found)[0]]
    out["problems"] += plan.conflicts
    out["settings"], out["changes"] = plan.settings, plan.changes
    out["engine"] = plan.settings.get("fault_tolerance", given.get("fault_tolerance"))
    return out


def route_info(stdout: str) -> dict:
    """``{dev, src}`` of one line of ``ip -4 -o route get ADDR`` (None where missing)."""
    found = {key: re.search(rf"\b{key}\s+(\S+)", stdout or "") for key in ("dev", "src")}
    return {key: m.group(1) if m else None for key, m in found.items()}


def lock_holders(proc_locks: str, files: list) -> list[dict]:
    """``[{path, pid}]`` of the processes that hold a lock on one of ``files`` (``find`` results:
    ``path``, ``dev``, ``inode``), from ``/proc/locks`` (``1: POSIX  ADVISORY  WRITE 812 08:02:1311 0
    EOF``: pid, major:minor in hex, inode; ``->`` lines are waiters)."""
    wanted = {(os.major(int(f["dev"])), os.minor(int(f["dev"])), int(f["inode"])): f["path"]
              for f in files or []}
    holders = []
    for line in (proc_locks or "").splitlines():
        fields = line.split()
        if len(fields) < 6 or "->" in fields[:2]:
            continue
        match = re.fullmatch(r"([0-9a-f]+):([0-9a-f]+):(\d+)", fields[5])
        if not match or not fields[4].isdigit():
            continue
        key = (int(match.group(1), 16), int(match.group(2), 16), int(match.group(3)))
        if key in wanted:
            holders.append({"path": wanted[key], "pid": int(fields[4])})
    return holders


def clock_offset(date_time: dict, before: float, after: float) -> dict:
    """A node's clock (``date_time``: its ``ansible_date_time`` fact) against the controller's epoch
    seconds ``before`` and ``after`` it was read: ``{offset_s, uncertainty_s, beyond_s}``, the
    offset from the middle of that interval (+ = node ahead), half the interval, and how far outside
    the interval the node's time lies (0 when inside)."""
    stamp = datetime.strptime(date_time["iso8601_micro"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
    node = stamp.timestamp()
    before, after = float(before), float(after)
    beyond = max(node - after, before - node, 0.0)
    return {"offset_s": round(node - (before + after) / 2, 3),
            "uncertainty_s": round((after - before) / 2, 3), "beyond_s": round(beyond, 3)}


def unit_environment(props: dict[str, str]) -> dict[str, str]:
    """The unit's ``Environment`` property (space-separated ``KEY=VALUE`` words) as a dict."""
    words = shlex.split(props.get("Environment", "") or "")
    return {key: value for key, _, value in (word.partition("=") for word in words)}


def interface_addresses(stdout: str) -> list[dict]:
    """Addresses of ``ip -o addr show dev IF`` in the kernel's order: ``[{family, address, label}]``
    (``family`` inet | inet6; ``label`` the IPv4 address's label, ``eth0:1``, for IPv6 the interface)."""
    found = []
    for line in (stdout or "").splitlines():
        head = line.split("\\", 1)[0].split()
        if len(head) < 4 or head[2] not in ("inet", "inet6"):
            continue
        found.append({"family": head[2], "address": head[3].split("/", 1)[0],
                      "label": head[-1] if head[2] == "inet" else head[1]})
    return found


def gloo_ifname_address(addresses: list[dict], ifname: str) -> str | None:
    """The address gloo binds for ``GLOO_SOCKET_IFNAME=ifname``: the first ``getifaddrs`` entry
    named ``ifname``, IPv4 first (a labelled IPv4 address does not match); None without one."""
    return next((e["address"] for family in ("inet", "inet6") for e in addresses
                 if e["family"] == family and e["label"] == ifname), None)


def unit_launch(show: str) -> dict:
    """What the node's last agent launch passed, from ``systemctl show UNIT -p
    LoadState,ExecStart,Environment`` (``ExecStart`` read by ``ddplab.units``): ``{loaded, local_addr,
    rdzv_endpoint, gloo_socket_ifname}``, None where not passed."""
    props = ddplab_units.show_props(show)
    argv = ddplab_units.exec_start_argv(props.get("ExecStart", ""))
    env = unit_environment(props)
    return {"loaded": props.get("LoadState") == "loaded" and bool(argv),
            "local_addr": ddplab_units.option_value(argv, "--local-addr"),
            "rdzv_endpoint": ddplab_units.option_value(argv, "--rdzv-endpoint"),
            "gloo_socket_ifname": env.get("GLOO_SOCKET_IFNAME")}


def proc_cmdline(content: str) -> str:
    """A process's command line from the base64 ``slurp`` of ``/proc/PID/cmdline`` (NUL-separated),
    as one line; "" when empty."""
    raw = base64.b64decode(content or "")
    return " ".join(part.decode(errors="replace") for part in raw.split(b"\0") if part)


def proc_ppid(stat: str) -> int:
    """The parent pid from the text of ``/proc/PID/stat`` (the field after the state, which
    follows the parenthesised command name)."""
    return int(stat.rsplit(")", 1)[1].split()[1])


def check_table(results: list, title: str) -> str:
    """The doctor's table of one node: ``check | status | detail`` (statuses upper-case) under
    ``== title ==``, drawn by ``rich`` (plain text, no colour codes; details never wrapped)."""
    table = Table(box=box.MARKDOWN, show_edge=False, pad_edge=False)
    for column in ("check", "status", "detail"):
        table.add_column(column, no_wrap=True, overflow="ignore")
    for r in results or []:
        detail = " ".join(str(r.get("detail", "")).split())
        table.add_row(Text(str(r.get("check", ""))), Text(str(r.get("status", "")).upper()), Text(detail))
    console = Console(file=io.StringIO(), width=100000, color_system=None, force_terminal=False)
    console.print(table)
    return "\n".join([f"== {title} =="] + [line.rstrip() for line in console.file.getvalue().splitlines()])


def path_chain(path: str) -> list[str]:
    """``/var/lib/ddp-lab`` -> ``["/var/lib/ddp-lab", "/var/lib", "/var", "/"]`` (absolute paths)."""
    return [str(p) for p in (Path(str(path)), *Path(str(path)).parents)]


# The role's rules for its own settings (module_utils/settings.py).
SETTINGS = [{"name": "validate_clock_max_skew_s", "above": 0},
            {"name": "validate_min_free_disk_mb", "min": 0},
            {"name": "validate_dpkg_lock_wait_s", "min": 0},
            {"name": "validate_dpkg_lock_poll_s", "above": 0},
            {"name": "validate_port_timeout_s", "above": 0}]


class FilterModule:
    """Ansible filter plugin entry point."""

    def filters(self) -> dict:
        return {
            "connection_targets": connection_targets,
            "validate_is_ipv4": is_ipv4,
            "validate_route": route_info,
            "validate_lock_holders": lock_holders,
            "validate_clock": clock_offset,
            "validate_table": check_table,
            "validate_proc_cmdline": proc_cmdline,
            "validate_proc_ppid": proc_ppid,
            "validate_path_chain": path_chain,
            "validate_resume_plan": resume_plan,
        }
