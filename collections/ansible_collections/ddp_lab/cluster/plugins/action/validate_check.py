"""Action plugin ``validate_check``: every check only the validate role can make, each a record
``{check, status, detail}`` (``status`` ok | warn | fail | skip; ``detail`` one line, for a
problem ``<host>: <cause>; fix: <what to do>``).

Option ``checks``: a list of ``{check, args, skip}``; returns ``records`` in order (a check with
``skip: true`` left out), or ``unreachable`` when a check needs the node and it does not answer.
Each check is the function of this module named like it, called ``check(host, **args)`` (see its
docstring), except:

- ``versions``: ``pins``, ``prefix``, ``provision`` and ``key`` (the host var holding each host's
  venv probe, default ``__validate_versions``): every play host's venv compared (:func:`versions`);
- ``unique_address`` / ``unique_name``: ``key`` (default ``__validate_address`` /
  ``__validate_hostname``), compared across the play's hosts;
- ``reach``: ``what`` (store | lighthouse), ``address``, ``port``, ``timeout_s``: a TCP connection
  from the node (``ansible.builtin.wait_for`` run there);
- ``become`` (no args; its task runs with ``become: true``): a module run with become, no prompt.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from ansible.errors import AnsibleActionFail, AnsibleConnectionFailure, AnsibleError
from ansible.module_utils.parsing.convert_bool import boolean
from ansible.plugins.action import ActionBase
from ansible_collections.ddp_lab.cluster.plugins.filter import validate as _filters
from ansible_collections.ddp_lab.cluster.plugins.module_utils import interfaces as _interfaces
from ansible_collections.ddp_lab.cluster.plugins.module_utils.become import become_problem
from ansible_collections.ddp_lab.cluster.plugins.module_utils.hostvars import odd_ones
from ansible_collections.ddp_lab.cluster.plugins.module_utils.settings import record
from ansible_collections.ddp_lab.cluster.plugins.module_utils.ssh import host_key_changed
from ddplab.runstate import stopped_at
from ddplab.units import show_props

PROVISION_FIX = "ansible-playbook site.yml --tags provision"


def _base(version: Any) -> str:
    """A version without its local part (``2.13.0+cpu`` -> ``2.13.0``): the CPU build is the pin."""
    return str(version).split("+", 1)[0]


def venv_versions(found: Any) -> dict | None:
    """``{python, <package>: version}`` of a venv probe, ``{python, packages: {name: version}}`` or
    already flat; names normalised as pip does (lower case, ``_`` -> ``-``). None for no venv."""
    if not isinstance(found, Mapping):
        return None
    packages = found.get("packages") if isinstance(found.get("packages"), Mapping) else {
        k: v for k, v in found.items() if k not in ("python", "cores")}
    out = {str(k).lower().replace("_", "-"): v for k, v in packages.items()}
    return {**out, "python": found.get("python")}


def versions(host: str, everyone: Mapping[str, Any], pins: Mapping[str, Any], prefix: str,
             provision: bool) -> dict:
    """The same Python and pinned packages in every trainer's venv, each as pinned (mismatches hang
    in the first collective: pytorch #174917). ``everyone``: ``{host: venv_versions(probe) | None}``;
    ``pins``: ``{package: version}`` ('' or None: not compared). A difference fails, or warns when
    this run ``provision``s (which reinstalls them)."""
    mine = everyone.get(host)
    pins = {str(n).lower().replace("_", "-"): "" if v is None else str(v) for n, v in pins.items()}
    names = list(pins)
    if mine is None:
        if provision:
            detail = ("not provisioned yet (no training venv): the provisioning installs "
                      + ", ".join(f"{n} {v}" for n, v in pins.items()))
            return record("versions", detail, "", "skip")
        problem = f"{host}: no training venv ({prefix}); fix: provision it ({PROVISION_FIX})"
        return record("versions", problem, "")
    fix_all = (f"fix: re-run the provisioning ({PROVISION_FIX} --limit {host}) so that every node has the"
               " pinned packages")
    known = {h: json.dumps({k: (_base(v) if k in names else v) for k, v in sorted(e.items())
                            if k == "python" or k in names}) for h, e in everyone.items() if e is not None}
    odd = odd_ones(known)
    if host in odd["odd"]:
        alike = [h for h in known if h not in odd["odd"]]
        ref, others = everyone[alike[0]] if alike else json.loads(odd["reference"]), ", ".join(alike)
        differ = [k for k in ["python", *names] if _base(mine.get(k)) != _base(ref.get(k))]
        what = "; ".join(f"{'Python' if k == 'python' else k} {mine.get(k) or 'not installed'} here,"
                         f" {ref.get(k) or 'not installed'} on {others}" for k in differ)
        fix = "the provisioning of this run reinstalls them" if provision else fix_all
        problem = (f"{host}: {what} ({prefix}): mismatched versions hang silently in the first"
                   f" collective; {fix}")
        return record("versions", problem, "", "warn" if provision else "fail")
    wrong = [(n, mine.get(n), v) for n, v in pins.items() if str(v) and _base(mine.get(n)) != _base(v)]
    if wrong:
        what = ", ".join(f"{n} {got or 'not installed'} (pinned {want})" for n, got, want in wrong)
        fix = ("the provisioning of this run installs the pins" if provision else
               f"fix: provision ({PROVISION_FIX}), or set the pin (python_env_<package>_version) to the"
               " installed version on every host")
        problem = f"{host}: {what} in {prefix}; {fix}"
        return record("versions", problem, "", "warn" if provision else "fail")
    env = [f"Python {mine.get('python', '?')}",
           *(f"{n} {'-' if mine.get(n) is None else mine[n]}" for n in names)]
    return record("versions", None, f"{', '.join(env)} (same on every trainer, as pinned)")


def route(host: str, target: str = "", rc: Any = -1, stderr: str = "", dev: Any = None,
          src: Any = None) -> dict:
    """The node's route to the rendezvous address (``ip route get``: ``rc``, ``stderr``, and the
    ``dev``/``src`` it names): there must be one, and not over loopback."""
    if int(rc) != 0:
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
    """The node's clock at most ``max_skew_s`` beyond the reading's uncertainty from the
    controller's (``measured``: filter ``validate_clock``)."""
    offset = float(measured["offset_s"])
    problem = None if float(measured["beyond_s"]) <= float(max_skew_s) else (
        f"{host}: its clock is {abs(offset):.1f} s {'ahead of' if offset > 0 else 'behind'} the controller's"
        f" (more than validate_clock_max_skew_s={max_skew_s}), which falsifies the timings ddp-lab measures"
        " across nodes; fix: turn on time sync on every node and the controller"
        " (sudo timedatectl set-ntp true)")
    ok = f"offset {offset:+.3f} s (+/- {measured['uncertainty_s']} s) from the controller"
    return record("clock", problem, ok)


