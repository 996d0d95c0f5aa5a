"""Eval on a Ray cluster (inventory ``kind: ray``): a real local cluster (``ray start --head
--num-gpus 2``: logical GPUs, the workers on CPU), joined as a Ray Client by the CLI."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from orchestrator.config.inventory import InventoryError, parse_inventory

REPO = Path(__file__).resolve().parents[1]
KEYS = ("id", "prompt_ids", "output_ids", "acceptance_lengths")

try:
    import ray  # noqa: F401
    HAVE_RAY = True
except ImportError:
    HAVE_RAY = False
needs_ray = pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed (pip install 'dflash-ops[ray]'; CI does)")
pytestmark = pytest.mark.xdist_group("ray")     # one worker process starts the clusters, one at a time


# ----------------------------------------------------------------------------- inventory

def test_ray_inventory_entries(tmp_path):
    inv = parse_inventory({"hosts": {
        "lab": {"address": "10.0.0.1"},
        "cluster": {"kind": "ray", "address": "ray://head:10001", "workdir": "/shared/dflash", "roles": ["eval"]},
        "far": {"kind": "ray", "address": "ray://127.0.0.1:10001", "via": "lab", "workdir": "~/dflash"}}},
        tmp_path / "inventory.yaml")
    assert inv.get("cluster").is_ray and inv.get("cluster").endpoint == "ray://head:10001"
    assert inv.get("far").endpoint == "ray://127.0.0.1:10001 via lab" and not inv.get("lab").is_ray
    bad = [({"kind": "ray", "address": "head:10001"}, "must be ray://HOST:PORT"),
           ({"kind": "ray", "address": "ray://head"}, "must be ray://HOST:PORT"),
           ({"kind": "ray", "address": "ray://head:10001", "jump": "lab"}, "field 'jump' is for SSH hosts"),
           ({"kind": "ray", "address": "ray://head:10001", "via": "nope"}, "'nope' is not an SSH host"),
           ({"kind": "lsf", "address": "x"}, "field 'kind' must be one of ssh, ray, slurm"),
           ({"address": "10.0.0.2", "via": "lab"}, "field 'via' is for `kind: ray`")]
    for entry, message in bad:
        with pytest.raises(InventoryError, match=message.replace("(", r"\(")):
            parse_inventory({"hosts": {"lab": {"address": "10.0.0.1"}, "x": entry}}, tmp_path / "inventory.yaml")


def test_a_failed_connection_is_one_line_with_the_servers_reason():
    from orchestrator.eval.ray import init_failure

    traceback = ("Initialization failure from server:\nTraceback (most recent call last):\n  File \"proxier.py\", "
                 "line 777, in Datapath\n    raise RuntimeError(\nRuntimeError: Proxy failed to Connect to backend!\n")
    assert init_failure(ConnectionError(traceback)) == ("Initialization failure from server: "
                                                        "RuntimeError: Proxy failed to Connect to backend!")
    assert init_failure(ConnectionError("  one line  ")) == "one line"
    assert init_failure(TimeoutError()) == "TimeoutError"


def test_ray_is_not_loaded_until_a_ray_host_is_used():
    code = ("import sys\nfrom orchestrator.eval import hostcheck, pipeline\nfrom orchestrator.cli import app\n"
            "assert 'ray' not in sys.modules and 'orchestrator.eval.ray' not in sys.modules\n"
            "import remote.host.ray_task\nassert 'ray' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_missing_extra_is_one_line(tmp_path):
    """Without ray importable, a Ray host's eval stops with one line naming the extra."""
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "ray.py").write_text("raise ImportError('no ray here')\n")
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text("hosts:\n  cluster:\n    kind: ray\n    address: ray://127.0.0.1:1\n    workdir: /tmp\n")
    env = {**os.environ, "PYTHONPATH": f"{blocker}{os.pathsep}{REPO}", "DFLASH_OPS_RUNS": str(tmp_path / "runs")}
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "--inventory", str(inventory), "eval", "--host",
                           "cluster", "--drafter", "embedded"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "pip install 'dflash-ops[ray]'" in out and "Traceback" not in out, out


