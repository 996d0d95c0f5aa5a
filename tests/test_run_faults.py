"""A run's life under faults (issue 41), each shown on the built-in `local` host or on fake run
folders: a fetch never writes over a local file in place, a finished run whose host folder is
gone stays as it is, a resume never mixes two checkpoints, two targets or two worker versions in
one run (unless `--force`, recorded), an interrupted start leaves a run every command reaches, a
worker's folder is locked for its lifetime (a lost pid file never lets a second worker start
there), a merge refuses a prompt id found twice, a hung worker ends following after its stall
limit, and a full or read-only disk here is one line that says how to finish."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fakeruns import hung_job, local_run, make_run
from orchestrator.eval.jobs import HostJob
from orchestrator.transport import TransportError
from orchestrator.transport.local import LocalRunner

REPO = Path(__file__).resolve().parents[1]
RESULTS = ("results.jsonl", "summary.json", "env.json")


def cli(home: Path, runs: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "DFLASH_OPS_HOME": str(home), "DFLASH_OPS_RUNS": str(runs), "COLUMNS": "200"}
    env.pop("DFLASH_OPS_INVENTORY", None)
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=home, env=env, capture_output=True,
                          text=True, timeout=timeout)


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
    the drafter's weights it recorded in ``drafter/``, the target's identity in ``target/``;
    pre-flight stubbed (it passes, and finds the target's identity as it is then)."""
    import hashlib

    from orchestrator.config.inventory import Inventory, builtin_local
    from orchestrator.eval import pipeline
    from orchestrator.runs.record import RunRecord
    from remote.target.memory import identity

    home, runs = tmp_path / "home", tmp_path / "runs"
    home.mkdir()
    monkeypatch.setenv("DFLASH_OPS_HOME", str(home))
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "model.safetensors").write_bytes(weights)
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text('{"model_type": "qwen3", "num_hidden_layers": 2}')
    (target / "model.safetensors").write_bytes(b"target weights")
    rid = "20260101-000000-v5-local"
    folder = local_run(home, runs, rid, status="failed")
    record = json.loads((folder / "run.json").read_text())
    record["shards"][0].update(drafter_path=str(drafter), fetched=True, done=2, prompts=3)
    (folder / "run.json").write_text(json.dumps(record))
    host_run = home / "runs" / rid
    (host_run / "out").mkdir(parents=True)
    (host_run / "out" / "env.json").write_text(json.dumps(
        {"drafter": {"sha256": {"model.safetensors": hashlib.sha256(weights).hexdigest()}},
         "target": {"path": str(target), "identity": identity(target)}}))
    (host_run / "events.jsonl").write_text(json.dumps({"event": "prompt", "done": 2, "prompts": 3}) + "\n")
    (host_run / "exit_code").write_text("3\n")
    code_dir = record["shards"][0]["code_dir"]
    monkeypatch.setattr(pipeline, "prepare_host", lambda record, host, inventory, on_phase=None: pipeline.HostPrep(
        host, LocalRunner(host), code_dir, str(drafter), str(target), 0, True, "default", target_identity=identity(target)))
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


def test_a_resume_after_the_target_changed_refuses_and_force_resumes_recording_it(tmp_path, monkeypatch):
    """Before: the target's identity was recorded nowhere and compared with nothing: a resume after
    the target folder was replaced mixed two targets' rows in one run, and no refusal could be
    overridden."""
    from orchestrator.eval.pipeline import EvalError, merge_shards, start
    from orchestrator.reports.report import write_report

    record, inventory, drafter, host_run = stopped_run(tmp_path, monkeypatch)
    target = tmp_path / "target"
    (target / "config.json").write_text('{"model_type": "qwen3", "num_hidden_layers": 4}')     # another target
    with pytest.raises(EvalError) as e:
        start(record, inventory, resume=True)
    msg = str(e.value)
    assert f"the target in {target} on local changed since its 2 finished prompt(s) were made (config.json: " \
           f"sha256" in msg and "a resume would mix two targets in one run" in msg, msg
    assert f"`dflash-ops eval --resume {record.id} --force` resumes anyway, recorded in the run" in msg
    assert not (host_run / "pid").exists()
    started = []
    monkeypatch.setattr(HostJob, "start", lambda self, *args, **kwargs: started.append(self.run_dir) or 1)
    start(record, inventory, resume=True, force=True)
    assert started == [str(host_run)]
    forced = json.loads((record.folder / "run.json").read_text())["forced"]
    assert [(f["shard"], f["what"]) for f in forced] == [("local", "target")], forced
    assert forced[0]["change"].startswith("config.json: sha256 ") and forced[0]["at"]
    merge_shards(record.folder, record.shards, record.forced)       # what `attach` does once the worker ended
    assert json.loads((record.folder / "env.json").read_text())["forced"] == forced
    md, _ = write_report(record.folder)
    assert "resumed with --force" in md.read_text() and "the target of local had changed" in md.read_text()
    proc = cli(tmp_path / "home", tmp_path / "runs", "eval", "--force")
    assert proc.returncode == 2 and "--force goes with --resume" in proc.stderr, proc.stderr


