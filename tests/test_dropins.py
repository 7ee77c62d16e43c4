"""The project's drop-ins win over distribution defaults, checked on the *effective* value.

NetworkManager: the real ``NetworkManager --print-config`` (network-manager installed on the
controller) on temp folders standing in for /usr/lib, /etc and the main file, with Ubuntu's
``default-wifi-powersave-on.conf`` (wifi.powersave = 3) present; the role itself runs against them.
systemd-logind: ``systemd-analyze cat-config --root`` on a temp root with a distribution drop-in.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
import yaml
from ansible_collections.ddp_lab.cluster.plugins.filter import power
from ansible_collections.ddp_lab.cluster.plugins.modules import ddp_lab_nm_setting as nm_setting

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PLAYBOOK = shutil.which("ansible-playbook", path=str(BIN)) or shutil.which("ansible-playbook")
NM = shutil.which("NetworkManager", path="/usr/sbin:/usr/bin")
UBUNTU_NM = "[connection]\nwifi.powersave = 3\n"  # /etc/NetworkManager/conf.d/default-wifi-powersave-on.conf


def role_default(role: str, var: str) -> str:
    return yaml.safe_load((ROOT / "roles" / role / "defaults/main.yml").read_text())[var]


def nm_dirs(tmp_path: Path) -> dict[str, Path]:
    dirs = {"lib": tmp_path / "usr-lib", "etc": tmp_path / "etc", "run": tmp_path / "run"}
    for d in dirs.values():
        d.mkdir()
    (tmp_path / "NetworkManager.conf").write_text("[main]\n")
    return dirs


def print_config(tmp_path: Path, dirs: dict[str, Path]) -> str:
    return subprocess.run(
        [NM, "--print-config", f"--config={tmp_path / 'NetworkManager.conf'}", f"--config-dir={dirs['etc']}",
         f"--system-config-dir={dirs['lib']}", f"--intern-config={tmp_path / 'intern.conf'}"],
        check=True, capture_output=True, text=True).stdout


def merged_powersave(text: str) -> str | None:
    section = None
    for line in text.splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        elif section == "connection" and line.startswith("wifi.powersave="):
            return line.split("=", 1)[1]
    return None


def test_nm_read_order_and_the_file_that_overrides_in_a_fake_folder_set():
    header = ("# NetworkManager configuration: /etc/NetworkManager/NetworkManager.conf "
              "(lib: 10-x.conf, zzz.conf) (run: netplan.conf) "
              "(etc: default-wifi-powersave-on.conf, zz-ddp-lab-wifi-powersave.conf)")
    dirs = {"lib": "/L", "run": "/R", "etc": "/E"}
    order = nm_setting.read_order(header, dirs)
    assert order == ["/L/10-x.conf", "/L/zzz.conf", "/R/netplan.conf",
                     "/etc/NetworkManager/NetworkManager.conf",
                     "/E/default-wifi-powersave-on.conf", "/E/zz-ddp-lab-wifi-powersave.conf"]
    texts = dict.fromkeys(order, "")
    texts["/L/zzz.conf"] = UBUNTU_NM  # read before /etc: loses
    texts["/E/default-wifi-powersave-on.conf"] = UBUNTU_NM
    texts["/E/zz-ddp-lab-wifi-powersave.conf"] = "[connection]\nwifi.powersave = 2\n"
    found = nm_setting.setters(list(texts.items()), "wifi.powersave")
    assert [s["file"] for s in found] == ["/L/zzz.conf", "/E/default-wifi-powersave-on.conf",
                                          "/E/zz-ddp-lab-wifi-powersave.conf"]
    assert nm_setting.overriding(found, "2") == []
    texts["/R/netplan.conf"] = "[connection-wifi-laptop]\nmatch-device=interface-name:wl*\nwifi.powersave=3\n"
    texts["/intern.conf"] = "[.intern.connection]\nwifi.powersave=3\n"
    wrong = nm_setting.overriding(nm_setting.setters(list(texts.items()), "wifi.powersave"), "2")
    assert [(s["file"], s["section"]) for s in wrong] == [
        ("/R/netplan.conf", "connection-wifi-laptop"), ("/intern.conf", ".intern.connection")]
    with pytest.raises(ValueError, match="not a NetworkManager --print-config header"):
        nm_setting.read_order("[main]", dirs)


@pytest.mark.skipif(NM is None, reason="NetworkManager is not installed (apt-get install -y network-manager)")
@pytest.mark.parametrize("name, merged", [("ddp-lab-wifi-powersave.conf", "3"), (None, "2")])
def test_nm_merges_the_role_drop_in_after_ubuntus(tmp_path, name, merged):
    """The name the role used before loses to Ubuntu's file; the role's default name wins."""
    dirs = nm_dirs(tmp_path)
    (dirs["etc"] / "default-wifi-powersave-on.conf").write_text(UBUNTU_NM)
    name = name or Path(role_default("wifi_powersave", "wifi_powersave_nm_dropin")).name
    template = ROOT / "roles/wifi_powersave/templates/wifi-powersave.conf.j2"
    (dirs["etc"] / name).write_text(template.read_text())
    assert merged_powersave(print_config(tmp_path, dirs)) == merged


def run_role(tmp_path: Path, role: str, extra: dict) -> subprocess.CompletedProcess:
    play = tmp_path / "play.yml"
    play.write_text(yaml.safe_dump([{"name": "Role", "hosts": "localhost", "gather_facts": False,
                                     "roles": [{"role": role}]}]))
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_LOCAL_TEMP=str(tmp_path / "tmp"), ANSIBLE_HOME=str(tmp_path / "home"),
               PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    return subprocess.run([PLAYBOOK, "-i", "localhost,", "-c", "local", str(play),
                           "-e", f"ansible_python_interpreter={sys.executable}", "-e", json.dumps(extra)],
                          capture_output=True, text=True, env=env, timeout=300)


needs_role_run = pytest.mark.skipif(
    NM is None or PLAYBOOK is None or os.geteuid() != 0,
    reason="needs NetworkManager, ansible-playbook (make venv) and root (the role's become)")


@needs_role_run
def test_wifi_powersave_role_wins_over_ubuntus_file_and_removes_its_old_drop_in(tmp_path):
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "default-wifi-powersave-on.conf").write_text(UBUNTU_NM)
    (etc / "ddp-lab-wifi-powersave.conf").write_text("[connection]\nwifi.powersave = 2\n")  # an earlier run
    dropin = etc / Path(role_default("wifi_powersave", "wifi_powersave_nm_dropin")).name
    run = run_role(tmp_path, "wifi_powersave", {"wifi_powersave_nm_dropin": str(dropin)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert sorted(p.name for p in etc.iterdir()) == sorted(["default-wifi-powersave-on.conf", dropin.name])
    # the controller's own /usr/lib and NetworkManager.conf take part, as the role's check saw them
    merged = subprocess.run([NM, "--print-config", f"--config-dir={etc}"], check=True, capture_output=True,
                            text=True).stdout
    assert merged_powersave(merged) == "2"


@needs_role_run
def test_wifi_powersave_role_fails_naming_the_file_that_overrides_it(tmp_path):
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "zzz-vendor.conf").write_text(UBUNTU_NM)  # sorts after any name the role could pick
    dropin = etc / "zz-ddp-lab-wifi-powersave.conf"
    run = run_role(tmp_path, "wifi_powersave", {"wifi_powersave_nm_dropin": str(dropin)})
    assert run.returncode != 0
    assert "merged wifi.powersave is 3" in run.stdout
    assert f"{etc}/zzz-vendor.conf [connection] sets 3 wins" in run.stdout


SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
LID = yaml.safe_load((ROOT / "roles/power/vars/main.yml").read_text())["__power_lid_settings"]
OEM_LOGIND = "[Login]\nHandleLidSwitch=suspend\n"  # a vendor's /usr/lib/systemd/logind.conf.d/oem-lid.conf


def power_dropin() -> str:
    """The role's drop-in, rendered from its template."""
    template = jinja2.Template((ROOT / "roles/power/templates/logind.conf.j2").read_text(), trim_blocks=True)
    return template.render(ansible_managed="managed", __power_lid_settings=LID)


