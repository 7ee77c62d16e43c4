"""Action plugin ``validate_check``: checks of the validate role in Python, each one check record.

A record is ``{check, status, detail}``: ``status`` is ok | warn | fail | skip, ``detail`` one line
(for a problem: ``<host>: <cause>; fix: <what to do>``). Checks (``check:``, each with its own
``args:``):

- ``rdzv_conf``: ``conf`` (torchrun ``--rdzv-conf`` besides is_host), ``keys`` (those torch reads);
- ``nnodes``: ``min``, ``max`` (torchrun ``--nnodes MIN:MAX``), ``trainers`` (how many exist);
- ``versions``: ``pin`` (python_env_torch_version; '' none), ``prefix`` (the venv), ``provision``
  (this run provisions: a difference is a warning), ``key`` (the host var holding each host's
  ``{python, torch, ...}`` read in its venv, None without one; default ``__validate_versions``):
  every play host's is compared;
- ``disk``: ``df`` (``df -P -B1`` of the path and its parents), ``path`` (where checkpoints go),
  ``min_free_mb``;
- ``reach``: ``what`` (store | lighthouse), ``address``, ``port``, ``timeout_s``: a TCP connection
  from the node (``ansible.builtin.wait_for`` run there);
- ``route``: ``target``, ``rc``/``stderr``/``dev``/``src`` of ``ip route get`` on the node;
- ``clock``: ``measured`` (filter ``validate_clock``), ``max_skew_s``;
- ``interface``: ``ifname`` (wired_network_ifname), ``facts`` (network facts), ``route_dev``,
  ``address`` (wired_network_address or None);
- ``port``: the rendezvous host's port for the store or the lighthouse (:func:`port`), from what
  ``tasks/port.yml`` read there; its record also says ``up`` (this inventory's service runs).

The tasks add ``records`` to the host's ``__validate_results``, which ``tasks/verdict.yml`` reports.
Used by the validate play (tasks/main.yml, tasks/node.yml) and, through tasks/job.yml, by
ddp_job's preflight, so each check exists once.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase

_FILTERS = Path(__file__).resolve().parents[1] / "filter_plugins" / "validate.py"
_spec = importlib.util.spec_from_file_location("ddp_lab_validate_filters", _FILTERS)
_filters = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_filters)

PROVISION_FIX = "ansible-playbook site.yml --tags provision"


def record(check: str, problem: str | None, ok_detail: str, status: str = "fail") -> dict:
    """``{check, status, detail}``: ``status`` with ``problem`` as detail, else ok with ``ok_detail``."""
    return {"check": check, "status": status if problem else "ok", "detail": problem or ok_detail}


def _positive(value: Any) -> bool:
    try:
        return float(value) > 0
    except (TypeError, ValueError):
        return False


def rdzv_conf(host: str, conf: Any, keys: Sequence[str]) -> dict:
    """torchrun's ``--rdzv-conf``: only keys torch reads, every value a positive number (s or count).
    ok detail: the argument as passed (``k=v,...``)."""
    good = isinstance(conf, Mapping) and not set(conf) - set(keys) and all(map(_positive, conf.values()))
    problem = None if good else (
        f"{host}: ddp_job_rdzv_conf {conf} has unknown keys or values that are not > 0; fix: use keys among "
        f"{', '.join(keys)} with positive numbers (seconds or counts)")
    return record("rdzv_conf", problem, ",".join(f"{k}={v}" for k, v in (conf or {}).items()) if good else "")


def nnodes(host: str, nmin: Any, nmax: Any, trainers: int) -> dict:
    """torchrun's elastic range ``--nnodes MIN:MAX``: 1 <= MIN <= MAX <= the trainers that exist."""
    lo, hi = int(nmin), int(nmax)
    if lo < 1:
        problem = (f"{host}: ddp_job_nnodes_min={nmin} must be at least 1; fix: set ddp_job_nnodes_min"
                   " to the fewest nodes the job may continue with (1 by default)")
    elif lo > hi:
        problem = (f"{host}: ddp_job_nnodes_min={nmin} is larger than ddp_job_nnodes_max={nmax} "
                   "(torchrun --nnodes MIN:MAX); fix: set MIN <= MAX")
    elif hi > int(trainers):
        problem = (f"{host}: ddp_job_nnodes_max={nmax} but the inventory has {trainers} trainer(s):"
                   " MAX counts nodes that exist;"
                   f" fix: set ddp_job_nnodes_max to at most {trainers} (the default)")
    else:
        problem = None
    return record("nnodes", problem, f"--nnodes {nmin}:{nmax} with {trainers} trainer(s)")


