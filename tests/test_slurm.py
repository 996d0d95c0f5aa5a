"""Eval on a Slurm cluster (inventory ``kind: slurm``): a real slurmctld/slurmd/munged
(tests/slurmlab.py: a node with ``Gres=gpu:2`` on placeholder devices, the workers on CPU), its
login host ``local`` or an SSH host of the lab; the CLI as a subprocess."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.config.inventory import InventoryError, parse_inventory

REPO = Path(__file__).resolve().parents[1]
KEYS = ("id", "prompt_ids", "output_ids", "acceptance_lengths")
EVAL = ("eval", "--drafter", "embedded", "--device", "cpu", "--ddtree", "")
pytestmark = pytest.mark.xdist_group("slurm")     # one worker process starts the cluster


# ----------------------------------------------------------------------------- inventory

def test_slurm_inventory_entries(tmp_path):
    inv = parse_inventory({"hosts": {
        "login": {"address": "10.0.0.1"},
        "cluster": {"kind": "slurm", "login": "login", "workdir": "/shared/dflash", "partition": "a100",
                    "account": "lab", "qos": "normal", "time": "2:00:00", "gres": "gpu:a100", "constraint": "ib",
                    "sbatch_args": ["--mem=64G", "--exclusive"], "setup": "/shared/env.sh", "python": "/shared/py"},
        "here": {"kind": "slurm", "login": "local", "workdir": "~/dflash"}}}, tmp_path / "inventory.yaml")
    cluster = inv.get("cluster")
    assert cluster.is_slurm and cluster.endpoint == "slurm via login" and cluster.roles == ("eval",)
    assert cluster.slurm.sbatch_options(2) == ["--partition=a100", "--account=lab", "--qos=normal", "--time=2:00:00",
                                               "--constraint=ib", "--gres=gpu:a100:2", "--mem=64G", "--exclusive"]
    assert inv.get("here").slurm.sbatch_options(1) == ["--gres=gpu:1"]       # a GRES without a type
    assert inv.get("here").slurm.sbatch_options(0) == []                     # gpus: 0: CPU jobs
    base = {"kind": "slurm", "login": "login", "workdir": "/w"}
    bad = [({**base, "login": "nope"}, "'nope' is not an SSH host of the inventory or local"),
           ({**base, "login": "cluster2"}, "'cluster2' is not an SSH host"),
           ({"kind": "slurm", "workdir": "/w"}, "missing field 'login'"),
           ({"kind": "slurm", "login": "login"}, "missing field 'workdir'"),
           ({**base, "port": 22}, "field 'port' is not for `kind: slurm`"),
           ({**base, "address": "x"}, "field 'address' is not for `kind: slurm`"),
           ({**base, "roles": ["train"]}, "a Slurm cluster is an eval host"),
           ({**base, "gres": "gpu:0"}, "field 'gres' must be gpu or gpu:TYPE"),
           ({**base, "gres": "gpu:a100:2:1"}, "field 'gres' must be gpu or gpu:TYPE"),
           ({**base, "gres": "gpu:2"}, None), ({**base, "gres": "gpu:a100:1"}, None),
           ({**base, "time": "1h"}, "field 'time' must be a Slurm time limit"),
           ({**base, "sbatch_args": ["--array=0-3"]}, "--array is set by dflash-ops"),
           ({**base, "sbatch_args": ["--partition=x"]}, "use the field 'partition'"),
           ({**base, "sbatch_args": ["--parti=x"]}, "--parti (sbatch reads it as --partition) is set by dflash-ops "
                                                    "(use the field 'partition')"),
           ({**base, "sbatch_args": ["--arr=0-9"]}, "--arr (sbatch reads it as --array) is set by dflash-ops"),
           ({**base, "sbatch_args": ["--outp=/tmp/x"]}, "--outp (sbatch reads it as --output)"),
           ({**base, "sbatch_args": ["--sig=B:USR1@1"]}, "--sig (sbatch reads it as --signal)"),
           ({**base, "sbatch_args": ["--no-requeue"]}, "--no-requeue is set by dflash-ops"),
           ({**base, "sbatch_args": ["--no-req"]}, "--no-req (sbatch reads it as --no-requeue)"),
           ({**base, "sbatch_args": ["--pa=x"]}, "(sbatch reads it as --parsable or --partition)"),   # ambiguous
           ({**base, "sbatch_args": ["--no-kill", "--mem-per-gpu=8G", "--exclusive", "--nodes=1"]}, None),
           ({**base, "sbatch_args": ["--mem=1G; rm -rf /"]}, None),       # one argv item: no shell ever sees it
           ({**base, "sbatch_args": ["-p x"]}, "is not --option or --option=value"),
           ({**base, "sbatch_args": ["--x=1\n--y"]}, "is not --option or --option=value"),
           ({**base, "gpu_memory": 0}, "field 'gpu_memory' must be a positive number"),
           ({**base, "partiton": "x"}, "unknown field 'partiton'"),
           ({"address": "10.0.0.2", "partition": "x"}, "field 'partition' is for `kind: slurm` entries")]
    for entry, message in bad:
        data = {"hosts": {"login": {"address": "10.0.0.1"}, "cluster2": {**base}, "x": entry}}
        if message is None:
            parse_inventory(data, tmp_path / "inventory.yaml")
            continue
        with pytest.raises(InventoryError, match=re.escape(message)):
            parse_inventory(data, tmp_path / "inventory.yaml")


def test_a_gres_count_is_each_workers_gpus_or_one_line_before_any_host(tmp_path):
    """`gres: gpu:N` (as Slurm users write it) is the count each task asks: accepted when it is
    each worker's GPUs, else refused in one line before the login host is reached (none here)."""
    inventory = tmp_path / "inventory.yaml"
    runs = tmp_path / "runs"
    entry = {"kind": "slurm", "login": "login", "workdir": "/w", "gres": "gpu:a100:2"}
    inventory.write_text(yaml.safe_dump({"hosts": {"login": {"address": "192.0.2.1"}, "cluster": entry}}))
    inv = parse_inventory(yaml.safe_load(inventory.read_text()), inventory)
    spec = inv.hosts["cluster"].slurm
    assert (spec.gres, spec.gres_count) == ("gpu:a100", 2) and spec.gres_problem(2) is None
    assert spec.sbatch_options(2) == ["--gres=gpu:a100:2"]
    env = {**os.environ, "DFLASH_OPS_RUNS": str(runs), "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "--inventory", str(inventory), "eval", "--host",
                           "cluster", "--drafter", str(tmp_path), "--target", str(tmp_path), "--prompts", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out, out
    assert ("host cluster: field 'gres' asks 2 GPU(s) per task (gpu:a100:2), but each worker of this run holds 1 "
            "(--target-devices N sets it): write `gres: gpu:a100`") in " ".join(out.split()), out
    assert "192.0.2.1" not in out                                      # refused before the login host was tried
    listed = subprocess.run([sys.executable, "-m", "orchestrator.cli", "--inventory", str(inventory), "hosts"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300).stdout
    assert "Slurm through login" in listed and "None:22" not in listed, listed


# ----------------------------------------------------------------------------- the cluster

@pytest.fixture(scope="module")
def slurm_lab(ssh_lab, embedded_pair, tmp_path_factory):
    """The cluster, its controller at an address both this namespace and the lab's eval host
    reach (the root side of the eval host's veth), and a shared workdir with the embedded pair."""
    import shutil

    import slurmlab

    why = slurmlab.available()
    if why:
        if os.environ.get("CI"):
            raise RuntimeError(f"the Slurm lab cannot start: {why}")
        pytest.skip(f"the Slurm lab cannot start: {why}")
    address = ssh_lab.eval.address.rsplit(".", 1)[0] + ".1" if ssh_lab.isolated else "127.0.0.1"
    lab = slurmlab.start(tmp_path_factory.mktemp("slurm"), address)
    workdir = tmp_path_factory.mktemp("shared") / "workdir"
    shutil.copytree(Path(embedded_pair["target"]).parent, workdir / "embedded")
    try:
        yield {"lab": lab, "workdir": workdir}
    finally:
        lab.cancel_all()
        lab.close()


@pytest.fixture
def cluster(slurm_lab):
    """The lab cluster as a test finds it: idle, its partition up, no job of an earlier test."""
    lab = slurm_lab["lab"]
    yield slurm_lab
    lab.cancel_all()
    lab.set_partition("UP")
    lab.wait_idle()


def write_inventory(tmp_path: Path, workdir: Path, login: str = "local", **fields) -> Path:
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump({"hosts": {"cluster": {"kind": "slurm", "login": login, "workdir": str(workdir),
                                                          "python": sys.executable, **fields}}}))
    return path


def cli(lab, inventory: Path, runs: Path, *args, home: Path | None = None, popen: bool = False):
    env = {**os.environ, **lab.env, "DFLASH_OPS_RUNS": str(runs), "COLUMNS": "200"}
    if home:
        env["DFLASH_OPS_HOME"] = str(home)
    argv = [sys.executable, "-m", "orchestrator.cli", "--inventory", str(inventory), *map(str, args)]
    if popen:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def queued_run(cluster, tmp_path: Path, prompts: int, max_new_tokens: int) -> tuple[Path, Path, Path]:
    """An eval submitted with --detach while the cluster's partition is down (its task queued,
    PartitionDown): ``(inventory, runs folder, run folder)``."""
    inventory = write_inventory(tmp_path, cluster["workdir"])
    runs = tmp_path / "runs"
    cluster["lab"].set_partition("DOWN")
    detached = cli(cluster["lab"], inventory, runs, *EVAL, "--host", "cluster", "--prompts", prompts,
                   "--max-new-tokens", max_new_tokens, "--detach")
    assert detached.returncode == 0, detached.stdout + detached.stderr
    return inventory, runs, the_run(runs)


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]


