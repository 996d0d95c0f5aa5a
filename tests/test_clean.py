"""`dflash-ops clean` (issue 41, space) on the built-in `local` host and on the SSH lab's eval host,
with fake run folders (tests/fakeruns.py) beside real ones where it matters (a shipped worker, a job
that really runs under remote/host/launch.py): what is listed and why, nothing deleted without
--yes (or a "y" typed at its prompt), --yes deletes exactly what was listed, a running run's folder
and code are never listed, a link planted in place of a folder is removed as a link, and a fetch
brings only the last part of a long worker log."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from clirun import REPO, lab_cli
from fakeruns import make_run

OLD = 3 * 3600        # s: older than clean's grace for code folders and claimed run folders


def age(path: Path, seconds: float = OLD) -> None:
    """``path`` and everything in it (links themselves) modified ``seconds`` ago."""
    when = os.path.getmtime(path) - seconds if path.exists() else None
    for d, dirs, files in os.walk(path):
        for n in dirs + files:
            os.utime(os.path.join(d, n), (when, when), follow_symlinks=False)
    os.utime(path, (when, when), follow_symlinks=False)


def cli(home: Path, runs: Path, *args: str, stdin=None) -> subprocess.CompletedProcess:
    """`dflash-ops` on the built-in `local` host with workdir ``home`` (no inventory, no catalog)."""
    env = {**os.environ, "DFLASH_OPS_HOME": str(home), "DFLASH_OPS_RUNS": str(runs), "COLUMNS": "400"}
    for name in ("DFLASH_OPS_INVENTORY", "DFLASH_OPS_CATALOG"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=home, env=env, text=True,
                          capture_output=True, timeout=120, stdin=stdin)


def listed(proc: subprocess.CompletedProcess) -> dict[str, dict]:
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    return {i["path"]: i for i in json.loads(proc.stdout)["items"]}


def host_run(workdir: Path, rid: str, code: str | None, drafter: str = "/nowhere") -> Path:
    """A finished job's folder on a host, as remote/host/launch.py leaves it."""
    folder = workdir / "runs" / rid
    (folder / "out").mkdir(parents=True)
    (folder / "out" / "results.jsonl").write_text("{}\n" * 500)
    (folder / "worker.log").write_text("loading\n" * 100)
    (folder / "cmd.json").write_text(json.dumps({"argv": [sys.executable, "-m", "remote.worker", "--drafter", drafter],
                                                 "cwd": code}))
    (folder / "exit_code").write_text("0\n")
    return folder


def record(runs: Path, rid: str, host: str, workdir: Path, code: str, status: str = "done",
           fetched: bool | None = None, drafter: str = "") -> Path:
    """A run here whose shard names the folders eval uses on ``host``."""
    folder = make_run(runs, rid, host=host, status=status, prompts=2)
    raw = json.loads((folder / "run.json").read_text())
    raw["shards"][0].update(run_dir=f"{workdir}/runs/{rid}", code_dir=code, python=sys.executable,
                            drafter_path=drafter, **({} if fetched is None else {"fetched": fetched}))
    (folder / "run.json").write_text(json.dumps(raw))
    return folder


def fake_code(workdir: Path, digest: str, old: bool = True) -> str:
    folder = workdir / "code" / digest
    (folder / "remote").mkdir(parents=True)
    (folder / "remote" / "worker.py").write_text("x = 1\n" * 1000)
    (folder / "preflight").mkdir()
    (folder / "preflight" / "pass.json").write_text("{}")
    if old:
        age(folder)
    return str(folder)


def launch(runner, python: str, code: str, run_dir: str, *argv: str) -> None:
    """A job that runs (a sleep) started by the shipped remote/host/launch.py, as eval starts its worker."""
    res = runner.run([python, "-m", "remote.host.launch", "start", run_dir, "--cwd", code, "--", python, "-c",
                      "import time; time.sleep(120)", *argv], env={"PYTHONPATH": code}, cwd=code, timeout=60)
    assert res.ok, res.stderr


