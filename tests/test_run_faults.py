"""A run's life under faults (issue 41), each shown on the built-in `local` host or on fake run
folders: a fetch never writes over a local file in place, a finished run whose host folder is
gone stays as it is, a resume never mixes two checkpoints or two worker versions in one run, an
interrupted start leaves a run every command reaches, and a worker's folder is locked for its
lifetime (a lost pid file never lets a second worker start there)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fakeruns import make_run
from orchestrator.eval.jobs import HostJob
from orchestrator.transport import TransportError
from orchestrator.transport.local import LocalRunner

REPO = Path(__file__).resolve().parents[1]
RESULTS = ("results.jsonl", "summary.json", "env.json")


def cli(home: Path, runs: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DFLASH_OPS_HOME": str(home), "DFLASH_OPS_RUNS": str(runs), "COLUMNS": "200"}
    env.pop("DFLASH_OPS_INVENTORY", None)
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=home, env=env, capture_output=True,
                          text=True, timeout=300)


class TruncatingRunner(LocalRunner):
    """A download as paramiko's ``SFTPClient.get`` does it: the local file is opened for writing
    (truncated) before the remote one is opened."""

    def get_file(self, remote, local) -> None:
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        with open(local, "wb"):
            pass
        super().get_file(remote, local)


def local_runner(cls=LocalRunner):
    from orchestrator.config.inventory import builtin_local

    return cls(builtin_local())


def test_a_fetch_that_fails_leaves_the_local_files_as_they_were(tmp_path):
    local = make_run(tmp_path / "runs", "20260101-0000-v5-local", host="local", prompts=2)
    before = {name: (local / name).read_bytes() for name in RESULTS}
    job = HostJob(local_runner(TruncatingRunner), sys.executable, str(REPO), str(tmp_path / "gone"))
    assert job.fetch(local) == []
    assert {name: (local / name).read_bytes() for name in RESULTS} == before
    assert not [p.name for p in local.iterdir() if p.name.startswith(".")]      # no temporary file left


def test_a_fetch_replaces_each_file_whole(tmp_path):
    host_run = tmp_path / "host"
    (host_run / "out").mkdir(parents=True)
    (host_run / "out" / "env.json").write_text('{"new": 1}')
    local = tmp_path / "here"
    local.mkdir()
    (local / "env.json").write_text('{"old": 1}')
    inode = (local / "env.json").stat().st_ino
    job = HostJob(local_runner(TruncatingRunner), sys.executable, str(REPO), str(host_run))
    assert job.fetch(local) == ["env.json"]
    assert (local / "env.json").read_text() == '{"new": 1}'
    assert (local / "env.json").stat().st_ino != inode          # renamed into place, never written in place


def shipped(home: Path) -> str:
    from orchestrator.eval.ship import ship

    return ship(local_runner(), sys.executable, str(home))


def local_run(home: Path, runs: Path, rid: str, status: str = "done", **kw) -> Path:
    """A fake run of the `local` host whose shard names the folders eval would use there."""
    folder = make_run(runs, rid, host="local", status=status, prompts=3, **kw)
    record = json.loads((folder / "run.json").read_text())
    record["shards"][0].update(run_dir=f"{home}/runs/{rid}", code_dir=shipped(home), python=sys.executable)
    (folder / "run.json").write_text(json.dumps(record))
    return folder


def test_attach_of_a_done_run_whose_host_folder_is_gone_keeps_it_done(tmp_path):
    """Before: `attach` truncated results.jsonl, summary.json and env.json to 0 bytes and marked
    the run failed (while saying "finished prompts are kept"); the run vanished from `runs`."""
    home, runs = tmp_path / "home", tmp_path / "runs"
    home.mkdir()
    rid = "20260101-000000-v5-local"
    folder = local_run(home, runs, rid)
    before = {name: (folder / name).read_bytes() for name in ("results.jsonl", "summary.json")}
    proc = cli(home, runs, "attach", rid)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in out, out
    assert "its folder on the host" in out and "is gone; the results fetched before are kept" in out, out
    assert {name: (folder / name).read_bytes() for name in before} == before
    assert json.loads((folder / "env.json").read_text())["drafter"]["sha256"]
    assert json.loads((folder / "run.json").read_text())["status"] == "done"
    listed = json.loads(cli(home, runs, "runs", "--json").stdout)
    assert [(r["id"], r["status"]) for r in listed] == [(rid, "done")]


def stopped_run(tmp_path: Path, monkeypatch, weights: bytes = b"old weights") -> tuple:
    """A `local` run stopped after 2 of its 3 prompts (its worker failed; the rows on the host),
    the drafter's weights it recorded in ``drafter/``; pre-flight stubbed (it passes)."""
    import hashlib

    from orchestrator.config.inventory import Inventory, builtin_local
    from orchestrator.eval import pipeline
    from orchestrator.runs.record import RunRecord

    home, runs = tmp_path / "home", tmp_path / "runs"
    home.mkdir()
    monkeypatch.setenv("DFLASH_OPS_HOME", str(home))
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "model.safetensors").write_bytes(weights)
    rid = "20260101-000000-v5-local"
    folder = local_run(home, runs, rid, status="failed")
    record = json.loads((folder / "run.json").read_text())
    record["shards"][0].update(drafter_path=str(drafter), fetched=True, done=2, prompts=3)
    (folder / "run.json").write_text(json.dumps(record))
    host_run = home / "runs" / rid
    (host_run / "out").mkdir(parents=True)
    (host_run / "out" / "env.json").write_text(json.dumps(
        {"drafter": {"sha256": {"model.safetensors": hashlib.sha256(weights).hexdigest()}}}))
    (host_run / "events.jsonl").write_text(json.dumps({"event": "prompt", "done": 2, "prompts": 3}) + "\n")
    (host_run / "exit_code").write_text("3\n")
    code_dir = record["shards"][0]["code_dir"]
    monkeypatch.setattr(pipeline, "prepare_host", lambda record, host, inventory, on_phase=None: pipeline.HostPrep(
        host, LocalRunner(host), code_dir, str(drafter), "target", 0, True, "default"))
    return RunRecord.load(folder), Inventory(hosts={"local": builtin_local()}), drafter, host_run