def the_run(runs: Path) -> Path:
    from runfolders import only_run

    return only_run(runs)


def shard_states(run: Path) -> list[str]:
    try:
        return [s["state"] for s in json.loads((run / "run.json").read_text())["shards"]]
    except (OSError, ValueError, KeyError):
        return []


@pytest.mark.models
@pytest.mark.worker
def test_a_job_array_equals_one_worker_and_two_gpus_of_a_host(cluster, tmp_path):
    """The same prompts on `local` (one worker), on `local --gpus 2` and as a two-task job array
    on the cluster give the same rows token for token; each task got its own GPU from Slurm."""
    from waiting import finished, started

    lab, workdir = cluster["lab"], cluster["workdir"]
    inventory = write_inventory(tmp_path, workdir)
    args = ("--prompts", "4", "--max-new-tokens", "24")
    procs = {}
    for name, extra in (("one", ("--host", "local")), ("two", ("--host", "local", "--gpus", "2")),
                        ("slurm", ("--host", "cluster", "--gpus", "2"))):
        procs[name] = cli(lab, inventory, tmp_path / name, *EVAL, *extra, *args, home=workdir, popen=True)
        if name == "one":       # the two local runs share a workdir: their run ids must differ
            started(tmp_path / name, procs[name], workdir / "code")
    done = {name: finished(p) for name, p in procs.items()}
    for name, proc in done.items():
        assert proc.returncode == 0, (name, proc.stdout)
    assert "cluster:gpu0" in done["slurm"].stdout and "cluster:gpu1" in done["slurm"].stdout
    runs = {name: the_run(tmp_path / name) for name in done}
    want = [{k: r[k] for k in KEYS} for r in rows(runs["one"])]
    for name in ("two", "slurm"):
        assert [{k: r[k] for k in KEYS} for r in rows(runs[name])] == want, name
    env = json.loads((runs["slurm"] / "env.json").read_text())
    placement = env["placement"]
    assert placement["backend"] == "slurm"
    slurm = placement["slurm"]
    assert slurm["cluster"] == "lab" and slurm["version"].startswith(("2", "3")) and slurm["partition"] == "gpu"
    assert slurm["array_task_ids"] == [0, 1] and len(slurm["job_ids"]) == 1 and slurm["nodes"] == ["node1"]
    tasks = [s["slurm"] for s in placement["shards"]]
    assert sorted(t["cuda_visible_devices"] for t in tasks) == ["0", "1"]          # Slurm's GRES, one GPU each
    assert [t["job_gpus"] for t in tasks] == [t["cuda_visible_devices"] for t in tasks]
    assert sorted(e["cuda_visible_devices"] for e in env["shards"]) == ["0", "1"]   # as the worker saw it
    assert all(t["job"] == slurm["job_ids"][0] for t in tasks)


