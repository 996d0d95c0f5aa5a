"""`dflash-ops clean` (issue 41, space) on the built-in `local` host and on the SSH lab's eval host,
with fake run folders (tests/fakeruns.py) beside real ones where it matters (a shipped worker, a job
that really runs under remote/host/launch.py): what is listed and why, nothing deleted without
--yes (or a "y" typed at its prompt), --yes deletes exactly what was listed, a running run's folder
and code are never listed, a link planted in place of a folder is removed as a link, and a fetch
brings only the last part of a long worker log."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from clirun import REPO, lab_cli
from fakeruns import make_run
from waiting import finished, wait_for

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


def fake_code(workdir: Path, digest: str, old: bool = True, shipped: bool = True) -> str:
    """An older worker's folder as a ship leaves it (marked complete), or one it did not install."""
    folder = workdir / "code" / digest
    (folder / "remote").mkdir(parents=True)
    (folder / "remote" / "worker.py").write_text("x = 1\n" * 1000)
    (folder / "preflight").mkdir()
    (folder / "preflight" / "pass.json").write_text("{}")
    if shipped:
        (folder / ".complete").touch()
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

    items = listed(cli(home, runs, "clean", "--json"))       # a link in place of a code folder: no ship made it
    assert set(items) == {str(linked_run), str(done)}, items
    assert "a link in place of the folder: removed as a link" in items[str(linked_run)]["why"]
    proc = cli(home, runs, "clean", "--yes")
    assert proc.returncode == 0 and "deleted 2 of 2" in proc.stdout, proc.stdout + proc.stderr
    assert not os.path.lexists(linked_run) and not done.exists() and os.path.islink(home / "code" / "0123456789abcdef")
    assert sorted(p.read_text() for p in precious.glob("*/keep.txt")) == ["code", "inside", "run"]