def versions(host: str, everyone: Mapping[str, Any], pin: str, prefix: str, provision: bool) -> dict:
    """The same Python and torch on every trainer (mismatches hang silently in the first collective;
    pytorch #174917) and torch as pinned (``pin`` '': not compared). ``everyone``:
    ``{host: {python, torch} | None}``."""
    mine = everyone.get(host)
    pin = str(pin)
    if mine is None:
        if provision:
            detail = f"not provisioned yet (no training venv): the provisioning installs torch {pin}"
            return {"check": "versions", "status": "skip", "detail": detail}
        problem = f"{host}: no training venv ({prefix}); fix: provision it ({PROVISION_FIX})"
        return record("versions", problem, "")
    known = {h: json.dumps(v, sort_keys=True) for h, v in everyone.items() if v is not None}
    odd = _filters.odd_ones(known)
    if host in odd["odd"]:
        ref = json.loads(odd["reference"])
        others = ", ".join(h for h in known if h not in odd["odd"])
        fix = (f"the provisioning of this run reinstalls torch {pin}" if provision else
               f"fix: re-run the provisioning ({PROVISION_FIX}) so that every node has the same torch")
        problem = (f"{host}: Python {mine['python']} / torch {mine['torch']} here,"
                   f" but Python {ref['python']} / torch {ref['torch']} on {others}:"
                   f" mismatched versions hang silently in the first collective; {fix}")
        return record("versions", problem, "", "warn" if provision else "fail")
    if pin and str(mine["torch"]).split("+")[0] != pin.split("+")[0]:
        fix = (f"the provisioning of this run installs {pin}" if provision else
               f"fix: provision ({PROVISION_FIX}) or set python_env_torch_version to the installed version")
        problem = f"{host}: torch {mine['torch']} is installed, python_env_torch_version is {pin}; {fix}"
        return record("versions", problem, "", "warn")
    return record("versions", None, f"Python {mine['python']}, torch {mine['torch']} (same on every trainer)")


def _python_torch(found: Any) -> dict | None:
    """``{python, torch}`` of what a host's venv probe found (other keys, e.g. cores, left out)."""
    return {"python": found["python"], "torch": found["torch"]} if isinstance(found, Mapping) else None


def route(host: str, target: str, rc: int, stderr: str, dev: Any, src: Any) -> dict:
    """The node's route to the rendezvous address (``ip route get``: ``rc``, ``stderr``, and the
    ``dev``/``src`` it names): there must be one, and not over loopback."""
    if rc != 0:
        why = (stderr or "").strip()
        problem = (f"{host} has no route to the rendezvous host {target or '(no address)'} ({why});"
                   " fix: plug in the cable and check rendezvous_address"
                   " (an IPv4 address on the laptops' wired LAN)")
    elif dev == "lo" or _filters.is_loopback(src):
        problem = (f"{host} reaches the rendezvous address {target} over loopback ({dev}, source {src}):"
                   " it holds that address itself, so gloo and the store would talk over loopback;"
                   " fix: keep the rendezvous host off the trainers (the controller is the default)")
    else:
        problem = None
    return record("route", problem,
                  f"to {target} via {dev} from {src} (GLOO_SOCKET_IFNAME; --local-addr, DDPLAB_GLOO_ADDR)")


def clock(host: str, measured: Mapping[str, Any], max_skew_s: Any) -> dict:
    """The node's clock against the controller's (``measured``: ``validate_clock``'s ``offset_s``,
    ``uncertainty_s``, ``beyond_s``): at most ``max_skew_s`` beyond the reading's uncertainty."""
    offset = float(measured["offset_s"])
    problem = None if float(measured["beyond_s"]) <= float(max_skew_s) else (
        f"{host}: its clock is {abs(offset):.1f} s {'ahead of' if offset > 0 else 'behind'} the controller's"
        f" (more than validate_clock_max_skew_s={max_skew_s}), which falsifies the timings ddp-lab measures"
        " across nodes; fix: turn on time sync on every node and the controller"
        " (sudo timedatectl set-ntp true)")
    ok = f"offset {offset:+.3f} s (+/- {measured['uncertainty_s']} s) from the controller"
    return record("clock", problem, ok)