@needs_ray
def test_an_unreachable_cluster_is_one_line(tmp_path):
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(f"hosts:\n  cluster:\n    kind: ray\n    address: ray://127.0.0.1:{free_port()}\n"
                         f"    workdir: /tmp\n")
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "--inventory", str(inventory), "eval", "--host",
                           "cluster", "--drafter", "embedded"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "DFLASH_OPS_RUNS": str(tmp_path / "runs")})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in out, out
    assert re.search(r"host cluster: cannot reach the Ray cluster at ray://127.0.0.1:\d+: Connection refused", out), out
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())    # no run left


# ----------------------------------------------------------------------------- a local cluster

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _processes() -> dict[int, tuple[int, int, str]]:
    """{pid: (parent pid, process group, command line)} of every process."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out[int(d.name)] = (int(fields[1]), int(fields[2]), cmd)
    return out


def cluster_processes(group: int, temp_dir: str) -> list[int]:
    """The cluster's processes: `ray start`'s process group, whatever they started (Ray's workers
    lead their own groups), and anything naming its temp dir."""
    procs = _processes()
    found = {p for p, (_, g, cmd) in procs.items() if g == group or temp_dir in cmd}
    grew = True
    while grew:
        more = {p for p, (ppid, _, _) in procs.items() if ppid in found} - found
        found |= more
        grew = bool(more)
    return sorted(found - {os.getpid()})


def warm_up(address: str, prefix: tuple[str, ...] = ()) -> None:
    """One Ray Client connection (run under ``prefix``) before the tests' own: the head's first
    client server is the slow one to start (imports), which the first test would otherwise pay on
    a busy machine."""
    code = f"import ray; ray.init({address!r}, logging_level='ERROR'); ray.shutdown()"
    for _ in range(3):
        if subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, timeout=300).returncode == 0:
            return


@contextlib.contextmanager
def local_cluster(embedded_pair: Callable[[], dict], prefix: tuple[str, ...] = ()):
    """``ray start --head --num-cpus 2 --num-gpus 2`` (run under ``prefix``, e.g. ``ip netns exec
    NS``) in its own temp dir and process group, stopped by killing exactly its processes;
    yields ``{"address", "workdir"}`` (the address as seen where the cluster runs), its workdir
    holding the pair ``embedded_pair()`` returns, asked for once the head is up (a first build
    of the pair, in the other pytest worker or here, goes on meanwhile)."""
    temp_dir = tempfile.mkdtemp(prefix="dfo-ray-", dir="/tmp")     # short: Ray's socket paths live under it
    workdir = Path(temp_dir) / "work"
    client_port = free_port()
    # the head gives each Ray Client's server process 30 s to come up; a cold one on a loaded 2-core CI
    # machine took longer. 60 s here, and connect() tries three times: a server that never comes up
    # costs a minute before the next try. gRPC's fork handlers off (docs/ray.md): with them, the
    # head's proxy forking a client's server while its gRPC threads were busy killed that server at
    # start in three of four runs of this file, and that connection waited the full minute
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S": "60", "GRPC_ENABLE_FORK_SUPPORT": "false"}
    start = subprocess.Popen([*prefix, sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--num-cpus", "2",
                              "--num-gpus", "2", "--port", str(free_port()), "--ray-client-server-port", str(client_port),
                              "--node-ip-address", "127.0.0.1", "--include-dashboard=false", "--temp-dir",
                              f"{temp_dir}/ray", "--disable-usage-stats"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    group = start.pid
    try:
        out, _ = start.communicate(timeout=180)
        assert start.returncode == 0, out
        warm_up(f"ray://127.0.0.1:{client_port}", prefix)
        shutil.copytree(Path(embedded_pair()["target"]).parent, workdir / "embedded")
        yield {"address": f"ray://127.0.0.1:{client_port}", "workdir": workdir}
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in cluster_processes(group, temp_dir):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + 5
            while cluster_processes(group, temp_dir) and time.time() < deadline:
                time.sleep(0.2)
        left = cluster_processes(group, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"Ray processes left behind: {left}"


@pytest.fixture(scope="module")
def ray_cluster(request):
    if not HAVE_RAY:
        pytest.skip("ray is not installed (pip install 'dflash-ops[ray]'; CI does)")
    with local_cluster(lambda: request.getfixturevalue("embedded_pair")) as cluster:
        yield cluster


def write_inventory(tmp_path: Path, cluster: dict) -> Path:
    path = tmp_path / "inventory.yaml"
    path.write_text(f"hosts:\n  cluster:\n    kind: ray\n    address: {cluster['address']}\n    roles: [eval]\n"
                    f"    workdir: {cluster['workdir']}\n")
    return path


def cli(inventory: Path, runs: Path, *args, home: Path | None = None, popen: bool = False):
    env = {**os.environ, "DFLASH_OPS_RUNS": str(runs), "COLUMNS": "160"}
    if home:
        env["DFLASH_OPS_HOME"] = str(home)
    argv = [sys.executable, "-m", "orchestrator.cli", "--inventory", str(inventory), *args]
    if popen:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


EVAL = ("eval", "--drafter", "embedded", "--device", "cpu", "--ddtree", "")


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]


def only_run(runs: Path) -> Path:
    (run,) = [d for d in runs.iterdir() if (d / "run.json").exists()]
    return run


def worker_alive(run_dir: Path) -> bool:
    """Is the worker of this run folder (its pid file: pid and start time) still running?"""
    pid, _, start, *_ = (run_dir / "pid").read_text().split()
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z" and fields[19] == start


@contextlib.contextmanager
def held_until_signalled(groups: list[int]):
    """Stop the process groups (SIGSTOP) so that they are still running whenever a `cancel` reaches
    them, however long its Ray Client connection takes; each goes on (SIGCONT) as soon as its leader
    has a SIGTERM pending, and so handles the cancel's signal as a running worker does. Yields the
    list of the groups released that way."""
    import threading

    def sigterm_pending(pid: int) -> bool:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return True                 # gone: nothing left to hold
        masks = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("SigPnd:", "ShdPnd:"))]
        return any(mask & (1 << (signal.SIGTERM - 1)) for mask in masks)

    def go_on(pid: int) -> None:
        try:
            os.killpg(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    done, released = threading.Event(), []

    def release() -> None:
        held = list(groups)
        while held and not done.is_set():
            for pid in [p for p in held if sigterm_pending(p)]:
                go_on(pid)
                held.remove(pid)
                released.append(pid)
            time.sleep(0.05)

    for pid in groups:
        try:
            os.killpg(pid, signal.SIGSTOP)
        except ProcessLookupError:
            pass                        # ended already: the test's own checks say so
    watcher = threading.Thread(target=release, daemon=True)
    watcher.start()
    try:
        yield released
    finally:
        done.set()
        watcher.join(5)
        for pid in groups:
            go_on(pid)


def free_gpus(inventory: Path, runs: Path) -> str:
    proc = cli(inventory, runs, "hosts", "check", "cluster", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (report,) = json.loads(proc.stdout)
    return report["cuda"]


@pytest.mark.models
@needs_ray
def test_hosts_check_reports_the_cluster(ray_cluster, tmp_path):
    inventory = write_inventory(tmp_path, ray_cluster)
    proc = cli(inventory, tmp_path / "runs", "hosts", "check", "cluster", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (report,) = json.loads(proc.stdout)
    assert report["ok"] and report["cuda"] == "ray 2.60.0: 2/2 GPU free"
    (node,) = report["gpus"]
    assert re.fullmatch(r"node [\d.]+: 2 GPU, 2 CPU", node) and report["torch"], report
    assert "SIGTERM" not in proc.stderr


@pytest.mark.models
@pytest.mark.worker
@needs_ray
def test_two_ray_tasks_equal_a_local_run(ray_cluster, tmp_path):
    """Two shards as two Ray actors, each given its own GPU by Ray: the merged run equals a
    single-worker run of the same prompts on `local`, and the GPUs are given back afterwards."""
    inventory = write_inventory(tmp_path, ray_cluster)
    home = ray_cluster["workdir"]           # `local` finds the embedded pair there too
    one = cli(inventory, tmp_path / "one", *EVAL, "--host", "local", "--prompts", "4", "--max-new-tokens", "24",
              home=home)
    assert one.returncode == 0, one.stdout + one.stderr
    two = cli(inventory, tmp_path / "two", *EVAL, "--host", "cluster", "--gpus", "2", "--prompts", "4",
              "--max-new-tokens", "24")
    assert two.returncode == 0, two.stdout + two.stderr
    assert "cluster:gpu0" in two.stdout and "cluster:gpu1" in two.stdout
    single, merged = only_run(tmp_path / "one"), only_run(tmp_path / "two")
    a, b = rows(single), rows(merged)
    assert [{k: r[k] for k in KEYS} for r in b] == [{k: r[k] for k in KEYS} for r in a]
    s1, s2 = (json.loads((d / "summary.json").read_text()) for d in (single, merged))
    assert s2["tau_pooled"] == s1["tau_pooled"] and s2["prompts"] == s1["prompts"] == 4
    env = json.loads((merged / "env.json").read_text())
    placement = env["placement"]
    assert placement["backend"] == "ray" and sorted(placement["gpus"]) == ["0", "1"]
    assert sorted(e["cuda_visible_devices"] for e in env["shards"]) == ["0", "1"]   # Ray's assignment, seen by the worker
    assert [s["gpu"] for s in placement["shards"]] == [e["cuda_visible_devices"] for e in env["shards"]]
    ids = [s["ray"] for s in placement["shards"]]
    assert len({r["actor_id"] for r in ids}) == 2 and placement["ray_job_ids"] == [ids[0]["job_id"]]
    assert all(Path(s["run_dir"]).is_relative_to(ray_cluster["workdir"])
               for s in json.loads((merged / "run.json").read_text())["shards"])
    assert free_gpus(inventory, tmp_path / "two") == "ray 2.60.0: 2/2 GPU free"       # the actors ended


@pytest.mark.models
@pytest.mark.worker
@needs_ray
def test_cancel_stops_the_tasks_and_resume_finishes_without_duplicates(ray_cluster, tmp_path):
    """Cancel right after a detached start: the workers (loading or drafting) and their actors stop;
    `eval --resume` then finishes the run, every prompt exactly once (the skipping of finished
    prompts is the next test's)."""
    from waiting import wait_for

    inventory = write_inventory(tmp_path, ray_cluster)
    runs = tmp_path / "runs"
    # 12 prompts per worker, held (stopped) until the cancel's SIGTERM reaches them: still running then
    started = cli(inventory, runs, *EVAL, "--host", "cluster", "--gpus", "2", "--suite", "humaneval", "--prompts", "24",
                  "--max-new-tokens", "256", "--detach")
    assert started.returncode == 0, started.stdout + started.stderr
    run = only_run(runs)
    shards = [ray_cluster["workdir"] / "runs" / run.name / f"shard-{k}" for k in (0, 1)]
    wait_for(lambda: all((d / "pid").exists() for d in shards), what="both workers")
    assert all(worker_alive(d) for d in shards)
    groups = [int((d / "pid").read_text().split()[0]) for d in shards]
    with held_until_signalled(groups) as released:
        cancelled = cli(inventory, runs, "cancel", run.name)
    assert sorted(released) == sorted(groups)                              # each went on at the cancel's SIGTERM
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    assert not any(worker_alive(d) for d in shards)                       # the workers are stopped
    record = json.loads((run / "run.json").read_text())
    assert record["status"] == "cancelled" and all(s["state"] == "cancelled" for s in record["shards"]), record
    assert "cancelled on cluster:gpu" in cancelled.stdout and f"eval --resume {run.name}" in cancelled.stdout
    assert "{" not in cancelled.stdout                                     # words, not the host's JSON
    assert free_gpus(inventory, runs) == "ray 2.60.0: 2/2 GPU free"        # and the actors with them
    resumed = cli(inventory, runs, "eval", "--resume", run.name)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    merged = rows(run)
    assert len(merged) == 24 and len({r["id"] for r in merged}) == 24     # every prompt exactly once
    assert [r["id"] for r in merged] == json.loads((run / "env.json").read_text())["suite"]["ids"]


@pytest.mark.models
@pytest.mark.worker
@needs_ray
def test_killed_task_is_named_and_resumed_without_duplicates(ray_cluster, tmp_path):
    from runfolders import prompt_events
    from waiting import wait_for

    inventory = write_inventory(tmp_path, ray_cluster)
    runs = tmp_path / "runs"
    proc = cli(inventory, runs, *EVAL, "--host", "cluster", "--gpus", "2", "--prompts", "6", "--max-new-tokens", "160",
               popen=True)
    wait_for(lambda: runs.exists() and any((d / "run.json").exists() for d in runs.iterdir()), what="run record")
    run = only_run(runs)
    shard1 = ray_cluster["workdir"] / "runs" / run.name / "shard-1"
    wait_for(lambda: prompt_events(shard1 / "events.jsonl") >= 1, what="shard 1's first prompt")
    os.kill(int((shard1 / "pid").read_text().split()[0]), signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 1, out
    record = json.loads((run / "run.json").read_text())
    gpu = record["shards"][1]["gpu"]
    assert f"cluster:gpu{gpu} (shard 2/2, state failed, exit code -9)" in out and f"--resume {run.name}" in out
    finished = len((shard1 / "out" / "results.jsonl").read_text().splitlines())
    shard0_starts = (shard1.parent / "shard-0" / "events.jsonl").read_text().count('"start"')
    resumed = cli(inventory, runs, "eval", "--resume", run.name)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    merged = rows(run)
    assert len(merged) == 6 and len({r["id"] for r in merged}) == 6
    starts = [json.loads(line) for line in (shard1 / "events.jsonl").read_text().splitlines() if '"start"' in line]
    assert starts[-1]["done"] == finished                                  # the killed shard skipped its finished prompts
    assert (shard1.parent / "shard-0" / "events.jsonl").read_text().count('"start"') == shard0_starts
    assert json.loads((run / "env.json").read_text())["placement"]["backend"] == "ray"


@pytest.mark.worker
@needs_ray
def test_a_cluster_reached_only_through_an_ssh_host(ssh_lab, embedded_pair, tmp_path):
    """The head runs inside the lab's `eval` host (its network namespace: 127.0.0.1 there is not
    ours); the inventory says `via: eval`, and dflash-ops tunnels to it over that host's SSH."""
    if not ssh_lab.isolated:
        pytest.skip(f"needs the lab's network namespaces ({ssh_lab.fallback_reason})")
    with local_cluster(lambda: embedded_pair, ("ip", "netns", "exec", ssh_lab.eval.netns)) as cluster:
        with socket.socket() as s:                 # not reachable from here directly
            s.settimeout(2)
            assert s.connect_ex(("127.0.0.1", int(cluster["address"].rsplit(":", 1)[1]))) != 0
        inventory = ssh_lab.write_inventory(tmp_path / "inventory.yaml", extra={"cluster": {
            "kind": "ray", "address": cluster["address"], "via": "eval", "workdir": str(cluster["workdir"])}})
        runs = tmp_path / "runs"
        proc = cli(inventory, runs, *EVAL, "--host", "cluster", "--prompts", "2", "--max-new-tokens", "16")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        placement = json.loads((only_run(runs) / "env.json").read_text())["placement"]
        assert placement["backend"] == "ray" and placement["gpus"] in (["0"], ["1"])
    assert not [p for p, (_, _, cmd) in _processes().items() if "-N -L 127.0.0.1:" in cmd]   # the tunnel closed


HOLDER = """
import sys, ray
ray.init(sys.argv[1], namespace="bystander", logging_level="ERROR")
if sys.argv[2] == "hold":
    @ray.remote(num_gpus=1, num_cpus=0)
    class Holder:
        def ping(self):
            return 1
    ray.get(Holder.options(name="holder", lifetime="detached").remote().ping.remote())
else:
    ray.kill(ray.get_actor("holder"))
"""


@pytest.mark.models
@pytest.mark.worker
@needs_ray
def test_a_failed_placement_gives_back_the_gpus_it_placed(ray_cluster, tmp_path, monkeypatch):
    """Another job holds one of the cluster's two GPUs; `--gpus 2`: shard 0's actor takes the
    free GPU, shard 1 cannot be placed and the eval fails. The actor already placed is killed (its
    GPU free again, said in the message): nothing holds a GPU without a run record to cancel it."""
    inventory = write_inventory(tmp_path, ray_cluster)
    runs = tmp_path / "runs"
    holder = [sys.executable, "-c", HOLDER, ray_cluster["address"]]
    assert subprocess.run([*holder, "hold"], capture_output=True, timeout=300).returncode == 0
    try:
        assert free_gpus(inventory, runs) == "ray 2.60.0: 1/2 GPU free"
        monkeypatch.setenv("DFLASH_OPS_RAY_PLACE_TIMEOUT", "15")
        proc = cli(inventory, runs, *EVAL, "--host", "cluster", "--gpus", "2", "--prompts", "2",
                   "--max-new-tokens", "8")
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1 and "Traceback" not in out, out
        assert "Ray did not place a worker" in out and "the 1 shard(s) of this run placed before were released" in out
        assert free_gpus(inventory, runs) == "ray 2.60.0: 1/2 GPU free"       # only the other job's
        assert not runs.exists() or not any(runs.iterdir())                   # no run left
    finally:
        subprocess.run([*holder, "release"], capture_output=True, timeout=300)


@needs_ray
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_the_ray_tunnel_ends_with_the_command(ssh_lab, tmp_path, sig):
    """SIGTERM or SIGHUP of a command holding a `via` tunnel (here `hosts check`, waiting on a Ray
    head that does not answer behind it) ends it at once; the tunnel's ssh (its own session, so
    the signal does not reach it) is closed and its known_hosts pins are gone: no Ray port stays
    open to every local user."""
    if not ssh_lab.isolated:
        pytest.skip(f"needs the lab's network namespaces ({ssh_lab.fallback_reason})")
    inventory = ssh_lab.write_inventory(tmp_path / "inventory.yaml", extra={"cluster": {
        "kind": "ray", "address": f"ray://127.0.0.1:{free_port()}", "via": "eval", "workdir": "/tmp"}})
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "--inventory", str(inventory), "hosts", "check",
                             "cluster"], cwd=REPO, env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    tunnels: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not tunnels:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0] if proc.poll() else ""
            tunnels = [p for p, (ppid, _, cmd) in _processes().items() if ppid == proc.pid and "-N -L 127.0.0.1:" in cmd]
            time.sleep(0.1)
        time.sleep(1.0)
        proc.send_signal(sig)
        signalled = time.monotonic()
        out = proc.communicate(timeout=60)[0]
        # at once, not when the Ray Client gives up on the head (it tries for 30 s)
        assert time.monotonic() - signalled < 15, f"the command took {time.monotonic() - signalled:.0f}s to end: {out}"
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{p}").exists() for p in tunnels) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(Path(f"/proc/{p}").exists() for p in tunnels), f"the tunnel outlived the command: {out}"
        assert not list(tmp.glob("dflash-ops-pins-*")), out
        assert "Traceback" not in out, out
    finally:
        for p in tunnels:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()