def test_a_run_whose_log_was_fetched_in_part_says_so_and_its_header_follows_the_removal(tmp_path):
    """The host folder of a done run whose worker.log came home only in part is listed saying that
    the whole log exists only there; once removed, the fetched log's first line says so."""
    from orchestrator.eval.jobs import HostJob
    from orchestrator.transport.local import LocalRunner

    home, runs = tmp_path / "home", tmp_path / "runs"
    done = host_run(home, "20260101-000001-done-local", None)
    (done / "worker.log").write_text("".join(f"line {i}\n" for i in range(2000)))
    here = record(runs, done.name, "local", home, "")
    HostJob(LocalRunner(), sys.executable, str(REPO), str(done)).fetch_log("worker.log", here / "worker.log", cap=1000)
    items = listed(cli(home, runs, "clean", "--json"))
    assert items[str(done)]["why"] == (f"the run is done; its files are fetched here (its log only in part: the "
                                       f"whole one exists only there, local:{done}/worker.log)")
    proc = cli(home, runs, "clean", "--yes")
    assert proc.returncode == 0 and not done.exists(), proc.stdout + proc.stderr
    first = (here / "worker.log").read_text().splitlines()[0]
    assert re.fullmatch(rf"\[dflash-ops: the first .* of this log were not fetched; the whole log \(.*\) was "
                        rf"local:{re.escape(str(done))}/worker.log, removed by `dflash-ops clean` on \d{{4}}-\d\d-\d\d "
                        rf"\d\d:\d\d\]", first), first
    assert (here / "worker.log").read_text().endswith("line 1999\n")


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

    def tool(*args, items=()):
        proc = subprocess.run([sys.executable, "-c", host_tool(), *args], capture_output=True, text=True, timeout=60,
                              input="".join(json.dumps(i) + "\n" for i in items))
        assert proc.returncode == 0, proc.stderr
        return [json.loads(line) for line in proc.stdout.splitlines()] if items else json.loads(proc.stdout)
    try:
        scan = tool("scan", str(workdir))
        assert scan["runs"] == [] and "a link or not a folder: not followed" in scan["problems"][0]
        [res] = tool("delete", str(workdir), items=[["run", str(workdir), "runs/20260101-x"]])
        assert not res["ok"] and "a link or not a folder on the way" in res["why"]
        assert (elsewhere / "20260101-x" / "keep.txt").exists()
        w2 = str(tmp_path / "w2")
        assert tool("scan", w2)["runs"][0]["jobs"][0]["running"] is True
        first, second = tool("delete", w2, items=[["run", w2, "runs/busy"], ["run", w2, "runs/../runs/busy"]])
        assert not first["ok"] and first["why"] == "a job runs in it now" and busy.exists()
        assert not second["ok"] and "not a plain relative path" in second["why"]
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
    host's workdir) and an unreachable third host; a catalog with training run v7 and a drafter
    pinned to one of the eval host's copies; a watch of v7 busy with step_300. The copies are
    made by :func:`synced`."""
    roots = {h: {"workdir": str(tmp_path / h / "workdir"), "checkpoints": str(tmp_path / h / "checkpoints")}
             for h in ("train", "eval")}
    monkeypatch.setenv("DFLASH_OPS_HOME", str(tmp_path / "local"))
    copies = tmp_path / "eval" / "checkpoints" / "v7"
    catalog = tmp_path / "drafters.yaml"
    catalog.write_text(yaml.safe_dump({"runs": {"v7": {"dir": "v7", "settle": 0}},
                                       "drafters": {"v7": {"run": "v7", "format": "zlab"},
                                                    "pinned": {"path": str(copies / "step_150"), "format": "zlab"},
                                                    "best": {"path": str(copies / "best"), "format": "zlab"}}}))
    watch = tmp_path / "runs" / "watch-v7"
    watch.mkdir(parents=True)
    (watch / "state.json").write_text(json.dumps({"run": "v7", "settings": {}, "points": {
        "step_300": {"name": "step_300", "step": 300, "status": "evaluating"}}}))
    inventory = ssh_lab.write_inventory(tmp_path / "inventory.yaml", **roots, extra={"down": {
        "address": "127.0.0.1", "port": 9, "roles": ["eval"], "workdir": "/w", "identity": str(ssh_lab.client_key),
        "known_hosts": str(ssh_lab.known_hosts)}})
    return {"base": tmp_path, "catalog": catalog, "inventory": inventory, "lab": ssh_lab,
            "workdir": tmp_path / "eval" / "workdir", "copies": copies, "source": tmp_path / "train" / "checkpoints" / "v7"}


def synced(project: dict, names: tuple[str, ...], keep: tuple[str, ...] = ("step_200",)) -> None:
    """Checkpoints ``names`` of run v7 written on the training host and copied to the eval host by
    the real sync; then the training host rotates away all but ``keep``."""
    from orchestrator.config.catalog import load_catalog
    from orchestrator.config.inventory import load_inventory
    from orchestrator.sync import sync_checkpoint

    inv, cat = load_inventory(project["inventory"]), load_catalog(project["catalog"])
    for name in names:
        (project["source"] / name).mkdir(parents=True)
        (project["source"] / name / "model.safetensors").write_bytes(name.encode() * 1000)
        (project["source"] / name / "config.json").write_text("{}")
        sync_checkpoint(inv, cat, name, run="v7", dst_name="eval", progress=None)
    for name in names:
        if name not in keep:
            shutil.rmtree(project["source"] / name)


def paused_python(folder: Path, module: str) -> Path:
    """A host `python` that, started with ``-m MODULE``, writes ``folder/paused`` and waits (120 s
    at most) for ``folder/release`` first: a run held at that step."""
    folder.mkdir(parents=True, exist_ok=True)
    wrapper = folder / "python"
    wrapper.write_text(f"""#!/bin/sh