def test_a_resume_after_the_weights_changed_refuses_naming_the_change(tmp_path, monkeypatch):
    """Before: the resumed worker appended rows of the new weights to the old ones' (τ 4.55, 3.76,
    then ≈1.1), env.json recording only the new sha256."""
    from orchestrator.eval.pipeline import EvalError, start

    record, inventory, drafter, host_run = stopped_run(tmp_path, monkeypatch)
    (drafter / "model.safetensors").write_bytes(b"new weights")
    with pytest.raises(EvalError) as e:
        start(record, inventory, resume=True)
    msg = str(e.value)
    assert "the drafter's weights" in msg and "model.safetensors" in msg and "changed since its 2 finished" in msg
    assert "would mix two checkpoints" in msg and "dflash-ops eval --drafter" in msg and "--host local" in msg
    assert (host_run / "exit_code").read_text() == "3\n" and not (host_run / "pid").exists()    # nothing started
    assert json.loads((record.folder / "run.json").read_text())["status"] == "failed"


def test_a_resume_after_a_dflash_ops_update_refuses_naming_both_versions(tmp_path, monkeypatch):
    from orchestrator.eval.pipeline import EvalError, start

    record, inventory, drafter, host_run = stopped_run(tmp_path, monkeypatch)
    older = record.shards[0].code_dir.rpartition("/")[0] + "/0123456789abcdef"
    raw = json.loads((record.folder / "run.json").read_text())
    raw["shards"][0]["code_dir"] = older
    (record.folder / "run.json").write_text(json.dumps(raw))
    record.refresh()
    with pytest.raises(EvalError) as e:
        start(record, inventory, resume=True)
    assert "dflash-ops changed since its 2 finished prompt(s)" in str(e.value)
    assert "0123456789abcdef then" in str(e.value) and "two worker versions" in str(e.value)
    assert not (host_run / "pid").exists()