def stop(runner, python: str, code: str, run_dir: str) -> None:
    runner.run([python, "-m", "remote.host.launch", "cancel", run_dir], env={"PYTHONPATH": code}, cwd=code, timeout=60)


def test_clean_on_local_lists_why_deletes_only_with_yes_and_never_what_a_live_run_needs(tmp_path):
    from orchestrator.eval.ship import ship
    from orchestrator.transport.local import LocalRunner

    home, runs = tmp_path / "home", tmp_path / "runs"
    home.mkdir()
    runner = LocalRunner()
    current = ship(runner, sys.executable, str(home))
    live_code = str(home / "code" / "bbbbbbbbbbbbbbbb")
    shutil.copytree(current, live_code)
    age(Path(live_code))
    fetched_code = fake_code(home, "aaaaaaaaaaaaaaaa")     # only the done, fetched run was started from it
    unused = fake_code(home, "eeeeeeeeeeeeeeee")
    resumable_code = fake_code(home, "cccccccccccccccc")
    foreign_code = fake_code(home, "dddddddddddddddd")
    fresh = fake_code(home, "ffffffffffffffff", old=False)

    done = host_run(home, "20260101-000001-done-local", fetched_code)
    record(runs, done.name, "local", home, fetched_code)
    failed = host_run(home, "20260101-000003-failed-local", resumable_code)
    record(runs, failed.name, "local", home, resumable_code, status="failed", fetched=True)
    foreign = host_run(home, "20260101-000004-foreign-local", foreign_code)      # no run here knows it
    damaged = host_run(home, "20260101-000005-damaged-local", current)
    (record(runs, damaged.name, "local", home, current) / "results.jsonl").unlink()   # the host's is all there is
    running = home / "runs" / "20260101-000002-running-local"
    record(runs, running.name, "local", home, live_code, status="running")
    launch(runner, sys.executable, live_code, str(running))
    stopped = runs / "20260101-000006-stopped-local"       # an eval killed in its pre-flight
    stopped.mkdir()
    (stopped / ".lock").touch()
    age(stopped)
    (runs / "20260101-000007-preparing-local").mkdir()    # an eval in its pre-flight now
    try:
        before = listed(cli(home, runs, "clean", "--json"))
        assert set(before) == {str(done), fetched_code, unused, str(stopped)}, before
        assert before[str(done)]["why"] == "the run is done; its files are fetched here" and before[str(done)]["size"] > 1500
        assert "ships " + Path(current).name in before[unused]["why"] and "pre-flight cache" in before[unused]["why"]
        assert "eval stopped in its pre-flight" in before[str(stopped)]["why"]

        shown = cli(home, runs, "clean", stdin=subprocess.DEVNULL)         # not a terminal, no --yes: shown only
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert "nothing deleted (not a terminal: add --yes to delete them)" in shown.stdout
        assert all(Path(p).name in shown.stdout for p in before) and "4 item(s)" in shown.stdout
        assert "kept: 1 run folder(s) of live runs" in shown.stdout and "1 run folder(s) of failed or cancelled" in shown.stdout
        assert cli(home, runs, "clean", "--dry-run", "--yes").returncode == 0
        assert all(Path(p).exists() for p in before)

        gone = cli(home, runs, "clean", "--yes", "--host", "local")
        assert gone.returncode == 0, gone.stdout + gone.stderr
        assert "deleted 3 of 3 item(s) on local" in gone.stdout and "deleted 1 of 1 item(s) here" in gone.stdout
        assert not any(Path(p).exists() for p in before)
        kept = [current, live_code, resumable_code, foreign_code, fresh, running, failed, foreign, damaged,
                runs / done.name, runs / "20260101-000007-preparing-local"]
        assert all(Path(p).exists() for p in kept), [p for p in kept if not Path(p).exists()]
        assert (running / ".job.lock").exists()
        attach = cli(home, runs, "attach", done.name)     # its host folder and its code went: it stays done
        assert attach.returncode == 0, attach.stdout + attach.stderr
        assert "is gone; the results fetched before are kept as they are" in attach.stdout
        assert json.loads((runs / done.name / "run.json").read_text())["status"] == "done"
    finally:
        stop(runner, sys.executable, live_code, str(running))