def worker_pids(folder: Path) -> list[int]:
    """The worker processes writing into ``folder`` (their argv names its out folder)."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0") if proc.name.isdigit() else []
            if argv[1:3] == [b"-m", b"remote.worker"] and f"{folder}/out".encode() in argv:
                out.append(int(proc.name))
        except OSError:
            pass
    return out


def leases(workdir: Path, run: Path) -> list[str]:
    """Why each live lease of ``run`` in the cluster's workdir is live (remote/host/clean.py ``scan``)."""
    from orchestrator.eval.lease import host_tool

    scan = subprocess.run([sys.executable, "-c", host_tool(), "scan", str(workdir)], capture_output=True, text=True,
                          timeout=60, check=True)
    return [le["why"] for le in json.loads(scan.stdout)["leases"] if le["run"] == run.name]


def task_dir(workdir: Path, run: Path, k: int | None = None) -> Path:
    return workdir / "runs" / run.name / (f"shard-{k}" if k is not None else "")


@pytest.mark.models
@pytest.mark.worker
def test_queued_detached_attached_cancelled_outside_cancelled_and_resumed(cluster, tmp_path):
    """Submitted with --detach while the partition is down: the run is queued (Slurm's reason);
    `attach` follows it, up again it runs; an `scancel` from outside is named (rows kept); a resume
    then `dflash-ops cancel` stop its new job (rows kept); the last resume finishes the prompts
    left, each exactly once."""
    from runfolders import prompt_events
    from waiting import finished, wait_for

    lab, workdir = cluster["lab"], cluster["workdir"]
    inventory, runs, run = queued_run(cluster, tmp_path, prompts=4, max_new_tokens=96)
    proc = cli(lab, inventory, runs, "attach", run.name, popen=True)
    wait_for(lambda: shard_states(run) == ["queued"], what="the task queued", proc=proc)
    assert leases(workdir, run) == ["running or queued"]      # `clean`, from any machine, keeps what it loads
    lab.set_partition("UP")
    folder = task_dir(workdir, run)
    wait_for(lambda: prompt_events(folder / "events.jsonl") >= 1, what="a finished prompt", proc=proc)
    job = json.loads((folder / "slurm.json").read_text())
    lab.run("scancel", f"{job['job']}_{job['task']}")
    out = finished(proc).stdout
    assert proc.returncode == 1, out
    assert "queued: PartitionDown" in out, out
    assert "CANCELLED" in out and "scancel" in out and f"eval --resume {run.name}" in out, out
    kept = len((folder / "out" / "results.jsonl").read_text().splitlines())
    assert kept >= 1
    again = cli(lab, inventory, runs, "eval", "--resume", run.name, "--detach")
    assert again.returncode == 0, again.stdout + again.stderr
    second = json.loads((folder / "slurm.json").read_text())["job"]
    assert second != job["job"]                                            # a new job for the prompts left
    cancelled = cli(lab, inventory, runs, "cancel", run.name)
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout, cancelled.stdout + cancelled.stderr
    assert json.loads((run / "run.json").read_text())["status"] == "cancelled"
    assert "RUNNING" not in lab.run("squeue", "--noheader", f"--jobs={second}").stdout
    assert leases(workdir, run) == []                         # released with the cancel
    resumed = cli(lab, inventory, runs, "eval", "--resume", run.name)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    got = rows(run)
    assert len(got) == 4 and len({r["id"] for r in got}) == 4
    starts = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines() if '"start"' in line]
    assert starts[-1]["done"] >= kept                                      # the new jobs skipped the finished rows