def shard_folders(runs: Path, rid: str, ids: list[list[str]]) -> Path:
    """A fetched run of one shard per list of prompt ids (``shard-k/``; one shard: the run folder itself)."""
    folder = make_run(runs, rid, host=",".join(f"h{i}" for i in range(len(ids))), prompt_ids=ids[0])
    if len(ids) > 1:
        for name in RESULTS:
            (folder / name).unlink()
        for i, shard_ids in enumerate(ids):
            (make_run(folder, f"shard-{i}", prompt_ids=shard_ids, host=f"h{i}",
                      env={"suite": {"ids": shard_ids}}) / "run.json").unlink()
    return folder


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("shards", [[["p0", "p1", "p1"]], [["p0", "p1"], ["p1", "p2", "p2"]]], ids=["one", "two"])
def test_a_merge_refuses_prompt_ids_found_twice_naming_them_and_their_files(tmp_path, shards):
    """Before: a prompt id twice in one shard's results was merged and counted twice (a lone shard
    was not checked at all); across shards the merge named only the first id."""
    from orchestrator.eval.pipeline import DuplicatePrompts, finish
    from orchestrator.runs.record import RunRecord

    folder = shard_folders(tmp_path / "runs", "20260101-000000-v5-h0", [[i for i in dict.fromkeys(ids)]
                                                                         for ids in shards])
    for i, ids in enumerate(shards):            # the rows as a worker writing twice would leave them
        results = (folder / (f"shard-{i}" if len(shards) > 1 else "") / "results.jsonl")
        rows = {json.loads(line)["id"]: line for line in results.read_text().splitlines()}
        results.write_text("".join(rows[pid] + "\n" for pid in ids))
    before = {k: v for k, v in snapshot(folder).items() if k != "run.json"}
    with pytest.raises(DuplicatePrompts) as e:
        finish(RunRecord.load(folder))
    msg = str(e.value)
    if len(shards) == 1:
        assert "1 prompt id(s) more than once in its results: p1 (results.jsonl ×2)" in msg, msg
    else:
        assert "2 prompt id(s) more than once in its results: p1 (shard-0/results.jsonl, shard-1/results.jsonl); " \
               "p2 (shard-1/results.jsonl ×2)" in msg, msg
    assert "nothing was merged or reported" in msg
    assert {k: v for k, v in snapshot(folder).items() if k != "run.json"} == before      # nothing written
    assert json.loads((folder / "run.json").read_text())["status"] == "failed"


def test_a_merge_reads_the_shards_files_as_untrusted(tmp_path):
    """Before: the merge read the shards' files with plain json.loads: a row no worker writes (a
    negative acceptance length) was merged into the run's results."""
    from orchestrator.eval.pipeline import finish
    from orchestrator.runs.folders import RunError
    from orchestrator.runs.record import RunRecord

    folder = shard_folders(tmp_path / "runs", "20260101-000000-v5-h0", [["p0", "p1"], ["p2", "p3"]])
    results = folder / "shard-1" / "results.jsonl"
    lines = results.read_text().splitlines()
    row = json.loads(lines[1])
    row["acceptance_lengths"][0] = -5
    results.write_text("\n".join([lines[0], json.dumps(row)]) + "\n")
    with pytest.raises(RunError) as e:
        finish(RunRecord.load(folder))
    assert f"{results}:2: acceptance_lengths[0]: -5 is not an acceptance length" in str(e.value), e.value
    assert not (folder / "results.jsonl").exists()


def test_a_hung_worker_ends_following_after_its_stall_limit(tmp_path):
    """Before: a worker alive on its host but making no progress was followed for ever, without a
    word (and stalled `watch` with it)."""
    home, runs = tmp_path / "home", tmp_path / "runs"
    home.mkdir()
    rid = "20260101-000000-v5-local"
    local_run(home, runs, rid, status="running")
    pid = hung_job(home / "runs" / rid)
    try:
        t0 = time.monotonic()
        proc = cli(home, runs, "attach", rid, "--stall-minutes", "0.05", timeout=90)
        took = time.monotonic() - t0
        out = proc.stdout + proc.stderr
        assert proc.returncode == 4 and "Traceback" not in out, out
        assert (f"run {rid} stalled: local: no progress from its worker for 0.05 min (1 of 3 prompts done) although "
                f"it is alive. Its workers are left running: dflash-ops attach {rid} follows them again") in out, out
        assert f"dflash-ops cancel {rid} stops them" in out
        assert 3 <= took < 45, took             # the limit, then the host's next heartbeat (every 10 s)
        record = json.loads((runs / rid / "run.json").read_text())
        assert record["status"] == "running" and not record["shards"][0]["fetched"] and record["shards"][0]["done"] == 1
        st = json.loads(launch("status", str(home / "runs" / rid), cwd=tmp_path).stdout)
        assert st["state"] == "running" and st["pid"] == pid        # left running
        proc = cli(home, runs, "cancel", rid)
        assert proc.returncode == 0 and "cancelled on local after 1 of 3 prompts" in proc.stdout, proc.stdout
    finally:
        try:
            os.killpg(pid, 9)
        except ProcessLookupError:
            pass


