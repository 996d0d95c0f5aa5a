"""Cancel, resume and fetch of real runs on the built-in `local` host (embedded demo pair):
cancel stops only what still runs (a finished run stays done, and is fetched), a cancel during
`eval --resume`'s pre-flight wins over the resume, and result files that do not come back leave
the shard unfetched with one clear line; a resume refuses a changed target unless `--force`, which
is recorded."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAST = ("--drafter", "embedded", "--max-new-tokens", "8", "--ddtree", "")


def cli(home: Path, runs: Path, *args: str, popen: bool = False):
    env = {**os.environ, "DFLASH_OPS_HOME": str(home), "DFLASH_OPS_RUNS": str(runs), "COLUMNS": "160"}
    env.pop("DFLASH_OPS_INVENTORY", None)
    argv = [sys.executable, "-m", "orchestrator.cli", *args]
    if popen:
        return subprocess.Popen(argv, cwd=home, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(argv, cwd=home, env=env, capture_output=True, text=True, timeout=600)


def detached(home: Path, runs: Path, prompts: int) -> str:
    proc = cli(home, runs, "eval", "--host", "local", *FAST, "--prompts", str(prompts), "--detach", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)["id"]


def wait_for(predicate, timeout: float = 300, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def run_json(runs: Path, rid: str) -> dict:
    return json.loads((runs / rid / "run.json").read_text())


def test_cancel_of_a_finished_run_keeps_it_done_and_fetches_it(local_home, tmp_path):
    home = local_home
    """A detached run whose worker finished: `cancel` stops nothing, fetches its results and the
    run stays done (with its prompt), in `runs` too; a second cancel changes nothing either."""
    runs = tmp_path / "runs"
    rid = detached(home, runs, 1)
    wait_for(lambda: (home / "runs" / rid / "exit_code").exists(), what="the worker to finish")
    for _ in range(2):
        proc = cli(home, runs, "cancel", rid)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert run_json(runs, rid)["status"] == "done"
        assert f"run {rid}: done (nothing was running; nothing was cancelled)" in proc.stdout, proc.stdout
    assert len((runs / rid / "results.jsonl").read_text().splitlines()) == 1
    assert (runs / rid / "report.html").exists()
    (row,) = json.loads(cli(home, runs, "runs", "--json").stdout)
    assert row["status"] == "done" and row["prompts"] == 1


def test_a_cancel_during_a_resumes_preflight_wins(local_home, tmp_path):
    home = local_home
    """`eval --resume RUN` is in its pre-flight when `cancel RUN` comes: the cancel is what
    holds; the resume starts no worker, says so, and the run stays cancelled."""
    runs = tmp_path / "runs"
    rid = detached(home, runs, 2)
    assert cli(home, runs, "cancel", rid).returncode == 0
    assert run_json(runs, rid)["status"] == "cancelled"
    pid_before = (home / "runs" / rid / "pid").read_text()
    config = home / "embedded" / "target" / "config.json"       # a full pre-flight, nothing kept from the start:
    config.write_text(config.read_text() + "\n")                 # the target's content differs (not its meaning)
    resume = cli(home, runs, "eval", "--resume", rid, popen=True)
    try:
        def preflight_of_this_run(cmdline: bytes) -> bool:      # not another test's, running alongside
            text = cmdline.decode(errors="replace")
            return "remote.preflight" in text and str(home) in text
        wait_for(lambda: any(preflight_of_this_run(_cmdline(p)) for p in Path("/proc").glob("[0-9]*/cmdline")),
                 what="the resume's pre-flight")
        cancel = cli(home, runs, "cancel", rid)
        out, _ = resume.communicate(timeout=600)
    finally:
        if resume.poll() is None:
            resume.kill()
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    assert resume.returncode == 1 and "was cancelled while `eval --resume` prepared it" in out, out
    assert "Traceback" not in out
    assert run_json(runs, rid)["status"] == "cancelled"
    assert (home / "runs" / rid / "pid").read_text() == pid_before          # no worker was started again


def _cmdline(p: Path) -> bytes:
    try:
        return p.read_bytes()
    except OSError:         # the process ended meanwhile
        return b""


def test_result_files_that_do_not_come_back_leave_the_shard_unfetched(local_home, tmp_path):
    home = local_home
    """The worker finished but its summary is not there to fetch: `attach` says which file did
    not come and how to fetch again (exit 4), the run stays running, not done; once the file is
    back, `attach` fetches and reports it."""
    runs = tmp_path / "runs"
    rid = detached(home, runs, 1)
    host_run = home / "runs" / rid
    wait_for(lambda: (host_run / "exit_code").exists(), what="the worker to finish")
    (host_run / "out" / "summary.json").rename(host_run / "summary.json.away")
    proc = cli(home, runs, "attach", rid)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4 and "Traceback" not in out, out
    assert "could not fetch summary.json" in out and f"dflash-ops attach {rid}" in out, out
    record = run_json(runs, rid)
    assert record["status"] == "running" and record["shards"][0]["fetched"] is False
    (host_run / "summary.json.away").rename(host_run / "out" / "summary.json")
    proc = cli(home, runs, "attach", rid)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert run_json(runs, rid)["status"] == "done" and (runs / rid / "summary.json").exists()


def test_a_resume_refuses_a_changed_target_and_force_resumes_recording_it(local_home, tmp_path):
    home = local_home
    """A run whose worker died after its first prompt, its target's config.json then changed:
    `eval --resume` refuses naming it (the identity the worker recorded in env.json against the
    one pre-flight finds now); `--force` resumes, and run.json, env.json and the report say so."""
    import signal

    runs = tmp_path / "runs"
    rid = detached(home, runs, 4)
    host_run = home / "runs" / rid
    wait_for(lambda: '"event": "prompt"' in _text(host_run / "events.jsonl"), what="the first prompt")
    os.killpg(int((host_run / "pid").read_text().split()[0]), signal.SIGKILL)
    wait_for(lambda: (host_run / "exit_code").exists(), what="the worker's end")
    env = json.loads((host_run / "out" / "env.json").read_text())
    assert len(env["target"]["identity"]["config_sha256"]) == 64 and env["target"]["identity"]["weights"]
    config = home / "embedded" / "target" / "config.json"
    text = config.read_text()
    try:
        config.write_text(text.replace("{", '{"dflash_ops_test": 1, ', 1))
        proc = cli(home, runs, "eval", "--resume", rid)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1 and "Traceback" not in out, out
        assert f"the target in {config.parent} on local changed since its" in out and "config.json: sha256" in out, out
        assert f"dflash-ops eval --resume {rid} --force" in out
        proc = cli(home, runs, "eval", "--resume", rid, "--force")
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "--force: resumed although the target of local changed" in out, out
    finally:
        config.write_text(text)
    forced = run_json(runs, rid)["forced"]
    assert [f["what"] for f in forced] == ["target"] and run_json(runs, rid)["status"] == "done"
    assert json.loads((runs / rid / "env.json").read_text())["forced"] == forced
    assert "resumed with --force" in (runs / rid / "report.md").read_text()
    assert len((runs / rid / "results.jsonl").read_text().splitlines()) == 4


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""