def cat_config(root: Path) -> str:
    return subprocess.run([SYSTEMD_ANALYZE, "cat-config", f"--root={root}", "systemd/logind.conf"],
                          check=True, capture_output=True, text=True).stdout


def test_logind_settings_take_the_last_file_that_sets_a_key():
    text = ("# /etc/systemd/logind.conf\n# or drop-ins in the\n# /etc/systemd/logind.conf.d/ directory.\n"
            "[Login]\n#HandleLidSwitch=suspend\nKillUserProcesses=no\n\n"
            "# /etc/systemd/logind.conf.d/zz-ddp-lab-power.conf\n[Login]\nHandleLidSwitch=ignore\n\n"
            "# /usr/lib/systemd/logind.conf.d/zzz-oem.conf\n[Login]\nHandleLidSwitch = suspend\n")
    merged = power.logind_settings(text)
    oem = "/usr/lib/systemd/logind.conf.d/zzz-oem.conf"
    assert merged["HandleLidSwitch"] == {"value": "suspend", "file": oem}
    assert merged["KillUserProcesses"]["file"] == "/etc/systemd/logind.conf"
    want = {"HandleLidSwitch": "ignore", "HandleLidSwitchDocked": "ignore"}
    assert power.logind_mismatches(text, want) == [
        f"HandleLidSwitch=suspend ({oem})",
        "HandleLidSwitchDocked unset (no file sets it)"]


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("name, wins", [("ddp-lab-power.conf", False), (None, True)])
def test_logind_merges_the_role_drop_in_after_a_vendor_one(tmp_path, name, wins):
    """The name the role used before loses to a vendor's oem-lid.conf; the role's default name wins."""
    (tmp_path / "etc/systemd/logind.conf.d").mkdir(parents=True)
    (tmp_path / "usr/lib/systemd/logind.conf.d").mkdir(parents=True)
    (tmp_path / "etc/systemd/logind.conf").write_text("[Login]\n#HandleLidSwitch=suspend\n")
    (tmp_path / "usr/lib/systemd/logind.conf.d/oem-lid.conf").write_text(OEM_LOGIND)
    name = name or Path(role_default("power", "power_logind_dropin")).name
    (tmp_path / "etc/systemd/logind.conf.d" / name).write_text(power_dropin())
    wrong = power.logind_mismatches(cat_config(tmp_path), LID)
    oem = tmp_path / "usr/lib/systemd/logind.conf.d/oem-lid.conf"
    assert wrong == ([] if wins else [f"HandleLidSwitch=suspend ({oem})"])
