"""`eval --gpus`: one worker per GPU of a host, prompts sharded, followed and merged as one run.
No GPU here: the ids become CPU workers, each started with its own CUDA_VISIBLE_DEVICES."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import finished, started

from orchestrator.errors import InputError
from orchestrator.eval.placement import host_gpu_ids, parse_gpus

REPO = Path(__file__).resolve().parents[1]
KEYS = ("id", "prompt_ids", "output_ids", "acceptance_lengths")


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]


def test_gpu_specs_expand_per_host():
    assert parse_gpus("all") == "all" and parse_gpus("3") == 3 and parse_gpus("0,2,5") == ["0", "2", "5"]
    assert parse_gpus("3,") == ["3"] and parse_gpus(None) is None
    for bad in ("0,0", "-1", "two", "0;1", ""):
        with pytest.raises(InputError, match="--gpus"):
            parse_gpus(bad)
    assert host_gpu_ids("all", "h", visible=4, inventory_gpus=None, cpu=False) == ["0", "1", "2", "3"]
    assert host_gpu_ids(2, "h", visible=4, inventory_gpus=None, cpu=False) == ["0", "1"]
    assert host_gpu_ids(["0", "5"], "h", visible=0, inventory_gpus=None, cpu=True) == ["0", "5"]   # CPU labels
    assert host_gpu_ids("all", "h", visible=0, inventory_gpus=3, cpu=True) == ["0", "1", "2"]
    with pytest.raises(InputError, match="no GPU 5 .it has 4: 0, 1, 2, 3"):
        host_gpu_ids(["0", "5"], "h", visible=4, inventory_gpus=None, cpu=False)
    with pytest.raises(InputError, match="--gpus 8, but it has 4 GPU"):
        host_gpu_ids(8, "h", visible=4, inventory_gpus=None, cpu=False)
    with pytest.raises(InputError, match="no CUDA GPU"):
        host_gpu_ids("all", "h", visible=0, inventory_gpus=None, cpu=True)


@pytest.fixture(scope="module")
def local_home(embedded_pair, tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    shutil.copytree(Path(embedded_pair["target"]).parent, home / "embedded")
    return home


def start_local_eval(home: Path, runs: Path, *args, own_threads: bool = False) -> subprocess.Popen:
    """``own_threads``: without the suite's OMP_NUM_THREADS=1, so the workers choose their threads."""
    env = {**os.environ, "DFLASH_OPS_HOME": str(home), "DFLASH_OPS_RUNS": str(runs), "COLUMNS": "160"}
    env.pop("DFLASH_OPS_INVENTORY", None)
    if own_threads:
        env.pop("OMP_NUM_THREADS", None)
    return subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "eval", "--host", "local", "--prompts", "5",
                             "--max-new-tokens", "40", "--ddtree", "", *args], cwd=home, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def local_eval(home: Path, runs: Path, *args) -> subprocess.CompletedProcess:
    return finished(start_local_eval(home, runs, *args))


def only_run(runs: Path) -> Path:
    (run,) = [d for d in runs.iterdir() if (d / "run.json").exists()]
    return run


