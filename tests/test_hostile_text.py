"""Everything a host sends is data: rich markup in a prompt id, escape sequences in worker events
(window title, clipboard, clear screen) and non-UTF-8 bytes in a worker's log reach the terminal
as plain text, and never crash the display or the failure report."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from orchestrator.cli import console
from orchestrator.cli.evals import _Progress
from orchestrator.runs.record import EvalRequest, RunRecord

HOSTILE = "[/x] \x1b]0;owned\x07\x1b]52;c;ZXZpbA==\x07\x1b[2J\x9b31m\r"
REPO = Path(__file__).resolve().parents[1]


def plain_console() -> Console:
    return Console(file=io.StringIO(), width=160, force_terminal=False, color_system=None, highlight=False)


def assert_inert(text: str) -> None:
    assert not any(c in text for c in "\x1b\x07\x9b\r"), repr(text)


def test_the_progress_display_shows_hostile_event_text_as_text(tmp_path):
    """A prompt id `[/x]` was a MarkupError that ended the display (and every `attach` after);
    a phase or a state with escape sequences went to the terminal raw. Malformed events are
    skipped."""
    record = RunRecord.create(tmp_path, EvalRequest(hosts=["ct129"]), "v5", "step_20000", 20000)
    out = plain_console()
    progress = _Progress(record, out)
    with progress.bars:
        for ev in ({"event": "phase", "phase": HOSTILE}, {"event": "start", "prompts": 2, "done": 0},
                   {"event": "prompt", "id": HOSTILE, "cycles": 3, "tau": 2.5, "done": 1},
                   {"event": "prompt", "id": "p2", "cycles": "[b]", "tau": "x", "done": "2"},     # malformed
                   {"event": "prompt"}, {"event": "exit", "state": HOSTILE}):
            progress.on_event(0, ev)
        progress.bars.refresh()
    shown = out.file.getvalue()
    assert_inert(shown)
    assert "[/x]" in shown and "]0;owned" in shown, shown


def test_tables_and_error_lines_strip_control_characters(capsys):
    out = plain_console()
    out.print(console.table(HOSTILE, ["id", HOSTILE], [[HOSTILE, "1"]]))
    out.print(console.table(None, ["id", "v"], [["a" * 150 + HOSTILE, "1"]]))         # too wide: a list
    assert_inert(out.file.getvalue())
    assert out.file.getvalue().count("[/x]") == 4
    console.error_line(f"host eval: could not start the worker: {HOSTILE}")
    console.warning_line(HOSTILE)
    err = capsys.readouterr().err
    assert_inert(err)
    assert "could not start the worker: [/x]" in err


def test_a_failed_workers_log_with_any_bytes_is_reported(tmp_path):
    """A worker log holding a byte that is not UTF-8 made the failure report a UnicodeDecodeError
    traceback; its last lines are shown (the bytes replaced), here and from the host."""
    from orchestrator.eval.jobs import HostJob
    from orchestrator.eval.pipeline import failed_logs
    from orchestrator.transport.local import LocalRunner

    record = RunRecord.create(tmp_path / "runs", EvalRequest(hosts=["local"]), "v5", None)
    host_dir = tmp_path / "host"
    host_dir.mkdir()
    log = b"loading\n\xff\xfe broken \x1b[2J bytes\nTraceback: boom\n"
    (host_dir / "worker.log").write_bytes(log)
    record.shard_exited(0, {"state": "failed", "exit_code": 1})
    record.shards[0].fetched = True
    jobs = {0: HostJob(LocalRunner(), sys.executable, str(REPO), str(host_dir))}
    assert failed_logs(record, jobs)["local"].endswith("Traceback: boom")           # from the host
    (record.folder / "worker.log").write_bytes(log)
    tail = failed_logs(record, jobs)["local"]                                      # fetched here
    assert "\ufffd\ufffd broken" in tail and tail.endswith("Traceback: boom")
    out = plain_console()
    out.print(console.safe(tail))
    assert_inert(out.file.getvalue())


def test_an_eval_whose_prompt_ids_carry_markup_and_escapes_runs_to_its_end(local_home, tmp_path):
    """The whole path on the `local` host: a suite whose prompt id is markup and escape
    sequences; the eval follows, finishes and reports; no escape sequence reaches the output."""
    suite = tmp_path / "hostile.jsonl"
    suite.write_text(json.dumps({"id": HOSTILE, "prompt": "Say hello."}) + "\n")
    env = {**os.environ, "DFLASH_OPS_HOME": str(local_home), "DFLASH_OPS_RUNS": str(tmp_path / "runs"),
           "COLUMNS": "160"}
    env.pop("DFLASH_OPS_INVENTORY", None)
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "eval", "--host", "local", "--drafter",
                           "embedded", "--suite", str(suite), "--prompts", "1", "--max-new-tokens", "8", "--ddtree", ""],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert_inert(out)
    assert "[/x]" in out and "Traceback" not in out


def test_a_suite_that_is_not_utf8_is_one_line_before_anything_starts(local_home, tmp_path):
    """This machine's suite file is read (and hashed) when the run is planned: a byte that is not
    UTF-8 is one line naming the file, line and column, exit 2, and no run folder is made."""
    suite = tmp_path / "latin1.jsonl"
    suite.write_bytes(json.dumps({"id": "a", "prompt": "caf"}).encode()[:-2] + b"\xe9\"}\n")
    env = {**os.environ, "DFLASH_OPS_HOME": str(local_home), "DFLASH_OPS_RUNS": str(tmp_path / "runs")}
    env.pop("DFLASH_OPS_INVENTORY", None)
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "eval", "--host", "local", "--drafter",
                           "embedded", "--suite", str(suite), "--prompts", "1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == f"error: {suite}: line 1, column 27: not UTF-8 text (byte 0xe9); save the suite as UTF-8"
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
