"""run.json: one reader and writer (orchestrator/runs/record.py), one settings value inside it, the
state vocabulary, and the transitions that `cancel` and a followed worker make."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from datetime import datetime
from pathlib import Path

import pytest

from orchestrator.runs.folders import load_run, run_rows
from orchestrator.runs.record import EvalRequest, RunRecord, RunRecordError, run_id
from remote.contract.settings import EvalSettings
from remote.contract.states import State


def record(tmp_path: Path, hosts=("ct129",), **settings) -> RunRecord:
    req = EvalRequest(hosts=list(hosts), settings=EvalSettings(**settings), drafter_ref="v5:step_20000",
                      target="qwen", drafter_run="v5", checkpoint="step_20000")
    rec = RunRecord.create(tmp_path / "runs", req, "v5", "step_20000", 20000)
    rec.save()
    return rec


def test_a_record_round_trips_and_is_what_eval_run_reads(tmp_path):
    rec = record(tmp_path, prompts=12, mode="online", temperature=0.5)
    again = RunRecord.load(rec.folder)
    assert again == rec and again.settings == EvalSettings(prompts=12, mode="online", temperature=0.5)
    assert again.status is State.PREPARING and again.hosts == ["ct129"]
    run = load_run(rec.folder)
    assert run.record == rec and (run.label, run.suite, run.mode, run.host) == ("v5:step_20000", "default",
                                                                                  "online", "ct129")


def test_a_flat_request_is_read_as_the_nested_one(tmp_path):
    rec = record(tmp_path)
    data = json.loads((rec.folder / "run.json").read_text())
    flat = {k: v for k, v in data["request"].items() if k != "settings"}
    flat.pop("drafter_ref")
    flat.update(drafter="v5:step_20000", suite="humaneval", prompts=3, mode="offline", ddtree_budgets="8,16",
                max_memory_gb=40.0, temperature=0.0)
    data["request"] = flat
    data.update(host="ct129", suite="humaneval", mode="offline", prompts=3)
    (rec.folder / "run.json").write_text(json.dumps(data))
    again = RunRecord.load(rec.folder)
    assert again.settings == EvalSettings(suite="humaneval", prompts=3, ddtree="8,16", max_memory=40.0)
    assert again.request.drafter_ref == "v5:step_20000"


@pytest.mark.parametrize("damage, why", [
    (lambda d: d["shards"][0].update(index="0"), "'index' has the wrong type"),
    (lambda d: d["shards"][0].update(python=["/bin/sh", "-c", "x"]), "'python' has the wrong type"),
    (lambda d: d.update(status="exploded"), "'exploded' is not a valid State"),
    (lambda d: d["request"]["settings"].update(colour="red"), "unknown settings colour"),
    (lambda d: d.update(request=[]), "'request' is not an object"),
])
def test_a_damaged_record_is_refused_naming_the_file(tmp_path, damage, why):
    rec = record(tmp_path)
    data = json.loads((rec.folder / "run.json").read_text())
    damage(data)
    (rec.folder / "run.json").write_text(json.dumps(data))
    with pytest.raises(RunRecordError) as e:
        RunRecord.load(rec.folder)
    assert str(rec.folder / "run.json") in str(e.value) and why in str(e.value)


def test_cancel_marks_only_the_workers_it_stopped_and_stays(tmp_path):
    rec = record(tmp_path, hosts=("a", "b"))
    rec.started()
    before = RunRecord.load(rec.folder)                    # e.g. the `eval` that follows the run
    rec.shards[0].state = State.DONE                       # finished, not fetched yet
    rec.cancelled([1])
    assert [s.state for s in rec.shards] == [State.DONE, State.CANCELLED] and rec.status is State.CANCELLED
    assert before.settle() == "cancelled" and RunRecord.load(rec.folder).status is State.CANCELLED   # a cancel stays


def test_runs_shows_the_workers_progress_before_results_come_back(tmp_path):
    rec = record(tmp_path, hosts=("a", "b"), prompts=12)
    rec.started()
    rec.shard_progressed(0, {"event": "start", "prompts": 6, "done": 0})
    rec.shard_progressed(1, {"event": "start", "prompts": 6, "done": 2})
    rec.shard_progressed(0, {"event": "prompt", "done": 3, "prompts": 6})
    (row,) = run_rows([load_run(rec.folder)])
    assert (row["prompts"], row["prompts_planned"], row["status"]) == (5, 12, "running")
    assert row["settings"] == "greedy, 256 tok, think off"      # from the request until env.json is back


def test_concurrent_saves_of_one_record_do_not_collide(tmp_path):
    rec = record(tmp_path, hosts=("a", "b", "c", "d"))
    errors = []

    def hammer(i):
        try:
            for k in range(100):
                rec.shard_progressed(i, {"event": "prompt", "done": k, "prompts": 100})
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and RunRecord.load(rec.folder).progress == (396, 400)
    assert [p.name for p in rec.folder.iterdir()] == ["run.json"]      # no temporary file left


def test_states_that_end_and_states_that_do_not():
    assert {s for s in State if s.is_terminal()} == {State.DONE, State.FAILED, State.CANCELLED, State.LOST,
                                                    State.MISSING}
    assert json.dumps({"s": State.RUNNING}) == '{"s": "running"}' and f"{State.DONE}" == "done"


def test_runs_started_in_the_same_second_get_their_own_ids_and_folders(tmp_path, monkeypatch):
    """Two terminals (or a sweep script) start the same eval in the same second: each run gets an
    id of its own, claimed atomically (8 threads at once), so no run's folder is shared."""
    import orchestrator.runs.record as record_mod

    when = datetime(2026, 12, 2, 21, 1, 30)
    monkeypatch.setattr(record_mod, "run_id", lambda *a: run_id(*a, when=when))
    records, barrier = [], threading.Barrier(8)

    def create() -> None:
        barrier.wait()
        records.append(RunRecord.create(tmp_path / "runs", EvalRequest(hosts=["ct129"]), "v5", "step_20000",
                                        20000))
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


BAD_FIELDS = [("status", 3), ("shards", [{"host": "local", "index": "0", "count": 1}]),
              ("shards", [{"host": "local", "index": 1, "count": 1}]), ("request", {"hosts": "local"}),
              ("request", {"hosts": ["local"], "settings": {"prompts": "2"}}), ("cancels", None),
              ("shards", [{"host": "local", "index": 0, "count": 1, "exit_code": "0"}])]


def write_run(runs: Path, home: Path, **over) -> Path:
    """A run.json as `eval` writes it for the local host (workdir ``home``), with fields overridden."""
    record = RunRecord.create(runs, EvalRequest(hosts=["local"], drafter_ref="embedded"), "embedded", None)
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
    (evil / "remote" / "host").mkdir(parents=True)
    marker = tmp_path / "ran"
    (evil / "remote" / "__init__.py").write_text("")
    (evil / "remote" / "host" / "__init__.py").write_text("")
    (evil / "remote" / "host" / "launch.py").write_text(f"open({str(marker)!r}, 'a').write('launch\\n')\n")
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
