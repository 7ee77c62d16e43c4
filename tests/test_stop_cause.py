"""The node's progress (ddplab.status, read by the ddp_job watch) names why training stopped, from
the ``cause`` of the trainer's newest ``failure`` record."""

from ddplab import status


def records(**failure):
    common = {"rank": 0, "world_size": 2, "restart_count": 0}
    return [
        {"event": "step", "time": 1.0, "step": 61, "loss": 3.29, **common},
        {"event": "failure", "time": 2.0, "step": 61, "saved": False, **common, **failure},
    ]


def test_divergence_is_named_in_progress_and_line():
    error = ("Diverged: training diverged at step 62: loss 305.2 above uniform guessing "
             "ln(65) + 3 = 7.174; the step was not applied")
    p = status.node_progress(records(error=error, cause="divergence"))
    assert p["stop_cause"] == "divergence"
    assert p["failure"] == "divergence: " + error
    assert "last failure: divergence: Diverged: training diverged at step 62" in status.format_progress(
        "laptop-a", p, "failed")


def test_records_without_cause_keep_the_error_alone():
    p = status.node_progress(records(error="RuntimeError: Connection reset by peer"))
    assert p["stop_cause"] is None and p["failure"] == "RuntimeError: Connection reset by peer"


def test_summary_names_the_cause_and_a_fresh_start():
    from ddplab.controller import summary

    recs = [
        {"event": "start", "time": 0.5, "rank": 0, "world_size": 2, "restart_count": 0,
         "resumed_from_step": None, "fresh_start_reason": "found checkpoints in /x but none is usable: ..."},
        *records(error="Diverged: training diverged at step 62: loss 305.2 ...", cause="divergence"),
    ]
    fig = summary.per_host_figures("laptop-a", recs, None)
    assert fig["failures"] == [{"step": 61, "error": "Diverged: training diverged at step 62: loss 305.2 ...",
                                "cause": "divergence"}]
    assert fig["fresh_starts"] == ["found checkpoints in /x but none is usable: ..."]
    text = summary.human_summary({"run_id": "r", "per_host": {"laptop-a": fig}})
    assert "failures 1 (divergence), fresh start: found checkpoints in /x but none is usable" in text
