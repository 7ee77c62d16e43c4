"""Every play that names a cross-role setting loads the defaults role that defines it.

roles/ddp_lab/defaults/main.yml is the one home of the cross-role settings (ddp_lab_user,
ddp_lab_base_dir, rendezvous_port, ...). A play that uses one of them in its own tasks or vars
must list ``ddp_lab`` among its roles (directly or through a role's meta dependencies): otherwise
the name is undefined at run time (molecule reset's stand-in job failed so in CI, 'ddp_lab_user'
is undefined), and nothing short of running the scenario shows it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DEFAULTS = yaml.safe_load((REPO / "roles/ddp_lab/defaults/main.yml").read_text())
NAME = re.compile(r"\b(" + "|".join(sorted(map(re.escape, DEFAULTS), key=len, reverse=True)) + r")\b")


def _depends_on_ddp_lab(role: str, seen: set[str] | None = None) -> bool:
    """True when ``role`` is ddp_lab or depends on it through meta/main.yml (transitively)."""
    seen = seen if seen is not None else set()
    if role == "ddp_lab":
        return True
    if role in seen:
        return False
    seen.add(role)
    meta = REPO / "roles" / role / "meta/main.yml"
    deps = (yaml.safe_load(meta.read_text()) or {}).get("dependencies", []) if meta.exists() else []
    names = [d if isinstance(d, str) else d.get("role", d.get("name", "")) for d in deps]
    return any(_depends_on_ddp_lab(n, seen) for n in names)


def _plays():
    files = sorted({*REPO.glob("*.yml"), *REPO.glob("playbooks/*.yml"), *REPO.glob("molecule/*/*.yml")})
    for path in files:
        docs = yaml.safe_load(path.read_text())
        if not isinstance(docs, list):
            continue
        for play in docs:
            if isinstance(play, dict) and "hosts" in play:
                yield pytest.param(path, play, id=f"{path.relative_to(REPO)}:{play.get('name', '?')}")


@pytest.mark.parametrize(("path", "play"), list(_plays()))
def test_play_using_a_shared_setting_loads_ddp_lab(path, play):
    own = {k: play[k] for k in ("vars", "pre_tasks", "tasks", "post_tasks", "handlers") if k in play}
    used = sorted(set(NAME.findall(yaml.safe_dump(own))) - set(play.get("vars") or {}))
    if not used:
        return
    roles = [r if isinstance(r, str) else r.get("role", r.get("name", "")) for r in play.get("roles") or []]
    assert any(_depends_on_ddp_lab(r) for r in roles), (
        f"{path.relative_to(REPO)} play {play.get('name')!r} uses {used} but does not list the role "
        "ddp_lab (roles/ddp_lab/defaults/main.yml defines them): add `roles: [{role: ddp_lab}]`"
    )