@pytest.mark.models
@pytest.mark.worker
def test_requeued_and_node_down_tasks_go_on_without_duplicates(cluster, tmp_path):
    """`scontrol requeue`, then the node set down mid-run: each time the task is queued again
    (shown with Slurm's reason, not an end), then runs again on the node and skips the prompts it
    finished; the run ends done, every prompt once."""
    from runfolders import prompt_events
    from waiting import finished, wait_for

    lab, workdir = cluster["lab"], cluster["workdir"]
    inventory = write_inventory(tmp_path, workdir)
    runs = tmp_path / "runs"
    proc = cli(lab, inventory, runs, *EVAL, "--host", "cluster", "--prompts", "4", "--max-new-tokens", "96",
               popen=True)
    wait_for(lambda: runs.exists() and any((d / "run.json").exists() for d in runs.iterdir()), what="the run",
             proc=proc)
    run = the_run(runs)
    folder = task_dir(workdir, run)
    wait_for(lambda: prompt_events(folder / "events.jsonl") >= 1, what="a finished prompt", proc=proc)
    job = json.loads((folder / "slurm.json").read_text())
    task = f"{job['job']}_{job['task']}"
    lab.run("scontrol", "requeue", task)
    wait_for(lambda: shard_states(run) == ["queued"], what="the task queued again", proc=proc)
    lab.run("scontrol", "update", f"JobId={task}", "StartTime=now")       # Slurm holds a requeued job ~2 min
    wait_for(lambda: json.loads((folder / "placement.json").read_text()).get("restarts") == 1, what="the rerun",
             proc=proc)
    before = prompt_events(folder / "events.jsonl")
    wait_for(lambda: prompt_events(folder / "events.jsonl") > before, what="a prompt of the rerun", proc=proc)
    lab.set_node("DOWN")
    wait_for(lambda: shard_states(run) == ["queued"], what="the task queued after the node went down", proc=proc)
    lab.wait_idle()                                                       # the node back (RESUME)
    lab.run("scontrol", "update", f"JobId={task}", "StartTime=now", check=False)
    done = finished(proc)
    assert done.returncode == 0, done.stdout
    got = rows(run)
    assert len(got) == 4 and len({r["id"] for r in got}) == 4
    assert "queued" in done.stdout
    starts = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines() if '"start"' in line]
    assert len(starts) == 3 and starts[1]["done"] >= 1 and starts[2]["done"] >= starts[1]["done"]
    placement = json.loads((run / "env.json").read_text())["placement"]["shards"][0]["slurm"]
    assert placement["restarts"] == 2