case " $* " in *" -m {module} "*)
  touch {folder}/paused; i=0
  while [ ! -e {folder}/release ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done;;
esac
exec {sys.executable} "$@"
""")
    wrapper.chmod(0o755)
    return wrapper


def test_clean_on_the_ssh_lab_eval_host(lab_project, tmp_path):
    """A copy is a candidate only when a sync made it there and nothing uses it, links resolved:
    a folder placed by hand (or copied from a sync's copy) and a checkpoint a catalog drafter names
    through a link are kept."""
    from orchestrator.config.inventory import load_inventory
    from orchestrator.transport import runner_for

    workdir, ckpts = lab_project["workdir"], lab_project["copies"]
    runs = tmp_path / "runs"
    synced(lab_project, ("step_100", "step_120", "step_150", "step_175", "step_200", "step_300"))
    (ckpts / "best").symlink_to(ckpts / "step_120", target_is_directory=True)   # catalog drafter `best`
    (ckpts / "step_90").mkdir()                                   # a fine-tuned variant placed by hand
    (ckpts / "step_90" / "model.safetensors").write_bytes(b"h" * 4096)
    subprocess.run(["cp", "-a", str(ckpts / "step_100"), str(ckpts / "step_110")], check=True)   # a copy of a copy
    inventory = load_inventory(lab_project["inventory"])
    with runner_for(inventory.get("eval"), inventory) as runner:
        from orchestrator.eval.ship import ship

        code = ship(runner, sys.executable, str(workdir))
        old = fake_code(workdir, "0123456789abcdef")
        unshipped = fake_code(workdir, "0123456789abcdee", shipped=False)     # no ship marked it complete
        done = host_run(workdir, "20260101-000001-v7-eval", old)
        record(runs, done.name, "eval", workdir, old)
        running = workdir / "runs" / "20260101-000002-v7-eval"
        launch(runner, sys.executable, code, str(running), "--drafter", str(ckpts / "step_175"))
        try:
            proc = lab_cli(lab_project, "clean", "--json", "--yes", runs=runs)
            report = json.loads(proc.stdout)
            items = listed(proc)
            assert set(items) == {str(done), old, str(ckpts / "step_100")}, items
            assert items[str(ckpts / "step_100")]["why"] == ("a sync made it; train no longer has v7/step_100; "
                                                             "nothing uses it")
            assert items[str(ckpts / "step_100")]["size"] >= 8000
            assert "connection refused" in report["skipped"]["down"]         # not named: skipped, not a failure
            notes = "\n".join(report["notes"])
            assert f"eval: kept {ckpts / 'step_150'} (not on train any more): used by catalog drafter pinned" in notes
            assert f"kept {ckpts / 'step_120'} (not on train any more): used by catalog drafter best" in notes
            assert "step_300 (not on train any more): used by watch v7" in notes
            assert "step_175 (not on train any more): used by a job running on the host (run 20260101-000002" in notes
            assert (f"kept 3 folder(s) of {ckpts} that train does not have and no sync made here (placed by hand, "
                    f"or copied): best, step_90, step_110") in notes, notes
            assert report["deleted"] == [{"place": "eval", "freed": sum(i["size"] for i in items.values()),
                                          "removed": 3, "failed": [], "left": [], "at_hand": None}]
            assert not any(Path(p).exists() for p in items)
            assert sorted(p.name for p in ckpts.iterdir() if not p.name.startswith(".")) == ["best", "step_110", "step_120", "step_150", "step_175",
                                                               "step_200", "step_300", "step_90"]
            assert running.exists() and Path(code).exists() and Path(unshipped).exists()
            assert (runs / done.name / "results.jsonl").exists()
            named = lab_cli(lab_project, "clean", "--host", "down", runs=runs)      # named: one line, and exit 1
            assert named.returncode == 1 and named.stderr.count("warning: down: skipped: host down (127.0.0.1:9): "
                                                                "connection refused") == 1, named.stdout + named.stderr
        finally:
            stop(runner, sys.executable, code, str(running))


@pytest.mark.parametrize("source", ["empty", "unreadable"])
def test_copies_are_judged_only_on_the_training_hosts_positive_evidence(lab_project, tmp_path, source):
    """A training host's run folder that is empty (an unmounted volume, a restart) or cannot be read
    proves nothing about the checkpoints it dropped: every copy is kept, saying why."""
    synced(lab_project, ("step_100", "step_200"), keep=())
    src = lab_project["source"]
    if source == "unreadable":
        src.rmdir()
        src.write_text("not a folder")
    proc = lab_cli(lab_project, "clean", "--json", "--yes", "--host", "eval", runs=tmp_path / "runs")
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["items"] == [], proc.stdout + proc.stderr
    why = "holds no checkpoint (an unmounted volume, a restarted run?)" if source == "empty" else "cannot be read"
    assert any(n.startswith(f"eval: copies of run v7 not judged (kept): {src} on train ") and why in n
               for n in report["notes"]), report["notes"]
    assert sorted(p.name for p in lab_project["copies"].iterdir() if not p.name.startswith(".")) == ["step_100", "step_200"]


@pytest.mark.worker
@pytest.mark.timing
def test_an_eval_started_elsewhere_during_the_prompt_keeps_its_checkpoint(lab_project, tmp_path):
    """An eval started from another machine's runs folder while `clean` waits at its prompt has
    written its lease on the eval host before its pre-flight: answering y removes the other copy,
    not the one the eval loads (clean reads the lease there under the lock the lease's writer
    takes). The eval's failed start releases its lease; the copy goes at the next clean."""
    synced(lab_project, ("step_100", "step_120", "step_200"))
    ckpts = lab_project["copies"]
    hold = paused_python(tmp_path / "hold", "remote.preflight")
    elsewhere = lab_project["lab"].write_inventory(
        tmp_path / "elsewhere.yaml", train={"checkpoints": str(lab_project["source"].parent)},
        eval={"python": str(hold), "workdir": str(lab_project["workdir"]), "checkpoints": str(ckpts.parent),
              "gpus": 0})
    master, slave = os.openpty()
    env = {**os.environ, "DFLASH_OPS_CATALOG": str(lab_project["catalog"]), "DFLASH_OPS_RUNS": str(tmp_path / "runs"),
           "COLUMNS": "300"}
    cleaner = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "--inventory", str(lab_project["inventory"]),
                                "clean", "--host", "eval"], cwd=REPO, env=env, stdin=slave, stdout=subprocess.PIPE,
                               stderr=slave, text=True)     # its question goes to the terminal
    os.close(slave)
    evaluator = None
    try:
        prompt = b""
        while b"delete these" not in prompt:       # the plan is made: both copies listed
            assert cleaner.poll() is None, cleaner.stdout.read()
            prompt += os.read(master, 1024)
        evaluator = lab_cli(lab_project, "eval", "--host", "eval", "--drafter", "v7:step_100", "--target",
                            str(tmp_path / "no-target"), "--prompts", "1", "--sglang", "off",
                            inventory=elsewhere, runs=tmp_path / "other-runs", popen=True)
        wait_for(lambda: (tmp_path / "hold" / "paused").exists(), 300, "the eval's pre-flight", evaluator)
        os.write(master, b"y\n")
        out = cleaner.communicate(timeout=120)[0]
    finally:
        os.close(master)
        (tmp_path / "hold" / "release").touch()
        if cleaner.poll() is None:
            cleaner.kill()
    assert cleaner.returncode == 1, out
    assert "step_100" in out and "step_120" in out
    assert re.search(r"✘ eval: not deleted: \S+/step_100: in use now: run \S+-v7-step100-eval \(from \S+:\S+"
                     r"other-runs\S*\), in its pre-flight or being submitted", out), out
    assert "deleted 1 of 2 item(s) on eval" in out, out
    assert (ckpts / "step_100").exists() and not (ckpts / "step_120").exists()
    failed = finished(evaluator, 600)
    assert failed.returncode != 0 and "Traceback" not in failed.stdout, failed.stdout
    assert list((lab_project["workdir"] / "leases").glob("*.json")) == []      # released: the start failed
    again = lab_cli(lab_project, "clean", "--json", "--yes", "--host", "eval", runs=tmp_path / "runs")
    assert set(listed(again)) == {str(ckpts / "step_100")}
    assert not (ckpts / "step_100").exists()


