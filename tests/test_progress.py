"""The eval progress display: the phase a worker is in, the τ the summary leads with (τ macro),
and what is true when the user presses Ctrl-C (running, finished but not fetched, fetched)."""
from __future__ import annotations

import io

from rich.console import Console

from orchestrator.cli.evals import _Progress
from orchestrator.runs.record import EvalRequest, RunRecord


def progress(tmp_path, hosts=("ct129",)):
    record = RunRecord.create(tmp_path, EvalRequest(hosts=list(hosts)), "v5", "step_20000", 20000)
    return record, _Progress(record, Console(file=io.StringIO(), width=80))


def fields(p: _Progress, i: int = 0) -> dict:
    return p.bars.tasks[p.tasks[i]].fields


def test_phases_and_the_macro_tau(tmp_path):
    _, p = progress(tmp_path)
    assert fields(p)["phase"] == "waiting"
    p.on_event(0, {"event": "phase", "phase": "loading target"})
    assert fields(p)["phase"] == "loading target"
    p.on_event(0, {"event": "start", "prompts": 2, "done": 0})
    assert fields(p)["phase"] == "drafting"
    p.on_event(0, {"event": "prompt", "id": "a", "done": 1, "cycles": 10, "tau": 2.0})
    p.on_event(0, {"event": "prompt", "id": "b", "done": 2, "cycles": 1, "tau": 6.0})
    assert fields(p)["tau"] == "4.00"        # the mean of per-prompt τ, not the pooled 12/11 tokens per cycle
    p.on_event(0, {"event": "exit", "state": "done"})
    assert fields(p)["phase"] == "finished"


def test_ctrl_c_says_what_is_true(tmp_path):
    record, p = progress(tmp_path, hosts=("ct129", "ct130"))
    p.on_event(0, {"event": "prompt", "id": "a", "done": 1, "cycles": 10, "tau": 2.0})
    said = p.interrupted()
    assert said.startswith("Detached. The worker keeps running on ct129 (1 prompt done), ct130 (0 prompts done).")
    assert f"dflash-ops attach {record.id}" in said
    for i in (0, 1):
        p.on_event(i, {"event": "exit", "state": "done"})
    said = p.interrupted()
    assert "keeps running" not in said and "had already finished" in said and "not fetched yet" in said
    for i in (0, 1):
        record.shards[i].fetched = True
    assert p.interrupted().startswith(f"Interrupted after the results were fetched into {record.folder}")


def test_the_progress_line_fits_80_columns(tmp_path):
    record, p = progress(tmp_path)
    p.on_event(0, {"event": "start", "prompts": 12, "done": 0})
    p.on_event(0, {"event": "prompt", "id": "a-rather-long-prompt-id-from-a-suite", "done": 12, "cycles": 10,
                   "tau": 2.0})
    with p.bars:
        pass
    line = p.bars.console.file.getvalue().strip()
    assert len(line) <= 80 and "12/12" in line and "τ macro 2.00" in line and "0:00:0" in line, line