@pytest.mark.models
@pytest.mark.worker
def test_a_time_limit_is_named_and_resume_finishes(cluster, tmp_path):
    """A job whose time limit comes: Slurm's signal stops the worker (its finished rows kept), the
    end is named as the time limit, and a resume with a longer limit finishes the run."""
    from waiting import finished, wait_for

    lab, workdir = cluster["lab"], cluster["workdir"]
    runs = tmp_path / "runs"
    short = write_inventory(tmp_path, workdir, time="1")           # 1 minute: Slurm signals 60 s ahead, at once
    proc = cli(lab, short, runs, *EVAL, "--host", "cluster", "--prompts", "3", "--max-new-tokens", "256", popen=True)
    wait_for(lambda: runs.exists() and any((d / "run.json").exists() for d in runs.iterdir()), what="the run",
             proc=proc)
    run = the_run(runs)
    folder = task_dir(workdir, run)
    for pid in wait_for(lambda: worker_pids(folder), what="the worker", proc=proc):
        with contextlib.suppress(ProcessLookupError):   # held, so that the time limit comes first, idle
            os.kill(pid, signal.SIGSTOP)
    ended = finished(proc)
    assert ended.returncode == 1, ended.stdout
    assert "its time limit (1:00) was near; the worker stopped" in ended.stdout, ended.stdout
    assert f"eval --resume {run.name}" in ended.stdout, ended.stdout
    longer = write_inventory(tmp_path, workdir, time="30")
    resumed = cli(lab, longer, runs, "eval", "--resume", run.name)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    got = rows(run)
    assert len(got) == 3 and len({r["id"] for r in got}) == 3


@pytest.mark.models
@pytest.mark.worker
@pytest.mark.timing
def test_the_login_host_is_an_ssh_host(cluster, ssh_lab, tmp_path):
    """The login node is the lab's eval host (its own network namespace, reached over SSH, with
    the cluster's config in its sessions' environment): the same job array, placement recorded,
    and `hosts check` reports the cluster."""
    import sshlab
    from waiting import finished, patience

    lab, workdir = cluster["lab"], cluster["workdir"]
    host = ssh_lab.eval
    port = 2299
    sshd = sshlab.ExtraSshd(ssh_lab, host, port, host.host_key, tmp_path, env=lab.env).start()
    try:
        known = tmp_path / "known_hosts"
        known.write_text(f"[{host.address}]:{port} {host.host_key_pub}\n")
        data = ssh_lab.inventory_dict(eval={"port": port, "known_hosts": str(known)})
        data["hosts"]["cluster"] = {"kind": "slurm", "login": "eval", "workdir": str(workdir),
                                    "python": sys.executable}
        inventory = tmp_path / "inventory.yaml"
        inventory.write_text(yaml.safe_dump(data))
        env_free = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
        check = finished(subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "--inventory", str(inventory),
                                           "hosts", "check", "cluster", "--json"], cwd=REPO, env=env_free,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), patience(20))
        assert check.returncode == 0, check.stdout + check.stderr
        (report,) = json.loads(check.stdout)
        assert report["ok"] and report["cuda"].startswith("slurm "), report
        assert any("gpu" in g and "2 GPU" in g for g in report["gpus"]), report
        proc = finished(subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "--inventory", str(inventory),
                                          *EVAL, "--host", "cluster", "--gpus", "2", "--prompts", "2",
                                          "--max-new-tokens", "16"], cwd=REPO,
                                         env={**env_free, "DFLASH_OPS_RUNS": str(tmp_path / "runs"), "COLUMNS": "200"},
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), patience(120))
        assert proc.returncode == 0, proc.stdout
        placement = json.loads((the_run(tmp_path / "runs") / "env.json").read_text())["placement"]
        assert placement["backend"] == "slurm" and placement["slurm"]["array_task_ids"] == [0, 1]
        assert all(s["slurm"]["login"] == "eval" for s in placement["shards"])
    finally:
        sshd.stop()