@pytest.fixture
def mount():
    """``mount(*ARGS)`` runs `mount ARGS` (the last is the mount point; ``new=False`` for a remount),
    skipped with the reason where mounting is not permitted (it needs root); every mount point is
    unmounted at the end. A full disk is a small tmpfs, a read-only one a read-only bind mount."""
    points = []

    def run(*args, new: bool = True) -> None:
        argv = ["mount", *map(str, args)]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        except FileNotFoundError:
            pytest.skip("no `mount` here: a full or read-only disk is made with a tmpfs or a bind mount")
        if proc.returncode != 0:
            pytest.skip(f"`{' '.join(argv)}` is not permitted here ({proc.stderr.strip()}): a full or read-only disk "
                        f"is made with a tmpfs or a bind mount, as root")
        if new:
            points.append(str(args[-1]))

    yield run
    for point in reversed(points):
        subprocess.run(["umount", point], capture_output=True, timeout=30)


def finished_on_host(home: Path, rid: str, prompts: int) -> Path:
    """The host folder of a `local` run whose worker ended `done`, its files as it left them."""
    made = make_run(home / "made", rid, host="local", prompts=prompts)
    host_run = home / "runs" / rid
    (host_run / "out").mkdir(parents=True)
    for name in RESULTS:
        (host_run / "out" / name).write_bytes((made / name).read_bytes())
    (host_run / "exit_code").write_text("0\n")
    return host_run


@pytest.mark.parametrize("fault,point", [("full", "fetch"), ("full", "report"), ("read-only", "fetch")])
def test_a_full_or_read_only_disk_here_is_one_line_and_attach_finishes_once_it_takes_files(tmp_path, mount, fault,
                                                                                              point):
    """Before: a full disk while fetching said "lost contact with local: [Errno 28] … The workers
    keep running" of a worker that had ended; one while writing the report was a traceback."""
    home, runs = tmp_path / "home", tmp_path / "runs"
    runs.mkdir(parents=True)
    rid = "20260101-000000-v5-local"
    host_run = finished_on_host(home, rid, prompts=60)
    if fault == "full":       # pages: 16 hold less than the results; else the results, not the report
        pages = 16 if point == "fetch" else 6 + sum(-(-f.stat().st_size // 4096) for f in (host_run / "out").iterdir())
        mount("-t", "tmpfs", "-o", f"size={pages * 4}k", "tmpfs", runs)
    folder = local_run(home, runs, rid, status="running")
    for name in RESULTS:
        (folder / name).unlink()            # a running run has none of them here yet
    if fault == "read-only":
        mount("--bind", runs, runs)
        mount("-o", "remount,bind,ro", runs, new=False)
    before = (folder / "run.json").read_bytes()
    proc = cli(home, runs, "attach", rid)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4 and "Traceback" not in out, out
    why = "No space left on device" if fault == "full" else "Read-only file system"
    assert (f"cannot write to {folder} on this machine: {why}; nothing is lost (local: its worker ended (done), its "
            f"results are safe on the host in {host_run}): once space is freed (or the disk is writable again), "
            f"dflash-ops attach {rid} fetches them and writes the report") in out, out
    assert "lost contact" not in out and "keep running" not in out, out
    assert not [p.name for p in folder.iterdir() if p.name.endswith((".part", ".tmp"))]
    if point == "fetch":
        assert (folder / "run.json").read_bytes() == before and not (folder / "results.jsonl").exists()
    mount("-o", "remount,size=16m" if fault == "full" else "remount,bind,rw", runs, new=False)
    proc = cli(home, runs, "attach", rid)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((folder / "run.json").read_text())["status"] == "done"
    assert len((folder / "results.jsonl").read_text().splitlines()) == 60 and (folder / "report.html").stat().st_size


def test_show_rewrites_an_empty_report_and_says_in_one_line_when_it_cannot(tmp_path, mount):
    """Before: a 0-byte report.html (left by an earlier failure) was never rewritten by `show`, and
    a read-only runs folder made `show` a traceback."""
    runs = tmp_path / "runs"
    rid = "20260101-000000-v5-local"
    folder = make_run(runs, rid, host="local", prompts=3)
    assert cli(tmp_path, runs, "show", rid).returncode == 0
    (folder / "report.html").write_bytes(b"")
    mount("--bind", runs, runs)
    mount("-o", "remount,bind,ro", runs, new=False)
    proc = cli(tmp_path, runs, "show", rid)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in out, out
    assert f"error: cannot write to {folder}" in out and out.count("\n") == 1, out     # its plots folder
    assert ("on this machine: Read-only file system; free space (or give --runs-dir a writable folder) and run the "
            "command again") in out, out
    mount("-o", "remount,bind,rw", runs, new=False)
    proc = cli(tmp_path, runs, "show", rid)
    assert proc.returncode == 0 and (folder / "report.html").stat().st_size > 1000, proc.stdout + proc.stderr