def test_two_gpu_workers_equal_one_worker(local_home, tmp_path):
    procs = {}
    for name, args in (("one", ()), ("two", ("--gpus", "0,1")),
                       ("capped", ("--gpus", "3", "--prompts", "2", "--max-blocks", "1"))):
        if procs:
            started(tmp_path / list(procs)[-1], list(procs.values())[-1], local_home / "code")
        procs[name] = start_local_eval(local_home, tmp_path / name, *args, own_threads=name == "two")
    one, two, capped = (finished(p) for p in procs.values())
    assert one.returncode == 0, one.stdout + one.stderr
    assert two.returncode == 0, two.stdout + two.stderr
    assert "local:gpu0" in two.stdout and "local:gpu1" in two.stdout
    single, merged = only_run(tmp_path / "one"), only_run(tmp_path / "two")
    a, b = rows(single), rows(merged)
    assert [{k: r[k] for k in KEYS} for r in b] == [{k: r[k] for k in KEYS} for r in a]
    ids = [r["id"] for r in b]
    assert len(ids) == 5 and len(set(ids)) == 5                       # every prompt exactly once
    s1, s2 = (json.loads((d / "summary.json").read_text()) for d in (single, merged))
    assert s2["tau_pooled"] == s1["tau_pooled"] and s2["prompts"] == s1["prompts"] == 5
    env = json.loads((merged / "env.json").read_text())
    assert env["placement"]["backend"] == "ssh" and env["placement"]["gpus"] == ["0", "1"]
    assert [(p["host"], p["gpu"]) for p in env["placement"]["shards"]] == [("local", "0"), ("local", "1")]
    assert [e["cuda_visible_devices"] for e in env["shards"]] == ["0", "1"]   # each worker saw its own GPU
    share = max(1, (os.cpu_count() or 1) // 2)                        # two CPU workers: half the cores each
    assert [e["cpu_threads"] for e in env["shards"]] == [share, share]
    assert json.loads((single / "env.json").read_text())["placement"]["gpus"] == []
    assert capped.returncode == 0, capped.stdout + capped.stderr          # 3 GPUs, 2 prompts: 2 workers
    placed = json.loads((only_run(tmp_path / "capped") / "env.json").read_text())["placement"]
    assert placed["gpus"] == ["0", "1"]
    record = json.loads((merged / "run.json").read_text())
    assert [s["gpu"] for s in record["shards"]] == ["0", "1"] and record["request"]["gpus"] == "0,1"


@pytest.mark.worker
def test_an_omp_num_threads_the_user_set_wins_over_the_cpu_share():
    code = "import torch; from remote.worker import share_cores; share_cores(torch); print(torch.get_num_threads())"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    threads = [subprocess.run([sys.executable, "-c", code], env={**env, "DFLASH_OPS_CPU_WORKERS": "2", **omp},
                              cwd=REPO, capture_output=True, text=True, timeout=120, check=True).stdout.strip()
               for omp in ({}, {"OMP_NUM_THREADS": str(os.cpu_count() or 1)})]
    assert threads == [str(max(1, (os.cpu_count() or 1) // 2)), str(os.cpu_count() or 1)]


def test_bad_gpus_is_one_red_line(local_home, tmp_path):
    twice, every = (start_local_eval(local_home, tmp_path / "runs", "--gpus", spec) for spec in ("0,0", "all"))
    proc = finished(twice)                                  # refused before any run starts: side by side
    assert proc.returncode != 0 and "a GPU id is listed twice" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    proc = finished(every)
    assert proc.returncode != 0 and "no CUDA GPU" in proc.stdout + proc.stderr


@pytest.mark.worker
def test_dead_gpu_worker_is_named_and_resume_reruns_only_its_prompts(ssh_lab, embedded_pair, tmp_path):
    """On a real SSH host: two CPU workers; one is killed mid-run; the failure names its shard;
    --resume restarts that shard only, and the merged run has every prompt exactly once."""
    from runfolders import prompt_events
    from waiting import wait_for

    host = ssh_lab.eval.root
    shutil.copytree(Path(embedded_pair["target"]).parent, host / "workdir" / "embedded", dirs_exist_ok=True)
    inventory = ssh_lab.write_inventory(tmp_path / "inventory.yaml")
    runs = tmp_path / "runs"
    env = {**os.environ, "DFLASH_OPS_RUNS": str(runs), "COLUMNS": "160"}
    base = [sys.executable, "-m", "orchestrator.cli", "--inventory", str(inventory), "eval"]
    proc = subprocess.Popen([*base, "--host", "eval", "--gpus", "2", "--drafter", "embedded", "--device", "cpu",
                             "--prompts", "6", "--max-new-tokens", "160", "--ddtree", ""],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: runs.exists() and any((d / "run.json").exists() for d in runs.iterdir()), what="run record")
    run_id = only_run(runs).name
    shard1 = host / "workdir" / "runs" / run_id / "shard-1"
    wait_for(lambda: prompt_events(shard1 / "events.jsonl") >= 1, what="shard 1's first prompt")
    os.kill(int((shard1 / "pid").read_text().split()[0]), signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 1, out
    assert "eval:gpu1 (shard 2/2, state failed, exit code -9)" in out and f"--resume {run_id}" in out
    assert "eval:gpu0 (shard" not in out
    finished = len((shard1 / "out" / "results.jsonl").read_text().splitlines())
    shard0_starts = (host / "workdir" / "runs" / run_id / "shard-0" / "events.jsonl").read_text().count('"start"')
    resumed = subprocess.run([*base, "--resume", run_id], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    merged = rows(runs / run_id)
    assert sorted(r["id"] for r in merged) == sorted(set(r["id"] for r in merged)) and len(merged) == 6
    assert [r["id"] for r in merged] == json.loads((runs / run_id / "env.json").read_text())["suite"]["ids"]
    starts = [json.loads(line) for line in (shard1 / "events.jsonl").read_text().splitlines()
              if '"start"' in line]
    assert starts[-1]["done"] == finished                             # shard 1 skipped its finished prompts
    assert (host / "workdir" / "runs" / run_id / "shard-0" / "events.jsonl").read_text().count('"start"') \
        == shard0_starts                                               # the finished shard was not restarted


def test_memory_preflight_refuses_with_the_numbers(local_home, tmp_path):
    """Pre-flight plans target + drafter + KV cache + logits of the longest prompt against the
    memory it may use (here capped by --max-memory) and refuses before any worker starts."""
    runs = tmp_path / "runs"
    proc = local_eval(local_home, runs, "--max-memory", "0.0001")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out
    numbers = re.search(r"the plan does not fit in memory: target ([\d.]+ \w+) \+ drafter ([\d.]+ \w+) \+ KV cache "
                        r"([\d.]+ \w+) \+ logits ([\d.]+ \w+) \(longest context ([\d,]+) tokens\) = ([\d.]+ \w+) > "
                        r"104.86 KiB free on cpu", out)
    assert numbers, out
    assert int(numbers.group(5).replace(",", "")) > 40                       # prompt tokens + 40 new tokens
    assert not runs.exists() or not any(runs.iterdir())                  # nothing started, no run left


def test_memory_plan_numbers():
    """The plan's terms from configs and safetensors headers, checked against their formulas."""
    from remote.target.memory import kv_bytes_per_token, longest_context
    from remote.suites.prompts import PromptRow

    cfg = {"num_hidden_layers": 8, "layer_types": ["linear_attention"] * 6 + ["full_attention"] * 2,
           "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256}
    assert kv_bytes_per_token(cfg, 2) == 2 * 2 * 4 * 256 * 2              # K+V x 2 full layers x 4 heads x 256 x bf16
    rows = [PromptRow("a", None, None, [1] * 100), PromptRow("b", None, ["x" * 10, "y" * 30], None)]
    assert longest_context(rows, None, 64) == max(100 + 64, 40 + 2 * (64 + 32))


@pytest.mark.worker
def test_worker_refuses_a_plan_that_does_not_fit_before_loading(embedded_pair, tmp_path):
    """A worker run by hand makes the same plan before it loads any weights."""
    proc = subprocess.run([sys.executable, "-m", "remote.worker", "--target", embedded_pair["target"], "--drafter",
                           embedded_pair["drafter"], "--out", str(tmp_path / "o"), "--device", "cpu", "--prompts", "2",
                           "--max-memory", "0.0001"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "the plan does not fit in memory: target" in proc.stderr and "loading target" not in proc.stderr
    assert not (tmp_path / "o" / "results.jsonl").exists()


@pytest.mark.gpu
def test_every_gpu_of_this_machine_runs_a_worker(local_home, tmp_path):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    one = local_eval(local_home, tmp_path / "one", "--device", "cuda", "--dtype", "float32")
    assert one.returncode == 0, one.stdout + one.stderr
    every = local_eval(local_home, tmp_path / "all", "--device", "cuda", "--dtype", "float32", "--gpus", "all")
    assert every.returncode == 0, every.stdout + every.stderr
    single, merged = only_run(tmp_path / "one"), only_run(tmp_path / "all")
    assert [r["id"] for r in rows(merged)] == [r["id"] for r in rows(single)]
    env = json.loads((merged / "env.json").read_text())
    assert [e["cuda_visible_devices"] for e in env["shards"]] == [str(i) for i in range(torch.cuda.device_count())]