def interface(host: str, ifname: Any, facts: Mapping[str, Any], route_dev: Any = None,
              address: Any = None) -> dict:
    """``wired_network_ifname``: an interface of the node (``facts``: its ``ansible_facts`` with the
    network subset), not a pattern, not lo, holding ``address`` (``wired_network_address``) if set."""
    ifname, ifaces = str(ifname), sorted((facts or {}).get("interfaces") or [])
    listed = _interfaces.interface_list_name(ifname) in ifaces
    key = _interfaces.interface_fact_name(ifname)
    if_addr = ((facts.get(key) or {}).get("ipv4") or {}).get("address", "") if listed else ""
    if not listed:
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


def disk(host: str, df: str, path: str, min_free_mb: float) -> dict:
    """Free space (MiB) on the filesystem that holds ``path`` (checkpoints) against ``min_free_mb``;
    ``df``: ``df -P -B1`` of ``path`` and its parents (the first that exists answers)."""
    found = df_avail(df)
    avail, mount = found["avail_mb"], found["mount"]
    problem = None if avail >= float(min_free_mb) else (
        f"{host}: only {int(avail)} MiB free on {mount}, where the checkpoints go ({path}), below "
        f"validate_min_free_disk_mb={min_free_mb};"
        " fix: free space there or set ddp_lab_base_dir to a folder on a larger disk")
    return record("disk", problem, f"{int(avail)} MiB free on {mount} for {path}")


# what -> the end of the fix of check ``<what>_reach`` (the service's name: :data:`PORTS`)
REACH = {
    "store": "(ufw: the firewall role does it) and check rendezvous_address",
    "lighthouse": ("(ufw: the firewall role does it) and check that the rendezvous play ran with "
                   "ddp_job_fault_tolerance=per_step or diloco (set it for all hosts)"),
}