def test_a_tasks_state_held_cancelled_and_gone_from_slurm(cluster, tmp_path, monkeypatch):
    """The host side's reading of a task (remote/host/slurm.py, as `launch status` runs it on the
    login node): a held job is queued with the command that releases it; cancelled, Slurm's end
    state is named; a job Slurm no longer knows (no accounting here) is judged by its own files:
    running while they are fresh, lost once they have been quiet for the grace time, ended when it
    wrote an exit code."""
    from remote.host import launch, slurm

    lab = cluster["lab"]
    monkeypatch.setenv("SLURM_CONF", str(lab.conf))
    run_dir = tmp_path / "run"
    got = slurm.submit(run_dir, [0], 1, ["--hold"], sys.executable, str(REPO), None, "held-test")
    st = launch.state(run_dir)
    assert st["state"] == "queued" and f"scontrol release {got['job']}_0" in st["why"], st
    lab.run("scancel", f"{got['job']}_0")
    st = launch.state(run_dir)
    assert st["state"] == "cancelled" and "Slurm: CANCELLED" in st["why"], st

    gone = tmp_path / "gone"
    gone.mkdir()
    (gone / slurm.JOB_FILE).write_text(json.dumps({"job": "999999", "task": 0, "submitted": 0}))
    (gone / "events.jsonl").write_text("")
    assert launch.state(gone)["state"] == "running"                  # quiet for less than the grace time
    old = (gone / ".now").stat().st_mtime - slurm.ABSENT_GRACE - 5
    for name in ("events.jsonl", slurm.JOB_FILE):
        os.utime(gone / name, (old, old))
    st = launch.state(gone)
    assert st["state"] == "lost" and "no longer lists job 999999_0" in st["why"], st
    (gone / "exit_code").write_text("0\n")
    assert launch.state(gone)["state"] == "done"


@pytest.mark.models
def test_a_gpu_run_planned_on_a_login_node_without_gpu(cluster, tmp_path):
    """Pre-flight of a GPU run on a login node with no GPU: without `gpu_memory` one line says to
    set it; with it, the target is planned on that many GiB per GPU (and checked on CPU there), and
    a plan that does not fit is refused before anything is submitted."""
    lab, workdir = cluster["lab"], cluster["workdir"]
    runs = tmp_path / "runs"
    plain = write_inventory(tmp_path, workdir)
    proc = cli(lab, plain, runs, "eval", "--drafter", "embedded", "--host", "cluster", "--prompts", "1")
    assert proc.returncode != 0 and "set `gpu_memory:` (GiB per GPU of partition gpu)" in proc.stdout + proc.stderr
    tiny = write_inventory(tmp_path, workdir, gpu_memory=0.0001)       # 100 KiB: the pair does not fit
    proc = cli(lab, tiny, runs, "eval", "--drafter", "embedded", "--host", "cluster", "--prompts", "1")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "cuda:0" in out and "Traceback" not in out, out
    assert not lab.run("squeue", "--noheader").stdout.strip()                  # nothing submitted


def sleeper(run_dir: Path, name: str, *options: str) -> str:
    """A task of one job array (remote/host/slurm.py ``submit``, as the run control submits it)
    whose worker is ``sleep``; its task id."""
    from remote.host import launch, slurm

    launch.prepare(run_dir, ["sleep", "600"], None, None, None, fresh=True)
    return f"{slurm.submit(run_dir, [0], 1, list(options), sys.executable, str(REPO), None, name)['job']}_0"


def test_slurm_states_as_slurm_sets_them(cluster, tmp_path, monkeypatch):
    """Each state Slurm sets (by `scontrol`) read as Slurm defines it: held is queued with the
    command that releases it; SUSPENDED and STOPPED are told as themselves (it was running), never
    "waiting to start"; PREEMPTED (PreemptMode=CANCEL, by a job of a higher-tier partition) is an
    end, and `follow` ends on it; requeued it is queued again. No reason "None" is ever shown."""
    from remote.host import launch, slurm
    from waiting import wait_for

    lab = cluster["lab"]
    monkeypatch.setenv("SLURM_CONF", str(lab.conf))
    run_dir = tmp_path / "states"
    task = sleeper(run_dir, "states", "--hold")
    seen = [launch.state(run_dir)]
    assert seen[-1]["state"] == "queued" and seen[-1]["why"] == \
        f"queued: JobHeldUser (release it with: scontrol release {task})", seen[-1]
    lab.run("scontrol", "release", task)
    seen.append(wait_for(lambda: (st := launch.state(run_dir))["state"] == "running" and st, what="running"))
    assert seen[-1]["node"] == "node1"
    for hold, again, name in ((("scontrol", "suspend", task), ("scontrol", "resume", task), "SUSPENDED"),
                              (("scancel", "--signal=STOP", task), ("scancel", "--signal=CONT", task), "STOPPED")):
        lab.run(*hold)
        seen.append(wait_for(lambda: (st := launch.state(run_dir))["state"] == "queued" and st, what=name))
        assert seen[-1]["slurm"]["state"] == name and seen[-1]["why"].startswith(f"{name} ") \
            and "it was running" in seen[-1]["why"] and "on node1" in seen[-1]["why"], seen[-1]
        lab.run(*again)
        wait_for(lambda: launch.state(run_dir)["state"] == "running", what=f"running after {name}")
    follow = subprocess.Popen([sys.executable, "-m", "remote.host.launch", "follow", str(run_dir)], cwd=REPO,
                              env={**os.environ, **lab.env}, stdout=subprocess.PIPE, text=True)
    with lab.urgent() as urgent:
        lab.run("sbatch", f"--partition={urgent}", "--exclusive", "--job-name=urgent", "--output=/dev/null",
                "--wrap=sleep 600")
        out, _ = follow.communicate(timeout=120)
    end = json.loads(out.splitlines()[-1])
    assert end["event"] == "exit" and end["state"] == "failed" and end["slurm"]["state"] == "PREEMPTED", end
    assert end["why"].startswith("Slurm: PREEMPTED, it was preempted (cancelled) for a higher-priority job"), end
    seen.append(end)
    lab.set_partition("DOWN")       # requeued, it stays queued: on a free node it could start between two polls
    lab.run("scontrol", "requeue", task)
    seen.append(wait_for(lambda: (st := launch.state(run_dir))["state"] == "queued" and st, what="requeued"))
    assert all("None" not in (st.get("why") or "") and "waiting to start" not in (st.get("why") or "")
               for st in seen), seen
    assert slurm.ENDED >= {"PREEMPTED", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL",
                           "BOOT_FAIL", "DEADLINE"}
    assert slurm.QUEUED >= {"PENDING", "SUSPENDED", "STOPPED", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                            "RESV_DEL_HOLD", "SPECIAL_EXIT"} and not slurm.QUEUED & slurm.ENDED