def test_a_link_in_place_of_a_folder_is_removed_as_a_link_never_followed(tmp_path):
    home, runs = tmp_path / "home", tmp_path / "runs"
    precious = tmp_path / "precious"
    for name in ("run", "code", "inside"):
        (precious / name).mkdir(parents=True)
        (precious / name / "keep.txt").write_text(name)
    linked_run = home / "runs" / "20260101-000001-linked-local"
    linked_run.parent.mkdir(parents=True)
    linked_run.symlink_to(precious / "run", target_is_directory=True)
    record(runs, linked_run.name, "local", home, "")
    done = host_run(home, "20260101-000002-done-local", None)
    (done / "out" / "model").symlink_to(precious / "inside", target_is_directory=True)
    record(runs, done.name, "local", home, "")
    (home / "code").mkdir()
    (home / "code" / "0123456789abcdef").symlink_to(precious / "code", target_is_directory=True)
    age(home / "code" / "0123456789abcdef")

    items = listed(cli(home, runs, "clean", "--json"))
    assert set(items) == {str(linked_run), str(done), str(home / "code" / "0123456789abcdef")}, items
    assert "a link in place of the folder: removed as a link" in items[str(linked_run)]["why"]
    proc = cli(home, runs, "clean", "--yes")
    assert proc.returncode == 0 and "deleted 3 of 3" in proc.stdout, proc.stdout + proc.stderr
    assert not os.path.lexists(linked_run) and not done.exists() and not os.path.lexists(home / "code" / "0123456789abcdef")
    assert sorted(p.read_text() for p in precious.glob("*/keep.txt")) == ["code", "inside", "run"]


