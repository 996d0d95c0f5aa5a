"""run.json: one reader and writer (orchestrator/runs/record.py), one settings value inside it, the
state vocabulary, and the transitions that `cancel` and a followed worker make."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from orchestrator.runs.folders import load_run, run_rows
from orchestrator.runs.record import EvalRequest, RunRecord, RunRecordError
from remote.settings import EvalSettings
from remote.states import State


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


def test_cancel_marks_only_the_workers_it_stopped(tmp_path):
    rec = record(tmp_path, hosts=("a", "b"))
    rec.started()
    rec.shards[0].state = State.DONE                       # finished, not fetched yet
    rec.cancelled({0: {"state": "done", "exit_code": 0}, 1: {"state": "failed", "exit_code": -15, "cancelled": True}})
    assert [s.state for s in rec.shards] == [State.DONE, State.CANCELLED] and rec.status is State.CANCELLED
    done = record(tmp_path / "2")
    done.started()
    done.shard_exited(0, {"state": "done", "exit_code": 0})
    done.shard_fetched(0)
    done.settle()
    done.cancelled({0: {"state": "done", "exit_code": 0}})
    assert done.status is State.DONE and done.shards[0].state is State.DONE   # a finished run stays done


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
    assert not list(rec.folder.glob("*.tmp"))


def test_states_that_end_and_states_that_do_not():
    assert {s for s in State if s.is_terminal()} == {State.DONE, State.FAILED, State.CANCELLED, State.LOST,
                                                    State.MISSING}
    assert json.dumps({"s": State.RUNNING}) == '{"s": "running"}' and f"{State.DONE}" == "done"