def reach(host: str, what: str, address: str, port: Any, timeout_s: Any, error: str | None) -> dict:
    """A TCP connection from ``host`` to ``address:port`` (``error``: why it failed, None: it worked)."""
    service, endpoint = PORTS[what][2], f"{address}:{port}"
    problem = None if error is None else (
        f"{host} cannot reach the {service} at {endpoint} within {timeout_s} s ({error.strip()});"
        f" fix: allow TCP {port} from the trainers' subnet in the rendezvous host's firewall {REACH[what]}")
    return record(f"{what}_reach", problem, f"reaches the {what} at {endpoint}")


PORTS = {
    # what: (check, setting, service, module)
    "store": ("rendezvous_port", "rendezvous_port", "rendezvous store", "ddplab.controller.rdzv_store"),
    "lighthouse": ("lighthouse_port", "rendezvous_lighthouse_port", "torchft lighthouse",
                   "ddplab.controller.lighthouse"),
}


def port(_host: str, what: str, rendezvous_host: str, address: str, port: Any, rc: Any,
         state: Mapping[str, Any] | None = None, stderr: str = "", held: Sequence[str] = (), holder: str = "",
         parent: str = "", state_dir: str = "") -> dict:
    """The rendezvous host's ``port`` for the store or the lighthouse (``what``): free, or held by
    this inventory's running service. ``rc``: exit code of ``python -m <module> status`` (-1: not
    run, no port number; 0 answering, 1 not answering, 3 not running), ``state`` its JSON; ``held``:
    addresses where something else accepts connections on the port; ``holder`` / ``parent``: the
    command lines of the holder and its parent. Returns the record plus ``up`` (this inventory's
    service runs there)."""
    check, setting, service, module = PORTS[what]
    kind, host, number, rc, state = service.split()[-1], rendezvous_host, port, int(rc), state or {}
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


# ---- the inventory's shape (tasks/inventory.yml, on the controller) ------------------------------
LAPTOPS_EXAMPLE = "see inventory/laptops/hosts.yml"


def trainers(host: str, trainers: Sequence[str], group: str, sources: str) -> dict:
    """At least one host in the trainers group (``sources``: the inventory files, for the message)."""
    problem = None if trainers else (
        f"inventory {sources}: no host in the group '{group}'; fix: list the laptops under"
        f" all.children.{group}.hosts ({LAPTOPS_EXAMPLE})")
    return record("trainers", problem, f"{len(trainers)} trainer(s): {', '.join(trainers)}")


def rendezvous(host: str, hosts: Sequence[str], group: str, sources: str) -> dict:
    """Exactly one host in the rendezvous group (``hosts``)."""
    if len(hosts) == 1:
        return record("rendezvous", None, f"rendezvous host {hosts[0]}")
    found = f"{len(hosts)} rendezvous hosts ({', '.join(hosts)})" if hosts else "no rendezvous host"
    return record("rendezvous", (
        f"inventory {sources}: {found}; fix: put exactly one host in the group '{group}' with"
        " rendezvous_address set (the controller by default: ansible_connection: local,"
        f" {LAPTOPS_EXAMPLE})"), "")


def rendezvous_address(host: str, rendezvous_host: str, address: Any, targets: Mapping[str, str]) -> dict:
    """The rendezvous host's ``rendezvous_address``: an IPv4 address, not loopback, not a trainer's
    (``targets``: ``{trainer: ansible_host or name}``)."""
    address = "" if address is None else str(address)
    where = f"{rendezvous_host}: rendezvous_address"
    if not _filters.is_ipv4(address):
        problem = (f"{where} '{address}' is not an IPv4 address; fix: set it to the address the trainers"
                   " reach this host at on the wired LAN")
    elif _filters.is_loopback(address):
        problem = (f"{where} {address} is a loopback address: every trainer would dial itself instead of the"
                   " store; fix: set it to the controller's address on the laptops' wired LAN")
    elif address in targets.values():
        trainer = next(t for t, a in targets.items() if a == address)
        problem = (f"{where} {address} is the address of trainer {trainer}: the store would live on a laptop"
                   " whose loss ends the job; fix: use the controller's LAN address")
    else:
        problem = None
    return record("rendezvous_address", problem, f"{rendezvous_host} at {address}")