def test_the_host_tool_refuses_a_link_on_the_way_and_a_folder_a_job_runs_in(tmp_path):
    """remote/host/clean.py alone: a link in place of `runs` is not walked through, and a run
    folder whose job holds its lock is not removed (checked again at the moment of removal)."""
    import fcntl

    from orchestrator.clean import host_tool

    workdir, elsewhere = tmp_path / "workdir", tmp_path / "elsewhere"
    (elsewhere / "20260101-x").mkdir(parents=True)
    (elsewhere / "20260101-x" / "keep.txt").write_text("keep")
    workdir.mkdir()
    (workdir / "runs").symlink_to(elsewhere, target_is_directory=True)
    busy = tmp_path / "w2" / "runs" / "busy"
    busy.mkdir(parents=True)
    (busy / ".start.lock").touch()
    holder = os.open(busy / ".job.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)

    def tool(*args):
        proc = subprocess.run([sys.executable, "-c", host_tool(), *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)
    try:
        scan = tool("scan", str(workdir))
        assert scan["runs"] == [] and "a link or not a folder: not followed" in scan["problems"][0]
        [res] = tool("delete", str(workdir), json.dumps([["run", str(workdir), "runs/20260101-x"]]))
        assert not res["ok"] and "a link or not a folder on the way" in res["why"]
        assert (elsewhere / "20260101-x" / "keep.txt").exists()
        w2 = str(tmp_path / "w2")
        assert tool("scan", w2)["runs"][0]["jobs"][0]["running"] is True
        [res] = tool("delete", w2, json.dumps([["run", w2, "runs/busy"]]))
        assert not res["ok"] and res["why"] == "a job runs in it now" and busy.exists()
        [res] = tool("delete", w2, json.dumps([["run", w2, "runs/../runs/busy"]]))
        assert not res["ok"] and "not a plain relative path" in res["why"]
    finally:
        os.close(holder)


def test_clean_at_its_prompt_deletes_only_on_yes(tmp_path):
    home, runs = tmp_path / "home", tmp_path / "runs"
    home.mkdir()
    unused = fake_code(home, "eeeeeeeeeeeeeeee")
    for answer, gone in (("n\n", False), ("y\n", True)):
        master, slave = os.openpty()
        os.write(master, answer.encode())
        proc = cli(home, runs, "clean", stdin=slave)
        os.close(slave)
        os.close(master)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "delete these 1 item(s)?" in proc.stderr
        assert os.path.exists(unused) is not gone, proc.stdout
        assert ("deleted 1 of 1 item(s) on local" in proc.stdout) is gone
        assert ("nothing deleted (not confirmed)" in proc.stdout) is not gone


# ----------------------------------------------------------------------------- the SSH lab


@pytest.fixture
def lab_project(ssh_lab, tmp_path, monkeypatch):
    """The lab's hosts with folders of this test's own (workdirs, checkpoints roots, the `local`
    host's workdir) and an unreachable third host; a catalog with training run v7 (on the training
    host: step_200) and a drafter pinned to one of the eval host's copies; a watch of v7 busy with
    step_300."""
    roots = {h: {"workdir": str(tmp_path / h / "workdir"), "checkpoints": str(tmp_path / h / "checkpoints")}
             for h in ("train", "eval")}
    monkeypatch.setenv("DFLASH_OPS_HOME", str(tmp_path / "local"))
    src = tmp_path / "train" / "checkpoints" / "v7" / "step_200"
    src.mkdir(parents=True)
    (src / "model.safetensors").write_bytes(b"w" * 1000)
    copies = tmp_path / "eval" / "checkpoints" / "v7"
    for name in ("step_100", "step_150", "step_175", "step_200", "step_300"):     # step_200 is still there
        (copies / name).mkdir(parents=True)
        (copies / name / "model.safetensors").write_bytes(b"w" * 4096)
    catalog = tmp_path / "drafters.yaml"
    catalog.write_text(yaml.safe_dump({"runs": {"v7": {"dir": "v7"}},
                                       "drafters": {"v7": {"run": "v7", "format": "zlab"},
                                                    "pinned": {"path": str(copies / "step_150"), "format": "zlab"}}}))
    watch = tmp_path / "runs" / "watch-v7"
    watch.mkdir(parents=True)
    (watch / "state.json").write_text(json.dumps({"run": "v7", "settings": {}, "points": {
        "step_300": {"name": "step_300", "step": 300, "status": "evaluating"}}}))
    inventory = ssh_lab.write_inventory(tmp_path / "inventory.yaml", **roots, extra={"down": {
        "address": "127.0.0.1", "port": 9, "roles": ["eval"], "workdir": "/w", "identity": str(ssh_lab.client_key),
        "known_hosts": str(ssh_lab.known_hosts)}})
    return {"base": tmp_path, "catalog": catalog, "inventory": inventory, "lab": ssh_lab,
            "workdir": tmp_path / "eval" / "workdir", "copies": copies}


def test_clean_on_the_ssh_lab_eval_host(lab_project, tmp_path):
    from orchestrator.config.inventory import load_inventory
    from orchestrator.transport import runner_for

    workdir, ckpts = lab_project["workdir"], lab_project["copies"]
    runs = tmp_path / "runs"
    inventory = load_inventory(lab_project["inventory"])
    with runner_for(inventory.get("eval"), inventory) as runner:
        from orchestrator.eval.ship import ship

        code = ship(runner, sys.executable, str(workdir))
        old = fake_code(workdir, "0123456789abcdef")
        done = host_run(workdir, "20260101-000001-v7-eval", old)
        record(runs, done.name, "eval", workdir, old)
        running = workdir / "runs" / "20260101-000002-v7-eval"
        launch(runner, sys.executable, code, str(running), "--drafter", str(ckpts / "step_175"))
        try:
            proc = lab_cli(lab_project, "clean", "--json", "--yes", runs=runs)
            report = json.loads(proc.stdout)
            items = listed(proc)
            assert set(items) == {str(done), old, str(ckpts / "step_100")}, items
            assert items[str(ckpts / "step_100")]["why"] == ("train no longer has v7/step_100; no catalog drafter or "
                                                             "watch uses it")
            assert items[str(ckpts / "step_100")]["size"] >= 4096
            assert "connection refused" in report["skipped"]["down"]         # not named: skipped, not a failure
            notes = "\n".join(report["notes"])
            assert f"eval: kept {ckpts / 'step_150'} (not on train any more): catalog drafter pinned uses it" in notes
            assert "step_300 (not on train any more): watch v7 uses it" in notes
            assert "step_175 (not on train any more): a job running on the host uses it" in notes
            assert report["deleted"] == [{"place": "eval", "freed": sum(i["size"] for i in items.values()),
                                          "removed": 3, "failed": []}]
            assert not any(Path(p).exists() for p in items)
            assert sorted(p.name for p in ckpts.iterdir()) == ["step_150", "step_175", "step_200", "step_300"]
            assert running.exists() and Path(code).exists() and (runs / done.name / "results.jsonl").exists()
            named = lab_cli(lab_project, "clean", "--host", "down", runs=runs)      # named: one line, and exit 1
            assert named.returncode == 1 and named.stderr.count("warning: down: skipped: host down (127.0.0.1:9): "
                                                                "connection refused") == 1, named.stdout + named.stderr
        finally:
            stop(runner, sys.executable, code, str(running))


def test_a_fetch_brings_only_the_last_part_of_a_long_worker_log(lab_project, tmp_path):
    """Before: every `attach` fetched the whole worker.log again (300 MB on a long run)."""
    from orchestrator.config.inventory import load_inventory
    from orchestrator.eval.jobs import LOG_CAP, HostJob
    from orchestrator.transport import runner_for

    folder = host_run(lab_project["workdir"], "20260101-000003-v7-eval", None)
    line = b"prompt 12345: still decoding, nothing wrong here\n"
    with open(folder / "worker.log", "wb") as f:
        f.write(line * (3 * LOG_CAP // len(line)) + b"the last line\n")
    whole = (folder / "worker.log").stat().st_size
    inventory = load_inventory(lab_project["inventory"])
    with runner_for(inventory.get("eval"), inventory) as runner:
        HostJob(runner, sys.executable, str(REPO), str(folder)).fetch(tmp_path / "here")
    log = (tmp_path / "here" / "worker.log").read_bytes()
    first, rest = log.split(b"\n", 1)
    assert LOG_CAP - len(line) <= len(rest) <= LOG_CAP and rest.endswith(b"the last line\n")
    assert rest.startswith(line) and (folder / "worker.log").read_bytes().endswith(rest)
    assert first.decode() == (f"[dflash-ops: the first {(whole - len(rest)) / 2**20:.1f} MiB of this log were not "
                              f"fetched; the whole log ({whole / 2**20:.1f} MiB) is eval:{folder}/worker.log]")


def test_the_pre_flight_refusing_for_lack_of_space_names_clean(tmp_path, monkeypatch):
    from orchestrator.config.inventory import builtin_local
    from orchestrator.eval.pipeline import EvalError, check_host_ready
    from orchestrator.runs.record import EvalRequest
    from orchestrator.transport.local import LocalRunner

    monkeypatch.setenv("DFLASH_OPS_HOME", str(tmp_path))
    with pytest.raises(EvalError) as e:
        check_host_ready(builtin_local(), LocalRunner(), EvalRequest(hosts=["local"], min_free_gb=1e9))
    assert f"GiB free in {tmp_path}" in str(e.value) and "`dflash-ops clean --host local` shows what can go" in str(e.value)