def interface(host: str, ifname: str, facts: Mapping[str, Any], route_dev: Any, address: Any) -> dict:
    """``wired_network_ifname`` set in the inventory: an interface of the node (not a pattern, not
    lo) whose IPv4 address is ``wired_network_address`` when that is set too (``address``; None
    unset). ``facts``: the node's ``ansible_facts`` with the network subset."""
    ifaces = sorted(facts.get("interfaces") or [])
    key = re.sub(r"[^A-Za-z0-9_]", "_", ifname)
    if_addr = ((facts.get(key) or {}).get("ipv4") or {}).get("address", "") if ifname in ifaces else ""
    if ifname not in ifaces:
        pattern = (": GLOO_SOCKET_IFNAME takes interface names, not patterns like ^lo or eth*"
                   if re.search(r"[\^*?,!\[ ]", ifname) else "")
        problem = (f"{host}: wired_network_ifname '{ifname}' is not an interface of this node"
                   f" (it has {', '.join(ifaces)}){pattern}; fix: set it to the wired interface"
                   f" ({route_dev} routes to the rendezvous host) or remove it so that ddp-lab finds it")
    elif ifname == "lo":
        problem = (f"{host}: wired_network_ifname is lo, the loopback interface: gloo would talk to itself"
                   f" only; fix: set it to the wired interface ({route_dev}) or remove it")
    elif address is not None and address != if_addr:
        problem = (f"{host}: wired_network_address {address} is not the address of {ifname}"
                   f" ({if_addr or 'none'}); fix: set both to the wired interface and its address,"
                   " or remove both so that ddp-lab finds them")
    else:
        problem = None
    return record("interface", problem, f"wired_network_ifname {ifname} exists ({if_addr or 'no IPv4'})")


def df_avail(stdout: str) -> dict:
    """``{avail_mb, mount}`` of the first filesystem in ``df -P -B1 PATH...`` output (``avail_mb`` in
    MiB, float). Raises ValueError when no filesystem line is present."""
    for line in (stdout or "").splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 6 and parts[3].isdigit():
            return {"avail_mb": int(parts[3]) / 2**20, "mount": " ".join(parts[5:])}
    raise ValueError(f"no filesystem in df output: {stdout!r}")


def disk(host: str, df_stdout: str, path: str, min_free_mb: float) -> dict:
    """Free space (MiB) on the filesystem that holds ``path`` (checkpoints) against ``min_free_mb``.

    ``df_stdout``: ``df -P -B1`` of ``path`` and its parents (the first that exists answers). Not
    ``ansible_facts.mounts``: it leaves out mounts whose device is no path, such as the overlay
    root of a container, so a lab node would have no mount for the path."""
    found = df_avail(df_stdout)
    avail, mount = found["avail_mb"], found["mount"]
    problem = None if avail >= float(min_free_mb) else (
        f"{host}: only {int(avail)} MiB free on {mount}, where the checkpoints go ({path}), below "
        f"validate_min_free_disk_mb={min_free_mb};"
        " fix: free space there or set ddp_lab_base_dir to a folder on a larger disk")
    return record("disk", problem, f"{int(avail)} MiB free on {mount} for {path}")


REACH = {
    "store": ("store_reach", "the rendezvous store", "the store",
              "(ufw: the firewall role does it) and check rendezvous_address"),
    "lighthouse": ("lighthouse_reach", "the torchft lighthouse", "the lighthouse",
                   "(ufw: the firewall role does it) and check that the rendezvous play ran with "
                   "ddp_job_fault_tolerance=per_step (set it for all hosts)"),
}


def reach(host: str, what: str, address: str, port: Any, timeout_s: Any, error: str | None) -> dict:
    """A TCP connection from ``host`` to ``address:port`` (``error``: why it failed, None: it worked)."""
    check, name, short, more = REACH[what]
    endpoint = f"{address}:{port}"
    problem = None if error is None else (
        f"{host} cannot reach {name} at {endpoint} within {timeout_s} s ({error.strip()});"
        f" fix: allow TCP {port} from the trainers' subnet in the rendezvous host's firewall {more}")
    return record(check, problem, f"reaches {short} at {endpoint}")


PORTS = {
    # what: (check, setting, service, module)
    "store": ("rendezvous_port", "rendezvous_port", "rendezvous store", "ddplab.controller.rdzv_store"),
    "lighthouse": ("lighthouse_port", "rendezvous_lighthouse_port", "torchft lighthouse",
                   "ddplab.controller.lighthouse"),
}


