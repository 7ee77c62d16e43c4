"""Scenario `train`, on every trainer: the job ended cleanly and left nothing running."""

testinfra_hosts = ["trainers"]


def test_agent_finished(host):
    show = host.check_output("systemctl show ddp-lab-agent -p ActiveState,SubState,Result,ExecMainStatus")
    state = dict(line.split("=", 1) for line in show.splitlines())
    assert state == {
        "ActiveState": "active",
        "SubState": "exited",
        "Result": "success",
        "ExecMainStatus": "0",
    }


def test_no_training_process_left(host):
    assert host.run("pgrep -u ddp -f 'ddplab.train|torch.distributed.run'").rc == 1


def test_run_folder_owned_by_training_user(host):
    run_id = host.file("/var/lib/ddp-lab/current_run").content_string.strip()
    d = host.file(f"/var/lib/ddp-lab/runs/{run_id}")
    assert d.is_directory and d.user == "ddp" and d.mode == 0o750
    assert host.file(f"/var/lib/ddp-lab/runs/{run_id}/checkpoints").user == "ddp"