def unique_hosts(host: str, targets: Mapping[str, str]) -> dict:
    """Every trainer a different machine (``targets`` as in :func:`rendezvous_address`)."""
    shared = _filters.shared_values(dict(targets))
    problem = None if not shared else (
        f"{'; '.join(shared)} as ansible_host: one machine would run two agents;"
        " fix: give each trainer its own address (or remove the duplicate)")
    return record("unique_hosts", problem, "every trainer has its own ansible_host")


def unique_names(host: str, trainers: Sequence[str]) -> dict:
    """Trainer names that differ in more than letter case (they name folders: runs/<run_id>/<host>/)."""
    problem = None if len({t.lower() for t in trainers}) == len(trainers) else (
        f"trainers {', '.join(trainers)}: two names differ only in letter case, which collide in"
        " runs/<run_id>/<host>/; fix: rename one")
    return record("unique_names", problem, "trainer names are distinct")


# ---- the controller's dataset (tasks/controller.yml) ---------------------------------------------
SHA256 = re.compile(r"[0-9a-f]{64}")


def downloadable(url: Any) -> bool:
    """``url`` is one that get_url downloads from a server: http, https or ftp with a host."""
    parts = urlsplit(str(url or "").strip())
    return parts.scheme in ("http", "https", "ftp") and bool(parts.netloc)


def dataset(host: str, sha256: Any, src: str, cache: str, url: str, stat: Mapping[str, Any]) -> dict:
    """The dataset on the controller: ``src`` (''; the download cached at ``cache``) is a file with
    ``sha256`` (``stat``: its ``ansible.builtin.stat`` with sha256); a cache not filled yet is fine."""
    sha, src = str(sha256), str(src or "")
    path = src or cache
    exists, checksum = bool(stat.get("exists")), stat.get("checksum", "")
    if not SHA256.fullmatch(sha):
        problem = (f"controller: ddp_job_dataset_sha256 '{sha}' is not a sha256 (64 lowercase hex digits);"
                   " fix: set it to the dataset's checksum (sha256sum FILE)")
    elif src and not exists:
        problem = (f"controller: the dataset ddp_job_dataset_src={src} does not exist; fix: point"
                   f' ddp_job_dataset_src at a copy of the dataset (or set it to "" to download {url})')
    elif exists and not stat.get("isreg"):
        problem = (f"controller: the dataset {path} is not a file;"
                   " fix: point ddp_job_dataset_src at the dataset file")
    elif not src and not exists and not downloadable(url):
        what = "is empty" if not str(url or "").strip() else f"'{url}' is not an http, https or ftp URL"
        problem = (f"controller: ddp_job_dataset_url {what} and no copy of the dataset is given or cached;"
                   " fix: set it to the dataset's URL, or give a local copy: make demo"
                   " DATASET=/path/to/input.txt, or -e ddp_job_dataset_src=/path/to/input.txt")
    elif exists and checksum != sha:
        fix = ("point ddp_job_dataset_src at an intact copy" if src else
               "delete this cached copy to download it again")
        problem = (f"controller: the dataset {path} has sha256 {checksum}, expected {sha}"
                   f" (ddp_job_dataset_sha256); fix: {fix} (or set ddp_job_dataset_sha256 to the checksum"
                   " of the dataset you mean)")
    else:
        problem = None
    ok = (f"{path}: sha256 matches" if exists else
          f"not cached yet: the job downloads {url} and checks its sha256")
    return record("dataset", problem, ok)


# ---- on the node (tasks/node.yml) -----------------------------------------------------------------
def reachable(host: str, facts: Mapping[str, Any] | None, msg: str = "", lab: bool = False) -> dict:
    """The node answered the fact gathering (``facts``; None: it did not, ``msg`` says why;
    ``lab``: a lab node, for the fix of a changed host key)."""
    changed = host_key_changed(msg, lab) if facts is None else ""
    if changed:
        return record("reachable", f"{host}: {changed}", "")
    if facts is None:
        return record("reachable", (f"{host} does not answer ({(msg or '').strip()}); fix: power it on,"
                                    " plug it into the switch and check ansible_host / SSH access"), "")
    system = facts.get("distribution", facts.get("system", ""))
    return record("reachable", None, f"answers: {facts.get('hostname', '?')}, {system}")