@pytest.mark.timing
def test_ctrl_c_stops_the_removal_on_the_host_between_items(lab_project, tmp_path):
    """The removal on a host goes item by item as this machine sends them: Ctrl-C ends the CLI
    (130), the host finishes the item at hand and stops, and the output names what was removed
    and what was not. The eval host's disk is slow here (a python that sleeps in rmdir)."""
    slow = tmp_path / "slow" / "python"
    slow.parent.mkdir()
    slow.write_text(f"""#!/bin/sh
exec {sys.executable} -c 'import os, sys, time
real = os.rmdir
os.rmdir = lambda *a, **k: (time.sleep(0.4), real(*a, **k))[1]
code, sys.argv = sys.argv[2], ["-c", *sys.argv[3:]]
exec(compile(code, "<tool>", "exec"), {{"__name__": "__main__"}})' "$@"
""")
    slow.chmod(0o755)
    inventory = lab_project["lab"].write_inventory(tmp_path / "slow.yaml", eval={
        "python": str(slow), "workdir": str(lab_project["workdir"])})
    folders = [fake_code(lab_project["workdir"], f"{i:016x}") for i in range(1, 7)]
    proc = lab_cli(lab_project, "clean", "--yes", "--host", "eval", inventory=inventory, runs=tmp_path / "runs",
                   popen=True)
    wait_for(lambda: not Path(folders[0]).exists(), 120, "the first removal", proc)
    proc.send_signal(signal.SIGINT)
    out = finished(proc, 60).stdout
    assert proc.returncode == 130, out
    time.sleep(3)                                   # the host has stopped: nothing more goes
    gone = [f for f in folders if not Path(f).exists()]
    assert 1 <= len(gone) <= 3 and all(Path(f).exists() for f in folders[len(gone):]), (gone, out)
    flat = " ".join(out.split())
    assert f"deleted {len(gone) - ('was being removed' in flat)} of 6 item(s) on eval" in flat, out
    assert "interrupted: not deleted on eval:" in flat and Path(folders[-1]).name in flat, out
    assert "Traceback" not in out


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