def test_a_task_its_node_cannot_launch_is_named(cluster, tmp_path, monkeypatch):
    """A task whose node cannot open its output file in the run folder (here: the folder moved
    away, as on a workdir the compute nodes do not share) ends FAILED with Slurm's reason
    JobLaunchFailure, named and explained."""
    from remote.host import launch
    from waiting import wait_for

    lab = cluster["lab"]
    monkeypatch.setenv("SLURM_CONF", str(lab.conf))
    run_dir = tmp_path / "unshared"
    task = sleeper(run_dir, "unshared", "--hold")
    run_dir.rename(tmp_path / "away")
    lab.run("scontrol", "release", task)
    wait_for(lambda: lab.run("squeue", "--noheader", "--states=all", "--array", f"--jobs={task}",
                             "--format=%T").stdout.split() == ["FAILED"], timeout=60, what="the launch failed")
    (tmp_path / "away").rename(run_dir)
    st = launch.state(run_dir)
    assert st["state"] == "failed" and st["why"].startswith(
        "Slurm: FAILED, the task failed; reason JobLaunchFailure: its node could not launch it"), st
    assert "workdir must be storage the login host and the compute nodes both see" in st["why"], st


def test_hosts_check_cancels_its_job_at_its_timeout(cluster, tmp_path):
    """`hosts check` on a cluster whose partition is down: its check job, submitted with a known
    id, is waited on for the timeout, then cancelled and named; none is left queued."""
    lab, workdir = cluster["lab"], cluster["workdir"]
    inventory = write_inventory(tmp_path, workdir, gpus=0)
    lab.set_partition("DOWN")
    proc = cli(lab, inventory, tmp_path / "runs", "hosts", "check", "cluster", "--timeout", "30")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "did not end within 30 s (PENDING: PartitionDown); cancelled" in out, out
    job = re.search(r"the check job (\d+) did not end", out).group(1)
    assert lab.run("squeue", "--noheader", "--states=all", f"--jobs={job}", "--format=%j|%T").stdout.split() == \
        ["dflash-ops-check|CANCELLED"]


def test_an_sbatch_whose_answer_was_lost_is_found_by_its_name(cluster, tmp_path, monkeypatch):
    """sbatch that submitted the job and then failed as a lost answer does ("Socket timed out on
    send/recv operation", MessageTimeout) is not a refusal: the job is found by its name (the run
    id) and recorded in slurm.json; where Slurm lists no such job, it is a refusal."""
    from remote.host import slurm

    lab = cluster["lab"]
    monkeypatch.setenv("SLURM_CONF", str(lab.conf))
    wrapper = tmp_path / "bin" / "sbatch"
    wrapper.parent.mkdir()
    wrapper.write_text("#!/bin/sh\n[ -n \"$SUBMIT\" ] && /usr/bin/sbatch \"$@\" >/dev/null\n"
                       "echo 'sbatch: error: Batch job submission failed: Socket timed out on send/recv operation' >&2\n"
                       "exit 1\n")
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("SUBMIT", "1")
    run_dir = tmp_path / "lost-answer"
    task = sleeper(run_dir, "lost-answer", "--hold")
    listed = lab.run("squeue", "--noheader", "--array", "--name=lost-answer", "--format=%i").stdout.split()
    assert listed == [task], (listed, task)
    assert json.loads((run_dir / slurm.JOB_FILE).read_text())["job"] == task.split("_")[0]
    monkeypatch.setenv("SUBMIT", "")
    with pytest.raises(SystemExit, match="sbatch refused the job: .*Socket timed out.* Slurm lists no job named "
                                         "not-taken"):
        sleeper(tmp_path / "not-taken", "not-taken", "--hold")


