"""runs/<id>/run.json as the one record of a run: ids that never collide, saves that never
collide, and a run folder read as untrusted input (types checked; the interpreter and folders it
names are never run unless the inventory says so)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from datetime import datetime
from pathlib import Path

import pytest

from orchestrator.runs.record import EvalRequest, RunRecord, RunRecordError, run_id

REPO = Path(__file__).resolve().parents[1]


def new_record(runs: Path, host: str = "ct129") -> RunRecord:
    return RunRecord.create(runs, EvalRequest(hosts=[host], drafter="v5:step_20000"), "v5", "step_20000", 20000)


def test_runs_started_in_the_same_second_get_their_own_ids_and_folders(tmp_path, monkeypatch):
    """Two terminals (or a sweep script) start the same eval in the same second: each run gets an
    id of its own, claimed atomically (8 threads at once), so no run's folder is shared."""
    import orchestrator.runs.record as record_mod

    when = datetime(2026, 12, 2, 21, 1, 30)
    monkeypatch.setattr(record_mod, "run_id", lambda *a: run_id(*a, when=when))
    records, barrier = [], threading.Barrier(8)

    def create() -> None:
        barrier.wait()
        records.append(new_record(tmp_path / "runs"))
    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = sorted(r.id for r in records)
    base = "20261202-210130-v5-step20k-ct129"
    assert ids == sorted([base] + [f"{base}-{n}" for n in range(2, 9)])
    assert all(r.folder == tmp_path / "runs" / r.id and r.folder.is_dir() for r in records)
    records[0].abandon()                         # a run whose pre-flight failed gives its folder back
    assert not records[0].folder.exists()


def test_concurrent_saves_of_one_record_never_fail(tmp_path):
    """Shards fetched at once save run.json from several threads (and attach/cancel from other
    processes): each save has its own temporary file, so none fails and run.json stays whole."""
    record = new_record(tmp_path / "runs")
    errors = []

    def saves() -> None:
        try:
            for _ in range(100):
                record.save()
        except Exception as e:  # noqa: BLE001 — collected for the assertion
            errors.append(repr(e))
    threads = [threading.Thread(target=saves) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert RunRecord.load(record.folder).id == record.id
    assert [p.name for p in record.folder.iterdir()] == ["run.json"]


BAD_FIELDS = [("status", 3), ("shards", [{"host": "local", "index": "0", "count": 1}]),
              ("shards", [{"host": "local", "index": 1, "count": 1}]), ("request", {"hosts": "local"}),
              ("request", {"hosts": ["local"], "prompts": "2"}), ("prompts", [2]), ("cancels", None),
              ("shards", [{"host": "local", "index": 0, "count": 1, "exit_code": "0"}])]


def write_run(runs: Path, home: Path, **over) -> Path:
    """A run.json as `eval` writes it for the local host (workdir ``home``), with fields overridden."""
    record = RunRecord.create(runs, EvalRequest(hosts=["local"], drafter="embedded"), "embedded", None)
    record.prepared(0, run_dir=f"{home}/runs/{record.id}", code_dir=f"{home}/code/{'0' * 16}", python=sys.executable,
                    drafter_path="d", target_path="t")
    record.started()
    data = json.loads((record.folder / "run.json").read_text())
    for key, value in over.items():
        if key == "shard":
            data["shards"][0].update(value)
        else:
            data[key] = value
    (record.folder / "run.json").write_text(json.dumps(data))
    return record.folder


def cli(tmp_path: Path, home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DFLASH_OPS_HOME": str(home), "DFLASH_OPS_RUNS": str(tmp_path / "runs")}
    env.pop("DFLASH_OPS_INVENTORY", None)
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("field,value", BAD_FIELDS)
def test_a_mistyped_run_json_field_is_one_line_naming_it(tmp_path, field, value):
    home = tmp_path / "home"
    folder = write_run(tmp_path / "runs", home, **({"shard": {k: v for k, v in value[0].items()}}
                                                   if field == "shards" and "exit_code" in value[0] else {field: value}))
    with pytest.raises(RunRecordError) as e:
        RunRecord.load(folder)
    assert str(folder / "run.json") in str(e.value)
    for command in ("cancel", "attach"):
        proc = cli(tmp_path, home, command, folder.name)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2 and "Traceback" not in out and len(out.strip().splitlines()) == 1, out
        assert str(folder / "run.json") in out


def test_a_foreign_run_folder_never_runs_its_interpreter_or_code(tmp_path):
    """A run folder from elsewhere names an interpreter and a code folder of its own: cancel and
    attach refuse in one line and run neither (the interpreter is the inventory's; the code folder
    must be a shipped one under the host's workdir)."""
    home = tmp_path / "home"
    evil = tmp_path / "evil"
    (evil / "remote").mkdir(parents=True)
    marker = tmp_path / "ran"
    (evil / "remote" / "__init__.py").write_text("")
    (evil / "remote" / "launch.py").write_text(f"open({str(marker)!r}, 'a').write('launch\\n')\n")
    (evil / "python").write_text(f"#!/bin/sh\necho python >> {marker}\n")
    (evil / "python").chmod(0o755)
    folder = write_run(tmp_path / "runs", home, shard={"python": str(evil / "python"), "code_dir": str(evil)})
    for command in ("cancel", "attach"):
        proc = cli(tmp_path, home, command, folder.name)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2 and "Traceback" not in out, out
        assert "is not a worker folder under" in out and "nothing was run there" in out, out
    assert not marker.exists(), marker.read_text()
    escaped = write_run(tmp_path / "runs", home, shard={"run_dir": "/etc"})
    proc = cli(tmp_path, home, "cancel", escaped.name)
    assert proc.returncode == 2 and "run_dir '/etc' is not" in proc.stdout + proc.stderr
