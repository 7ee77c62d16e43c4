#!/usr/bin/python
"""Ansible module: read a node's training metrics and say where the job stands after a fault."""

from __future__ import annotations

DOCUMENTATION = r"""
module: ddp_lab_progress
short_description: Where a ddp-lab job stands on this node, and whether it recovered from a fault
description:
  - Reads the metrics JSONL files of a run on the node (docs/CONTRACTS.md) and returns the newest
    record of every worker (who holds which rank, world size, step) and the state of the node's
    agent unit.
  - With O(since), also measures that injection from this node's records (ddplab.controller.faults) and
    returns a O(phase) a play can wait on.
  - Read-only; supports check mode.
options:
  metrics_dir:
    description: The run's metrics folder on the node, C(<out_dir>/metrics).
    type: path
    required: true
  since:
    description: Unix time of the injection to measure (omit to only read the newest records).
    type: float
  duration_s:
    description: How long the fault lasts (freeze, partition, throttle); a step after it without
      a restart means the group rode the fault out.
    type: float
  mode:
    description: The fault mode, for the measurement.
    type: str
    default: kill-agent
  node:
    description: The node the fault was aimed at, for the measurement.
    type: str
    default: ""
  unit:
    description: The node's agent unit.
    type: str
    default: ddp-lab-agent
  inventory_name:
    description: The node's inventory name, copied into every worker entry as C(node) (metrics
      records carry the machine's hostname, which can differ).
    type: str
    default: ""
  wait_s:
    description: With O(since), keep reading until the phase is no longer C(waiting), for at
      most this many seconds (0 - read once).
    type: float
    default: 0
  poll_s:
    description: Seconds between two reads while waiting.
    type: float
    default: 1
author: ddp-lab
"""

RETURN = r"""
workers:
  description: Newest record per worker (host, local_rank, time, event, rank, world_size,
    restart_count, step), oldest first.
  type: list
  returned: always
agent_state:
  description: The unit's ActiveState (active, inactive, failed, ...).
  type: str
  returned: always
agent_substate:
  description: Its SubState (running, exited, failed, dead, ...).
  type: str
  returned: always
agent_running:
  description: A process of the unit runs (active and not merely kept after exiting).
  type: bool
  returned: always
agent_pid:
  description: The unit's main process (the torchrun agent), 0 when it is not running.
  type: int
  returned: always
waited_s:
  description: Seconds spent waiting.
  type: float
  returned: always
timed_out:
  description: The wait ended with the phase still C(waiting).
  type: bool
  returned: always
phase:
  description: waiting, recovered, continued, finished or ended (see ddplab.controller.faults.progress_phase).
  type: str
  returned: when since is given
measure:
  description: The injection measured from this node's records (a summary.json faults entry).
  type: dict
  returned: when since is given
"""

import time  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402
from ansible.module_utils.ddp_lab_faults import (  # noqa: E402
    Injection,
    measure,
    newest_per_worker,
    progress_phase,
)
from ansible.module_utils.ddp_lab_records import read_metrics_dir  # noqa: E402


def read_records(module: AnsibleModule, metrics_dir: str) -> tuple[list, int]:
    """(every record of metrics_dir/*.jsonl by time, torn lines skipped); fails the task when a
    file cannot be read."""
    try:
        return read_metrics_dir(metrics_dir)
    except OSError as exc:
        module.fail_json(msg=f"cannot read the metrics in {metrics_dir}: {exc}")
        raise  # not reached: fail_json exits


def agent(module: AnsibleModule, unit: str) -> tuple[str, str, int]:
    """(ActiveState, SubState, MainPID) of the unit; ("unknown", "unknown", 0) without systemd."""
    systemctl = module.get_bin_path("systemctl")
    if not systemctl:
        return "unknown", "unknown", 0
    rc, out, _err = module.run_command([systemctl, "show", "--property=ActiveState,SubState,MainPID", unit])
    props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line) if rc == 0 else {}
    pid = props.get("MainPID", "0")
    return (props.get("ActiveState") or "unknown", props.get("SubState") or "unknown",
            int(pid) if pid.isdigit() else 0)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "metrics_dir": {"type": "path", "required": True},
            "since": {"type": "float"},
            "duration_s": {"type": "float"},
            "mode": {"type": "str", "default": "kill-agent"},
            "node": {"type": "str", "default": ""},
            "unit": {"type": "str", "default": "ddp-lab-agent"},
            "inventory_name": {"type": "str", "default": ""},
            "wait_s": {"type": "float", "default": 0.0},
            "poll_s": {"type": "float", "default": 1.0},
        },
        supports_check_mode=True,
    )
    p = module.params
    t_start = time.monotonic()
    while True:
        records, skipped = read_records(module, p["metrics_dir"])
        state, sub, pid = agent(module, p["unit"])
        # the unit may be kept after its process exits (systemd-run --remain-after-exit): running
        # means a process is there
        running = state in ("active", "activating", "reloading") and sub not in ("exited", "dead", "failed")
        result = {"changed": False, "records": len(records), "skipped_lines": skipped,
                  "agent_state": state, "agent_substate": sub, "agent_running": running, "agent_pid": pid}
        workers = newest_per_worker(records)
        for w in workers:
            w["node"] = p["inventory_name"] or w["host"]
        result["workers"] = workers
        if p["since"] is None:
            break
        inj = Injection(time=p["since"], mode=p["mode"], node=p["node"] or "?",
                        duration_s=p["duration_s"] or None)
        m = measure(inj, records)
        result["phase"] = progress_phase(m, running)
        result["measure"] = m.to_dict()
        if result["phase"] != "waiting" or time.monotonic() - t_start >= p["wait_s"]:
            break
        time.sleep(max(0.1, p["poll_s"]))
    result["waited_s"] = round(time.monotonic() - t_start, 3)
    result["timed_out"] = result.get("phase") == "waiting" and p["wait_s"] > 0
    module.exit_json(**result)


if __name__ == "__main__":
    main()