def _launch_words(launch: Mapping[str, Any]) -> str:
    return (f"--local-addr {launch['local_addr']}, GLOO_SOCKET_IFNAME={launch['gloo_socket_ifname']},"
            f" --rdzv-endpoint {launch['rdzv_endpoint']}")


def hosts_file(host: str, hostname: str, addresses: Sequence[str], route: Mapping[str, Any], target: str,
               port: Any, unit_show: str) -> dict:
    """What the node's own hostname resolves to (``addresses``: getent hosts): loopback is a
    warning, naming the addresses the next launch passes (``route`` towards ``target``:``port``)
    and whether the last one (``unit_show``: ``systemctl show`` of the agent unit) passed them."""
    loop = _filters.loopbacks(list(addresses))
    if not loop:
        found = ", ".join(addresses) or "nothing (not needed: ddp-lab passes addresses)"
        return record("hosts_file", None, f"{hostname} resolves to {found}")
    launch = _filters.unit_launch(unit_show)
    nxt = {"local_addr": route.get("src"), "gloo_socket_ifname": route.get("dev"),
           "rdzv_endpoint": f"{target}:{port}"}
    if not (launch["loaded"] and launch["local_addr"]):
        seen = ""
    elif all(str(launch[k]) == str(v) for k, v in nxt.items()):
        seen = " (the last launch on this node passed the same)"
    else:  # say which differ: an older launch, another rendezvous address or port, a changed route
        seen = f" (the last launch on this node passed {_launch_words(launch)}: not these)"
    return record("hosts_file", (
        f"{host}: its hostname {hostname} resolves to {loop[0]} (loopback: the '127.0.1.1 <hostname>' line"
        " Ubuntu writes to /etc/hosts), so a program that finds its own address by name gets loopback."
        " ddp-lab does not rely on the name: every launch passes explicit addresses; the next one passes"
        f" torchrun --local-addr {nxt['local_addr']}, GLOO_SOCKET_IFNAME={nxt['gloo_socket_ifname']} and"
        f" --rdzv-endpoint {nxt['rdzv_endpoint']}{seen};"
        " nothing to fix (remove the line only if other tools need the name to resolve to the LAN address)"),
        "", "warn")


def _routable(address: Any) -> bool:
    return _filters.is_ipv4(address or "") and not _filters.is_loopback(address)


def launch(host: str, unit_show: str, run_id: str = "", stop: Mapping[str, Any] | None = None) -> dict:
    """The node's last agent launch (``unit_show``: ``systemctl show UNIT -p
    LoadState,ExecStart,Environment``) passed a routable --local-addr and --rdzv-endpoint host and a
    GLOO_SOCKET_IFNAME other than lo (a warning); skip without a launch. A node named by the stop
    event ``stop`` of run ``run_id`` says so (``stopped by stop.yml at T``)."""
    seen = _filters.unit_launch(unit_show)
    named = host in ((stop or {}).get("hosts") or [])
    stopped = f"the last run {run_id or '?'} was {stopped_at(stop)}" if named else ""
    if not seen["loaded"]:
        first = (f"{stopped} (its agent unit is gone)" if stopped else "no agent launched on this node yet")
        return record("launch", f"{first}; ddp_job passes --local-addr, GLOO_SOCKET_IFNAME and an IP"
                      " --rdzv-endpoint", "", "skip")
    ifname = seen["gloo_socket_ifname"]
    explicit = (_routable(seen["local_addr"]) and _routable((seen["rdzv_endpoint"] or "").rpartition(":")[0])
                and bool(ifname) and ifname != "lo")
    problem = None if explicit else (
        f"{host}: the last agent launch passed no explicit address ({_launch_words(seen)}), so gloo may have"
        " used the hostname's (loopback) address; fix: launch with ddp-lab (site.yml or playbooks/train.yml),"
        " which passes them")
    detail = f"last launch: {_launch_words(seen)}" + (f"; {stopped}" if stopped else "")
    return record("launch", problem, detail, "warn")


