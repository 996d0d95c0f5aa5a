"""`--log-to mlflow|tensorboard` (orchestrator/reports/tracking.py): a finished run's metrics, params and
report go into a real MLflow store / TensorBoard event files, read back with the libraries' own
readers (MlflowClient, EventAccumulator); and `watch` reads a training run's TensorBoard log."""
from __future__ import annotations

import json

import pytest

from orchestrator.reports import tracking
from orchestrator.reports.report import write_report
from fakeruns import make_run


@pytest.fixture
def run_dir(tmp_path):
    runs = tmp_path / "runs"
    make_run(runs, "20261203-1000-v5-step_100-eval", drafter="v5", checkpoint="step_100")
    d = runs / "20261203-1000-v5-step_100-eval"
    write_report(d)
    return d


def test_mlflow_local_store_read_back_with_mlflows_client(run_dir, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    runs = run_dir.parent
    [where] = tracking.log_run(["mlflow"], run_dir, runs, step=100, group="v5")
    assert "sqlite:///" in where and (runs / "mlflow.db").exists()
    client = MlflowClient(tracking_uri=f"sqlite:///{(runs / 'mlflow.db').resolve()}")
    exp = client.get_experiment_by_name("dflash-ops/v5")
    [r] = client.search_runs([exp.experiment_id])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert r.data.metrics["tau_macro"] == pytest.approx(summary["tau_macro"])
    assert r.data.metrics["acceptance_1"] == pytest.approx(summary["per_position_acceptance"][0])
    assert [m.step for m in client.get_metric_history(r.info.run_id, "tau_macro")] == [100]
    assert r.data.params["drafter"] == "v5" and r.data.params["checkpoint"] == "step_100"
    assert r.data.params["step"] == "100" and r.data.params["run_id"] == run_dir.name
    assert {a.path for a in client.list_artifacts(r.info.run_id)} >= {"report.md", "report.html", "summary.json"}


def test_tensorboard_events_read_back_with_event_accumulator(run_dir):
    pytest.importorskip("tensorboardX")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = run_dir.parent
    tracking.log_run(["tensorboard"], run_dir, runs, step=100, group="v5")
    tracking.log_run(["tensorboard"], run_dir, runs, step=200, group="v5")
    acc = EventAccumulator(str(runs / "tensorboard" / "v5"))
    acc.Reload()
    summary = json.loads((run_dir / "summary.json").read_text())
    got = [(e.step, e.value) for e in acc.Scalars("eval/tau_macro")]
    assert [s for s, _ in got] == [100, 200]
    assert got[0][1] == pytest.approx(summary["tau_macro"], rel=1e-6)


def test_a_training_runs_tensorboard_log_is_read_by_watch(tmp_path):
    pytest.importorskip("tensorboardX")
    pytest.importorskip("tensorboard")
    from tensorboardX import SummaryWriter

    from orchestrator.watch.trainlog import read_tensorboard

    w = SummaryWriter(logdir=str(tmp_path / "tb"))
    for step in (100, 200, 300):
        w.add_scalar("eval/simulated_acc_len", step / 100.0, global_step=step)
        w.add_scalar("loss", 1.0 / step, global_step=step)
    w.close()
    files = {p.relative_to(tmp_path / "tb").as_posix(): p.read_bytes() for p in (tmp_path / "tb").rglob("*tfevents*")}
    s = read_tensorboard(files, ("eval/simulated_acc_len", "absent"))
    assert s["eval/simulated_acc_len"] == [(100, 1.0), (200, 2.0), (300, 3.0)] and s["absent"] == []


def test_unknown_or_missing_tracker_is_one_clear_error():
    with pytest.raises(tracking.TrackingError, match="choose from mlflow, tensorboard, wandb"):
        tracking.check_trackers(["neptune"])
    assert tracking.check_trackers([]) == []


def test_wandb_offline_run_holds_the_metrics_and_the_artifacts(run_dir, monkeypatch):
    """W&B in offline mode (nothing leaves the machine): the run's own log file carries every
    metric (wandb 0.31 has no python reader for it, so its protobuf bytes are searched)."""
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    runs = run_dir.parent
    for step in (100, 200):        # as `watch` logs one checkpoint after another in one process
        [where] = tracking.log_run(["wandb"], run_dir, runs, step=step, group="v5")
        assert where.startswith("wandb (offline)")
    logs = sorted((runs / "wandb").rglob("offline-run-*/run-*.wandb"))
    assert len(logs) == 2
    summary = json.loads((run_dir / "summary.json").read_text())
    for log in logs:               # written out when log_run returns, not later by wandb's service
        data = log.read_bytes()
        assert b"eval/tau_macro" in data and b"eval/acceptance_1" in data
        assert repr(summary["tau_macro"]).encode()[:8] in data
        files = log.parent / "files"
        assert json.loads((files / "summary.json").read_text()) == summary
        assert (files / "report.html").exists() and (files / "report.md").exists()


def test_params_name_folders_not_a_hosts_paths(tmp_path):
    """A tracker is often shared: the params carry the drafter's and target's folder names, not
    the absolute paths of someone's host."""
    runs = tmp_path / "runs"
    make_run(runs, "20261203-1000-v5-step_100-eval", drafter="v5", checkpoint="step_100",
             meta={"request": {"hosts": ["eval"], "drafter": "v5:step_100", "prompts": 2,
                               "drafter_path": "/home/alice/ckpts/v5/step_100", "target_path": "/data/alice/qwen3-8b"}})
    params, _ = tracking.run_facts(runs / "20261203-1000-v5-step_100-eval", 100)
    assert not any("/home/alice" in str(v) or "/data/alice" in str(v) for v in params.values()), params
    assert params["setting.drafter_path"] == "step_100" and params["setting.target_path"] == "qwen3-8b"
    assert params["setting.prompts"] == 2


def test_credentials_in_a_tracking_uri_are_never_printed():
    assert tracking.redact("mlflow postgresql://alice:s3cret@db.lab:5432/mlflow (experiment x)") == \
        "mlflow postgresql://***@db.lab:5432/mlflow (experiment x)"
    assert tracking.redact("https://token123@mlflow.lab/ and sqlite:////tmp/mlflow.db") == \
        "https://***@mlflow.lab/ and sqlite:////tmp/mlflow.db"


def test_a_tracker_outage_after_a_finished_eval_is_one_line_saying_where_the_results_are(local_home, tmp_path):
    """The eval finished, the MLflow server is down: one red line (exit 1) that says the results
    are on disk and where, never the URI's password, never a traceback."""
    import os
    import socket
    import subprocess
    import sys

    pytest.importorskip("mlflow")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]                      # nothing listens there once closed
    runs = tmp_path / "runs"
    env = {**os.environ, "DFLASH_OPS_HOME": str(local_home), "DFLASH_OPS_RUNS": str(runs), "COLUMNS": "200", "MLFLOW_TRACKING_URI": f"http://alice:s3cret@127.0.0.1:{port}",
           "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
    env.pop("DFLASH_OPS_INVENTORY", None)
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "eval", "--host", "local", "--drafter", "embedded",
                           "--prompts", "1", "--max-new-tokens", "8", "--ddtree", "", "--log-to", "mlflow"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in out, out
    (run,) = [d for d in runs.iterdir() if (d / "run.json").exists()]
    assert json.loads((run / "run.json").read_text())["status"] == "done"
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert "--log-to mlflow: could not log run" in line and f"its results are in {run}" in line, line
    assert "s3cret" not in out
