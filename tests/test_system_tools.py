"""Every system tool a role runs on a node is found wherever the distribution puts it (issue 27
item 17: ``bench.yml -e bench_shape_rate_mbit=1000`` failed on every lab laptop with "cannot shape
eth0 (root qdisc: ); fix: install iproute2": ``tc`` is in /usr/sbin, not on the sudo account's PATH
over SSH (``/usr/local/bin:/usr/bin:/bin:/usr/games``), and the task ran without become).

The rule the roles keep: a command task whose program is a bare name of a tool that lives in an
``sbin`` folder runs with become (sudo's ``secure_path`` holds the sbin folders), so that the
product does not depend on the account's PATH (nor on Ubuntu's /etc/environment, which the lab
image carries: lab/image/Containerfile). Where a tool lives is read on this machine (Debian, the
lab image's distribution; Ubuntu puts these tools in the same folders); tools not installed here
are in :data:`ELSEWHERE`, from the Ubuntu packages that ship them.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
USER_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/games"  # sshd's default PATH for a non-root account
SBIN_PATH = "/usr/local/sbin:/usr/sbin:/sbin"
# Tools the roles run that this machine may not have: True = in an sbin folder on Ubuntu.
ELSEWHERE = {"iw": True, "rfkill": True, "ethtool": True, "ufw": True, "cpupower": False, "ping": False,
             "setfacl": False}
COMMANDS = ("ansible.builtin.command", "command", "ansible.builtin.shell", "shell")


def in_sbin(tool: str) -> bool:
    """True when ``tool`` is found only in an sbin folder (so not on a sudo account's PATH)."""
    if tool in ELSEWHERE and shutil.which(tool, path=USER_PATH + ":" + SBIN_PATH) is None:
        return ELSEWHERE[tool]
    if shutil.which(tool, path=USER_PATH):
        return False
    assert shutil.which(tool, path=SBIN_PATH), (
        f"{tool} is not installed here and not in ELSEWHERE: say whether Ubuntu puts it in sbin")
    return True


def _tasks(items, inherited: dict):
    """Every task of a task list with the become/delegate_to it inherits from its blocks."""
    for task in items or []:
        if not isinstance(task, dict):
            continue
        here = {**inherited, **{k: task[k] for k in ("become", "delegate_to") if k in task}}
        if "block" in task:
            for key in ("block", "rescue", "always"):
                yield from _tasks(task.get(key), here)
        else:
            yield task, here


SHELL_WORDS = {"set", "if", "then", "else", "fi", "for", "do", "done", "while", "case", "esac", "echo",
               "exit", "test", "[", "]", "&&", "||", "true", "false", "exec", "export", "cd"}


def _programs(args) -> list[str]:
    """The programs a command/shell task runs: argv[0], or the first word of each line of a script
    (its continuation lines and shell words left out); [] for a templated argv."""
    argv = args.get("argv") if isinstance(args, dict) else None
    if isinstance(argv, list) and argv:
        return [str(argv[0])]
    script = args.get("cmd") if isinstance(args, dict) else args
    if not isinstance(script, str):
        return []  # argv templated whole (a venv's python, systemd-run + the agent's argv)
    out, joined = [], re.sub(r"{{.*?}}", "JINJA", script.replace("\\\n", " "), flags=re.S)
    for line in joined.splitlines():
        for part in line.replace("&&", "\n").replace("||", "\n").replace("|", "\n").splitlines():
            words = part.split()
            if words and words[0] not in SHELL_WORDS and not re.match(r"#|\w+=|JINJA", words[0]):
                out.append(words[0])
    return out


def command_tasks():
    """(file, task name, program, become, delegate_to) of every program a command/shell task in
    roles/ runs."""
    for path in sorted(REPO.glob("roles/*/tasks/*.yml")):
        for task, ctx in _tasks(yaml.safe_load(path.read_text()), {}):
            module = next((m for m in COMMANDS if m in task), None)
            for program in _programs(task[module]) if module else []:
                yield (path.relative_to(REPO), task.get("name", "?"), program, ctx.get("become"),
                       ctx.get("delegate_to"))


def test_sbin_tools_run_with_become():
    found = list(command_tasks())
    assert any(program == "tc" for _, _, program, _, _ in found), "the scan found no tc task: is it broken?"
    bad = [f"{path}: '{name}' runs {program} without become"
           for path, name, program, become, delegate in found
           if "{{" not in program and "/" not in program and delegate not in ("localhost", "127.0.0.1")
           and in_sbin(program) and become is not True]
    assert not bad, "\n".join(bad)