def unique_address(host: str, addresses: Mapping[str, Any]) -> dict:
    """This node's address towards the rendezvous host is no other play host's (``addresses``:
    ``{host: address}``; empty ones are ignored)."""
    same = _filters.sharing_keys(dict(addresses)).get(host, [])
    address = addresses.get(host)
    problem = None if not same else (
        f"{host} and {', '.join(same)} share the address {address} towards the rendezvous host (cloned"
        " machines or a static IP used twice); gloo cannot tell them apart; fix: give each laptop its own"
        " address (DHCP reservation)")
    return record("unique_address", problem, f"{address} is this node's alone")


def unique_name(host: str, hostnames: Mapping[str, Any]) -> dict:
    """This node's hostname is no other play host's (``hostnames``: ``{host: hostname}``): a warning."""
    same = _filters.sharing_keys(dict(hostnames)).get(host, [])
    name = hostnames.get(host)
    problem = None if not same else (
        f"{host} and {', '.join(same)} share the hostname {name}: their records in the metrics (field host)"
        " look alike; fix: sudo hostnamectl set-hostname <unique name>")
    return record("unique_name", problem, f"hostname {name} is unique", "warn")


def dpkg_lock(host: str, holders: Sequence[Mapping[str, Any]], comms: Sequence[Mapping[str, Any]],
              attempts: Any, poll_s: Any, wait_s: Any, preflight: bool) -> dict:
    """apt/dpkg locks free. ``holders``: filter ``validate_lock_holders`` after ``attempts`` reads
    ``poll_s`` apart; ``comms``: the ``slurp`` of each holder's /proc/PID/comm. A holder fails the
    ``preflight`` (which waited up to ``wait_s``), else warns."""
    if not holders:
        waited = (int(attempts or 1) - 1) * float(poll_s)
        return record("dpkg_lock", None,
                      "apt/dpkg locks free" + (f" (waited {waited} s)" if waited > 0 else ""))
    names = [base64.b64decode(c.get("content", "Pw==")).decode(errors="replace").strip() for c in comms]
    names += ["?"] * (len(holders) - len(names))
    who = "; ".join(f"{n} (pid {h['pid']}) holds {h['path']}" for n, h in zip(names, holders, strict=False))
    tail = (f" and did not finish within validate_dpkg_lock_wait_s={wait_s} s" if preflight else
            f" (the provisioning waits up to {wait_s} s for it)")
    return record("dpkg_lock", (
        f"{host}: apt/dpkg is busy: {who}{tail}; fix: let it finish (after boot unattended-upgrades runs"
        " for a while: systemctl status unattended-upgrades) and run again"), "",
        "fail" if preflight else "warn")


def gloo(host: str, route: Mapping[str, Any] | None, unit_show: str, addr_show: str) -> dict:
    """The address gloo binds on the node (the last launch's ``DDPLAB_GLOO_ADDR``, else the first
    of its ``GLOO_SOCKET_IFNAME``) against the route's source (a warning). ``route``: filter
    ``validate_route``; ``unit_show``: ``systemctl show`` of the agent unit; ``addr_show``: ``ip -o
    addr show dev <route dev>``. skip without a route."""
    src, dev = (route or {}).get("src"), (route or {}).get("dev")
    if not src:
        return record("gloo", "no route to the rendezvous host: see the route row", "", "skip")
    addresses = _filters.interface_addresses(addr_show or "")
    others = [a["address"] + ("" if a["label"] == dev else f" ({a['label']})") for a in addresses
              if a["address"] != src and not ipaddress.ip_address(a["address"]).is_link_local]
    also = f"; {dev} also holds {', '.join(others)}" if others else ""
    props = show_props(unit_show or "")
    env = _filters.unit_environment(props)
    if props.get("LoadState") != "loaded" or not env:
        return record("gloo", None,
                      f"the next launch binds {src} (DDPLAB_GLOO_ADDR, the route's source){also}")
    if env.get("DDPLAB_GLOO_ADDR"):
        bound, how = env["DDPLAB_GLOO_ADDR"], "DDPLAB_GLOO_ADDR of the last launch"
    else:
        ifname = env.get("GLOO_SOCKET_IFNAME") or ""
        bound = _filters.gloo_ifname_address(addresses, ifname) if ifname == dev else None
        how = f"the first address of GLOO_SOCKET_IFNAME={ifname or '(unset)'} of the last launch"
    problem = None if bound == src else (
        f"{host}: gloo binds {bound or 'an address of its own choosing'} ({how}), not {src}, the source of"
        f" the route via {dev}{also}; peers then fail ('Network is unreachable', 'ss_family ... 10 vs 2')"
        " or wait; fix: launch again with ddp-lab (site.yml or playbooks/train.yml), which passes"
        " DDPLAB_GLOO_ADDR=<route source>")
    return record("gloo", problem, f"binds {src} ({how}) = the route's source{also}", "warn")


