#!/usr/bin/python
"""Ansible module: a NetworkManager setting as NetworkManager merges it, and the files that set it."""

from __future__ import annotations

DOCUMENTATION = r"""
module: ddp_lab_nm_setting
short_description: The effective value of a NetworkManager connection default, and which file sets it
description:
  - Runs C(NetworkManager --print-config) (read-only; the daemon need not run), which merges
    NetworkManager.conf and the conf.d drop-ins the way the daemon does, and reads the value of
    O(key) in the C([connection]) section.
  - Names the files that set O(key) in any C([connection*]) section, in NetworkManager's read order
    (the order its print-config header lists; lib, run, the main file, etc, the intern file last),
    and which of them make the setting differ from O(want) - the file to fix.
  - Read-only; supports check mode.
options:
  key:
    description: The connection default to read.
    type: str
    default: wifi.powersave
  want:
    description: The value the setting must have.
    type: str
    required: true
  executable:
    description: The NetworkManager daemon binary.
    type: path
    default: /usr/sbin/NetworkManager
  config:
    description: NetworkManager.conf (C(--config)).
    type: path
    default: /etc/NetworkManager/NetworkManager.conf
  config_dir:
    description: The administrator's drop-in folder (C(--config-dir)).
    type: path
    default: /etc/NetworkManager/conf.d
  system_config_dir:
    description: The packages' drop-in folder (C(--system-config-dir)).
    type: path
    default: /usr/lib/NetworkManager/conf.d
  run_config_dir:
    description: The per-boot drop-in folder (fixed in NetworkManager; only used to name files).
    type: path
    default: /run/NetworkManager/conf.d
  intern_config:
    description: NetworkManager's own overrides (C(--intern-config)).
    type: path
    default: /var/lib/NetworkManager/NetworkManager-intern.conf
"""

RETURN = r"""
value:
  description: The merged value in C([connection]); null when nothing sets it.
  type: str
  returned: always
setters:
  description: Every C({file, section, value}) that sets the key, in read order.
  type: list
  returned: always
overriding:
  description: The setters that make the setting differ from O(want) (empty when it is O(want)).
  type: list
  returned: always
overridden_by:
  description: The O(overriding) setters as one line, C(<file> [<section>] sets <value>; ...).
  type: str
  returned: always
files:
  description: The files NetworkManager read, in order.
  type: list
  returned: always
"""

import configparser  # noqa: E402
import contextlib  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402

_HEADER = re.compile(r"^# NetworkManager configuration: (\S+)(.*)$")
_GROUP = re.compile(r"\((lib|run|etc): ([^)]*)\)")


def read_order(header: str, dirs: dict[str, str]) -> list[str]:
    """Paths of the files NetworkManager read, from its print-config header line.

    ``header``: ``# NetworkManager configuration: /etc/NetworkManager/NetworkManager.conf (lib: a.conf)
    (etc: b.conf, c.conf)``. ``dirs`` maps ``lib``, ``run``, ``etc`` to their folders. NetworkManager
    1.42 reads lib, then run, then the main file, then etc (NetworkManager.conf(5); a name in etc
    hides the same name in run and lib, so the header lists it once).
    """
    match = _HEADER.match(header.strip())
    if not match:
        raise ValueError(f"not a NetworkManager --print-config header: {header!r}")
    groups = {kind: [n.strip() for n in names.split(",") if n.strip()]
              for kind, names in _GROUP.findall(match.group(2))}
    lib, run, etc = ([os.path.join(dirs[k], n) for n in groups.get(k, [])] for k in ("lib", "run", "etc"))
    return [*lib, *run, match.group(1), *etc]


def _parse(text: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=False, comment_prefixes=("#", ";"))
    parser.optionxform = str  # NetworkManager keys are case-sensitive
    parser.read_string(text)
    return parser


def setters(files: list[tuple[str, str]], key: str) -> list[dict]:
    """``{file, section, value}`` for each ``[connection*]`` (or ``[.intern.connection*]``) section
    of ``files`` (``(path, text)`` in read order) that sets ``key``. Unreadable text is skipped."""
    found = []
    for path, text in files:
        try:
            parser = _parse(text)
        except configparser.Error:
            continue
        for section in parser.sections():
            if section.removeprefix(".intern.").startswith("connection") and parser.has_option(section, key):
                found.append({"file": path, "section": section, "value": parser.get(section, key).strip()})
    return found


def overriding(found: list[dict], want: str) -> list[dict]:
    """The setters that make the setting differ from ``want``: the last one of ``[connection]``
    when its value is not ``want``, every per-device ``[connection-...]`` section with another
    value (it applies to the devices it matches), and intern overrides with another value."""
    plain = [s for s in found if s["section"] == "connection"]
    result = [plain[-1]] if plain and plain[-1]["value"] != want else []
    return result + [s for s in found if s["section"] != "connection" and s["value"] != want]


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "key": {"type": "str", "default": "wifi.powersave", "no_log": False},
            "want": {"type": "str", "required": True},
            "executable": {"type": "path", "default": "/usr/sbin/NetworkManager"},
            "config": {"type": "path", "default": "/etc/NetworkManager/NetworkManager.conf"},
            "config_dir": {"type": "path", "default": "/etc/NetworkManager/conf.d"},
            "system_config_dir": {"type": "path", "default": "/usr/lib/NetworkManager/conf.d"},
            "run_config_dir": {"type": "path", "default": "/run/NetworkManager/conf.d"},
            "intern_config": {"type": "path",
                              "default": "/var/lib/NetworkManager/NetworkManager-intern.conf"},
        },
        supports_check_mode=True,
    )
    p = module.params
    argv = [p["executable"], "--print-config", f"--config={p['config']}", f"--config-dir={p['config_dir']}",
            f"--system-config-dir={p['system_config_dir']}", f"--intern-config={p['intern_config']}"]
    rc, out, err = module.run_command(argv)
    if rc != 0:
        module.fail_json(msg=f"{' '.join(argv)} failed (rc {rc}): {err.strip()}", rc=rc, stderr=err)
    lines = out.splitlines()
    header = next((line for line in lines if line.startswith("# NetworkManager configuration:")), "")
    dirs = {"lib": p["system_config_dir"], "run": p["run_config_dir"], "etc": p["config_dir"]}
    try:
        order = read_order(header, dirs)
    except ValueError as exc:
        module.fail_json(msg=str(exc))
    merged = _parse("\n".join(line for line in lines if not line.startswith("#")))
    value = merged.get("connection", p["key"], fallback=None)
    texts = []
    for path in [*order, p["intern_config"]]:
        with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as handle:
            texts.append((path, handle.read()))
    found = setters(texts, p["key"])
    wrong = overriding(found, p["want"])
    text = "; ".join(f"{s['file']} [{s['section']}] sets {s['value']}" for s in wrong)
    module.exit_json(changed=False, value=value, setters=found, overriding=wrong, files=order,
                     overridden_by=text)


if __name__ == "__main__":
    main()