def test_an_interrupt_while_the_worker_starts_leaves_a_run_every_command_reaches(tmp_path, monkeypatch):
    """Before: Ctrl-C (or SIGTERM/SIGHUP, which end a command the same way) while the worker was
    being started removed the run folder here while the worker ran on, out of reach of `runs`,
    `attach` and `cancel`."""
    from orchestrator.eval import pipeline
    from orchestrator.eval.jobs import HostJob
    from orchestrator.runs.record import EvalRequest, RunRecord
    from remote.contract.settings import EvalSettings

    _, inventory, drafter, _ = stopped_run(tmp_path, monkeypatch)
    runs = tmp_path / "runs2"
    record = RunRecord.create(runs, EvalRequest(hosts=["local"], settings=EvalSettings(prompts=1), drafter_ref="v5",
                                                target="target"), "v5", None)
    started = []

    def start_then_interrupt(self, *args, **kwargs):
        started.append(self.run_dir)          # the host has the start request: its worker may run
        raise KeyboardInterrupt

    monkeypatch.setattr(HostJob, "start", start_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        pipeline.start(record, inventory)
    assert started
    saved = json.loads((record.folder / "run.json").read_text())
    assert saved["status"] == "preparing" and saved["shards"][0]["run_dir"] == started[0]
    proc = cli(tmp_path / "home", runs, "runs", "--json")
    assert [r["id"] for r in json.loads(proc.stdout)] == [record.id], proc.stdout + proc.stderr


def test_a_start_that_fails_still_gives_its_run_folder_back(tmp_path, monkeypatch):
    from orchestrator.eval import pipeline
    from orchestrator.eval.jobs import HostJob
    from orchestrator.runs.record import EvalRequest, RunRecord
    from remote.contract.settings import EvalSettings

    _, inventory, _, _ = stopped_run(tmp_path, monkeypatch)
    record = RunRecord.create(tmp_path / "runs2", EvalRequest(hosts=["local"], settings=EvalSettings(prompts=1),
                                                              drafter_ref="v5", target="target"), "v5", None)

    def refused(self, *args, **kwargs):
        raise TransportError("could not start the worker: refused")

    monkeypatch.setattr(HostJob, "start", refused)
    with pytest.raises(TransportError):
        pipeline.start(record, inventory)
    assert not record.folder.exists()


def launch(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "remote.host.launch", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_a_lost_pid_file_never_lets_a_second_worker_start_in_the_folder(tmp_path):
    """Before: with the pid file gone (the `unverifiable` message itself said to delete it) the
    state was `unknown`, and `eval --resume` started a second worker in the same folder (10 rows
    for 6 prompts)."""
    run_dir = tmp_path / "run"
    first = launch("start", str(run_dir), "--", "sleep", "60", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    pid = json.loads(first.stdout)["pid"]
    try:
        (run_dir / "pid").unlink()
        st = json.loads(launch("status", str(run_dir), cwd=tmp_path).stdout)
        assert st["state"] == "running" and "pid file is gone" in st["why"], st
        second = launch("start", str(run_dir), "--", "sleep", "60", cwd=tmp_path)
        assert second.returncode != 0 and "a job is already running there" in second.stderr, second
        assert json.loads((run_dir / "cmd.json").read_text())["argv"] == ["sleep", "60"]
        cancelled = json.loads(launch("cancel", str(run_dir), cwd=tmp_path).stdout)
        assert cancelled["signalled"] is False and "not signalled" in cancelled["why"]
        assert os.path.exists(f"/proc/{pid}")
    finally:
        os.killpg(pid, 9)
    deadline = time.monotonic() + 10
    while json.loads(launch("status", str(run_dir), cwd=tmp_path).stdout)["state"] == "running":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    again = launch("start", str(run_dir), "--", "true", cwd=tmp_path)      # the lock went with the job
    assert again.returncode == 0, again.stderr