# Checks that are pure functions of their arguments: called as ``check(host, **args)``.
PURE = {f.__name__: f for f in (trainers, rendezvous, rendezvous_address, unique_hosts, unique_names, dataset,
                                  port, reachable, route, hosts_file, launch, gloo, interface, clock, disk,
                                  dpkg_lock)}
# Checks that compare a host var across the play's hosts: check -> (function, default host var).
ACROSS = {"unique_address": (unique_address, "__validate_address"),
          "unique_name": (unique_name, "__validate_hostname")}


class ActionModule(ActionBase):
    """See the module docstring."""

    def _one(self, check: str, args: Mapping[str, Any], task_vars: dict) -> dict | None:
        host = task_vars.get("inventory_hostname", "?")
        hv, play = task_vars.get("hostvars", {}), task_vars.get("ansible_play_hosts", [])
        if check in PURE:
            return PURE[check](host, **args)
        if check in ACROSS:
            func, key = ACROSS[check]
            return func(host, {h: hv[h].get(args.get("key") or key, "") for h in play})
        if check == "versions":
            key = args.get("key") or "__validate_versions"
            everyone = {h: venv_versions(hv[h].get(key)) for h in play}
            provision = boolean(args.get("provision", False), strict=False)
            return versions(host, everyone, dict(args.get("pins") or {}), args.get("prefix", ""), provision)
        if check == "become":
            return self._become(host, task_vars)
        if check == "reach":
            res = self._execute_module(
                module_name="ansible.builtin.wait_for", task_vars=task_vars,
                module_args={"host": args["address"], "port": int(args["port"]),
                             "timeout": int(float(args["timeout_s"]))})
            if res.get("unreachable"):
                return None
            error = (res.get("msg") or "failed") if res.get("failed") else None
            return reach(host, args["what"], args["address"], args["port"], args["timeout_s"], error)
        raise AnsibleActionFail(f"validate_check: unknown check {check!r}")

    def _become(self, host: str, task_vars: dict) -> dict | None:
        """The check ``become``: ``ping`` run with become, no prompt; None: the node is unreachable."""
        try:
            res = self._execute_module(module_name="ansible.builtin.ping", module_args={},
                                       task_vars=task_vars)
        except AnsibleConnectionFailure:
            return None
        except AnsibleError as exc:
            res = {"failed": True, "msg": str(exc)}
        if res.get("unreachable"):
            return None
        method = str(getattr(self._connection.become, "name", "become")).rsplit(".", 1)[-1]
        user = self._play_context.remote_user or task_vars.get("ansible_user")
        text = " ".join(str(res.get(k) or "") for k in ("msg", "module_stderr", "module_stdout"))
        problem = become_problem(self._connection.become, text, user) if res.get("failed") else ""
        if res.get("failed") and not problem:
            first = next((ln for ln in text.splitlines() if ln.strip()), "failed")
            who = user or "the connecting account"
            problem = (f"become ({method}) fails for {who}: {first.strip()[:300]}; fix:"
                       f" let the account use {method} (on Ubuntu: sudo usermod -aG sudo <account>)")
        return record("become", f"{host}: {problem}" if problem else None,
                      f"{method} works without a prompt" + (" (a password was given)" if
                                                             self._play_context.become_pass else ""))

    def run(self, tmp=None, task_vars=None):
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        records = []
        for item in self._task.args.get("checks") or []:
            if item.get("skip"):
                continue
            try:
                rec = self._one(item.get("check"), item.get("args") or {}, task_vars)
            except (KeyError, TypeError, ValueError) as exc:
                raise AnsibleActionFail(f"validate_check {item.get('check')}: bad arguments ({exc})") from exc
            if rec is None:
                result.update({"unreachable": True, "msg": "the node cannot be reached"})
                return result
            records.append(rec)
        result.update({"changed": False, "records": records})
        return result