@pytest.mark.models
def test_slurm_not_answering_and_another_users_job(cluster, tmp_path):
    """The controller stopped: `cancel` of a queued run says Slurm did not answer and marks nothing
    cancelled; `attach` keeps following (the task's state unknown, never judged by its files), and
    once the controller is back the task is queued again and a `cancel` ends it, as Slurm says.
    Resumed, its slurm.json pointed at another job of the user (a job id reused after MaxJobId):
    `cancel` leaves that job alone and says whose it is."""
    from waiting import finished, wait_for

    lab, workdir = cluster["lab"], cluster["workdir"]
    inventory, runs, run = queued_run(cluster, tmp_path, prompts=2, max_new_tokens=16)
    folder = task_dir(workdir, run)
    job = json.loads((folder / "slurm.json").read_text())
    task = f"{job['job']}_{job['task']}"
    lab.stop_controller()
    try:
        refused = cli(lab, inventory, runs, "cancel", run.name)
        out = refused.stdout + refused.stderr
        assert refused.returncode == 1 and f"run {run.name} is not cancelled" in out, out
        assert "Unable to contact slurm controller" in out and f"dflash-ops cancel {run.name} again" in out, out
        assert json.loads((run / "run.json").read_text())["status"] != "cancelled"
        assert shard_states(run) != ["cancelled"]
        bounded = subprocess.Popen(      # the follow on the login host, its wait for an answer cut to 1 s
            [sys.executable, "-c", "import sys; from remote.host import launch, slurm; slurm.UNANSWERED_WAIT = 1; "
                                   "sys.exit(launch.main(['follow', sys.argv[1]]))", str(folder)],
            cwd=REPO, env={**os.environ, **lab.env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        proc = cli(lab, inventory, runs, "attach", run.name, popen=True)
        wait_for(lambda: shard_states(run) == ["unknown"], what="the task's state unknown", proc=proc)
        out, err = bounded.communicate(timeout=120)
        said = [json.loads(line) for line in out.splitlines() if '"heartbeat"' not in line][-1]   # no exit line
        assert bounded.returncode == 3 and said["event"] == "scheduler" and said["state"] == "unknown", out
        assert "Unable to contact slurm controller" in said["why"] and "its state is unknown" in err, (said, err)
    finally:
        lab.start_controller()
    assert lab.run("squeue", "--noheader", f"--jobs={task}", "--format=%T").stdout.strip() == "PENDING"
    wait_for(lambda: shard_states(run) == ["queued"], what="the task queued again", proc=proc)
    cancelled = cli(lab, inventory, runs, "cancel", run.name)
    assert cancelled.returncode == 0 and "cancelled on cluster" in cancelled.stdout, cancelled.stdout
    ended = finished(proc)
    assert ended.returncode == 1 and f"run {run.name} was cancelled" in ended.stdout, ended.stdout
    assert "queued: PartitionDown" in ended.stdout, ended.stdout
    assert f"job {task} Slurm did not answer about job {task}" in ended.stdout, ended.stdout    # said while following
    assert lab.run("squeue", "--noheader", "--states=all", f"--jobs={task.split('_')[0]}",
                   "--format=%T").stdout.split() == ["CANCELLED"]

    again = cli(lab, inventory, runs, "eval", "--resume", run.name, "--detach")
    assert again.returncode == 0, again.stdout + again.stderr
    with lab.urgent() as urgent:                                          # gpu is down: the other job runs there
        other = lab.run("sbatch", "--parsable", "--job-name=training", "--array=0", "--output=/dev/null",
                        f"--partition={urgent}", "--wrap=sleep 600").stdout.strip()
        training = lambda: lab.run("squeue", "--noheader", f"--jobs={other}",  # noqa: E731
                                   "--format=%T").stdout.split()
        wait_for(lambda: training() == ["RUNNING"], timeout=60, what="the other job running")
        job = json.loads((folder / "slurm.json").read_text())
        (folder / "slurm.json").write_text(json.dumps({**job, "job": other}))
        refused = cli(lab, inventory, runs, "cancel", run.name)
        out = refused.stdout + refused.stderr
        assert refused.returncode == 1, out
        assert f"job {other}_0 in Slurm is not this run's task (it is named 'training', this run's is '{run.name}'" \
            in out, out
        assert "that job is left alone" in out, out
        assert training() == ["RUNNING"]