def port(what: str, host: str, address: str, number: Any, rc: int, state: Mapping[str, Any], stderr: str,
         held: Sequence[str], holder: str, parent: str, state_dir: str) -> dict:
    """The rendezvous host's port for the store (or the torchft lighthouse): free, or held by this
    inventory's running service. ``rc``: exit code of ``python -m <module> status`` (-1: not run, the
    setting is no port number; 0 running and answering, 1 running but not answering, 3 not running),
    ``state`` its JSON; ``held``: addresses where something else accepts connections on the port;
    ``holder``/``parent``: command lines of the holder and its parent process. Returns the record
    plus ``up`` (this inventory's service runs there: the trainers' reach is checked then)."""
    check, setting, service, module = PORTS[what]
    kind = service.split()[-1]
    where = f"{host}: TCP port {number}"
    holder_dir = (parent.split("--state-dir ", 1)[1].split()[0] if "--state-dir " in parent else "")
    problem = None
    if rc == -1:
        problem = (f"{where}: {setting} is not a TCP port number; fix: set {setting} to a free port in"
                   " 1024-65535 (its default: roles/ddp_lab/defaults/main.yml)")
    elif rc == 0 and state.get("host", "") != address:
        problem = (f"{where} is held by a ddp-lab {kind} serving {state.get('host')} (another inventory's"
                   f" job, pid {state.get('supervisor_pid', '?')}), so this job's {kind} cannot start;"
                   " fix: stop it (ansible-playbook -i <that inventory> stop.yml)"
                   f" or set {setting} to another free port")
    elif rc == 1:
        problem = (f"{where}: the ddp-lab {kind} supervisor runs (pid {state.get('supervisor_pid', '?')})"
                   f" but the {kind} does not answer at {address}; fix: ansible-playbook stop.yml, then run"
                   f" again ({kind} log: {state.get('log', state_dir)})")
    elif rc == 3 and held:
        if module in holder:
            folder = holder_dir or "<its state folder>"
            problem = (f"{where} is held by a ddp-lab {kind} this checkout does not manage ({holder};"
                       f" state folder {holder_dir or 'unknown'}), e.g. one started from another checkout;"
                       f" fix: stop it (python -m {module} stop --port {number} --state-dir {folder})"
                       f" or set {setting} to another free port")
        else:
            problem = (f"{where} is in use by another program (it accepts connections at {held[0]}"
                       f"{('; ' + holder) if holder else ''}), so the {service} cannot listen there;"
                       f" fix: stop that program or set {setting} to a free port")
    elif rc not in (0, 3):
        lines = (stderr or "").splitlines()
        why = state.get("error") or (lines[-1] if lines else f"exit code {rc}")
        problem = (f"{host}: cannot read the {service}'s state: {why}; fix: check rendezvous_python"
                   " (it needs torch and psutil) and rendezvous_state_dir")
    ok = (f"{kind} running (supervisor pid {state.get('supervisor_pid', '?')}) at {address}:{number};"
          " every trainer must reach it (checked on each)" if rc == 0 else
          f"port {number} free on {host}; the {kind} starts with the job")
    rec = record(check, problem, ok)
    rec["up"] = rc == 0 and state.get("host", "") == address
    return rec


class ActionModule(ActionBase):
    """Run the checks given (``checks``: a list of ``{check, args, skip}``; see the module docstring)
    and return their records (``records``), in order; a check with ``skip: true`` is left out."""

    def _one(self, check: str, args: Mapping[str, Any], task_vars: dict) -> dict | None:
        host = task_vars.get("inventory_hostname", "?")
        if check == "rdzv_conf":
            return rdzv_conf(host, args.get("conf"), args.get("keys") or [])
        if check == "nnodes":
            return nnodes(host, args["min"], args["max"], int(args["trainers"]))
        if check == "versions":
            hv, key = task_vars["hostvars"], args.get("key") or "__validate_versions"
            everyone = {h: _python_torch(hv[h].get(key)) for h in task_vars.get("ansible_play_hosts", [])}
            return versions(host, everyone, args["pin"], args.get("prefix", ""), bool(args.get("provision")))
        if check == "disk":
            return disk(host, args.get("df") or "", args["path"], args["min_free_mb"])
        if check == "reach":
            res = self._execute_module(
                module_name="ansible.builtin.wait_for", task_vars=task_vars,
                module_args={"host": args["address"], "port": int(args["port"]),
                             "timeout": int(float(args["timeout_s"]))})
            if res.get("unreachable"):
                return None
            error = (res.get("msg") or "failed") if res.get("failed") else None
            return reach(host, args["what"], args["address"], args["port"], args["timeout_s"], error)
        if check == "route":
            return route(host, args.get("target") or "", int(args.get("rc", -1)), args.get("stderr") or "",
                         args.get("dev"), args.get("src"))
        if check == "clock":
            return clock(host, args["measured"], args["max_skew_s"])
        if check == "interface":
            return interface(host, str(args["ifname"]), args.get("facts") or {}, args.get("route_dev"),
                             args.get("address"))
        if check == "port":
            return port(args["what"], args["host"], args["address"], args["port"], int(args["rc"]),
                        args.get("state") or {}, args.get("stderr") or "", args.get("held") or [],
                        args.get("holder") or "", args.get("parent") or "", args.get("state_dir") or "")
        raise AnsibleActionFail(f"validate_check: unknown check {check!r}")

    def run(self, tmp=None, task_vars=None):
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        records = []
        for item in self._task.args.get("checks") or []:
            if item.get("skip"):
                continue
            check = item.get("check")
            try:
                rec = self._one(check, item.get("args") or {}, task_vars)
            except (KeyError, TypeError, ValueError) as exc:
                raise AnsibleActionFail(f"validate_check {check}: bad arguments ({exc})") from exc
            if rec is None:
                result.update({"unreachable": True, "msg": "the node cannot be reached"})
                return result
            records.append(rec)
        result.update({"changed": False, "records": records})
        return result
