"""GPU-only paths (skipped without CUDA; not run on the CPU machines this project is built on)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.gpu
SGLANG_PYTHON = os.environ.get("DFLASH_OPS_SGLANG_PYTHON")
NEEDS_SGLANG = pytest.mark.skipif(not SGLANG_PYTHON, reason="no SGLang environment: set DFLASH_OPS_SGLANG_PYTHON to "
                                                            "its python (a GPU host)")

_FEATURES = """
import sys, json, torch
if sys.argv[2] == "torch":
    sys.modules["fla"] = None           # force the pure-torch Gated DeltaNet path
from remote.target.model import load_target, target_features, gdn_kernel_path
model = load_target(sys.argv[1], "cuda", "bfloat16")
ids = torch.arange(1, 200, device="cuda")[None] % 250
_, th = target_features(model, ids, [0, 1, 2])
torch.save(th.float().cpu(), sys.argv[3])
print(json.dumps({"kernel_path": gdn_kernel_path(model)}))
"""


@pytest.mark.worker
def test_worker_bf16_on_cuda(embedded_pair, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for mode in ("offline", "online"):
        out = tmp_path / mode
        proc = subprocess.run([sys.executable, "-m", "remote.worker", "--target", embedded_pair["target"],
                               "--drafter", embedded_pair["drafter"], "--prompts", "3", "--out", str(out),
                               "--device", "cuda", "--mode", mode, "--max-new-tokens", "96"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        env_json = json.loads((out / "env.json").read_text())
        assert env_json["dtype"] == "bfloat16" and env_json["gpu"]
        assert env_json["kernel_path"] in ("fla", "torch")
        summary = json.loads((out / "summary.json").read_text())
        assert summary["tau_pooled"] > 1.0
        if mode == "online":      # exact, or diverged only at near-ties (the worker exits 4 otherwise)
            rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
            near = [r["divergence"] for r in rows if r.get("divergence")]
            print(f"bf16 online: {len(rows) - len(near)} of {len(rows)} prompts exact; near-ties: {near}")
            assert all(d["near_tie"] for d in near)


@pytest.mark.models
def test_rollback_self_test_on_cuda():
    """The pre-flight self-test with the CUDA kernels a host would use (fla where installed)."""
    import torch
    import transformers

    from remote.target.cache import self_test
    from remote.drafters.tiny import tiny_target

    for config in (tiny_target("qwen3_5").config, transformers.Qwen3_5Config()):
        assert self_test(config, "cuda") is None
    assert torch.cuda.is_available()


@pytest.mark.worker
def test_online_fp32_on_cuda_is_exact(embedded_pair, tmp_path):
    """In float32 a greedy online run on CUDA equals the target's own greedy output token for token."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = tmp_path / "fp32"
    proc = subprocess.run([sys.executable, "-m", "remote.worker", "--target", embedded_pair["target"],
                           "--drafter", embedded_pair["drafter"], "--prompts", "3", "--out", str(out),
                           "--device", "cuda", "--dtype", "float32", "--mode", "online", "--max-new-tokens", "96"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["online"]["lossless"] is True, summary


@pytest.mark.worker
def test_online_ddtree_on_cuda_equals_greedy(embedded_pair, tmp_path):
    """Online DDTree at T = 0 on CUDA, on the hybrid demo target (the tree's 4D mask through sdpa, the
    Gated DeltaNet tree recurrence through the kernels transformers bound: fla where installed): in
    float32 every budget's output is the target's greedy output token for token; in bfloat16 it is,
    or leaves it only at a near-tie (the worker exits 4 otherwise), as the linear decoding's rule;
    every cycle's stages are timed."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        proc = subprocess.run([sys.executable, "-m", "remote.worker", "--target", embedded_pair["target"],
                               "--drafter", embedded_pair["drafter"], "--prompts", "3", "--out", str(out),
                               "--device", "cuda", "--dtype", dtype, "--mode", "online", "--ddtree", "4,16",
                               "--max-new-tokens", "96"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
        summary = json.loads((out / "summary.json").read_text())
        kernels = json.loads((out / "env.json").read_text())["kernel_path"]
        for b in ("4", "16"):
            dd = summary["ddtree"][b]
            near = [r["ddtree"][b]["divergence"] for r in rows if r["ddtree"][b].get("divergence")]
            print(f"{dtype} DDTree-{b} on CUDA ({kernels}): τ {dd['tau_pooled']:.3f}, "
                  f"{len(rows) - len(near)} of {len(rows)} prompts exact, near-ties: {near}")
            assert dd["tau_pooled"] > 1.0 and dd["stage_s_per_cycle"]["verify"] > 0
            if dtype == "float32":
                assert dd["lossless"] is True, near
            else:
                assert all(d["near_tie"] for d in near), near


@pytest.mark.worker
def test_fla_vs_torch_fallback_feature_drift_is_reported(embedded_pair, tmp_path):
    pytest.importorskip("fla")
    import torch

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    paths = {}
    for path in ("fla", "torch"):
        paths[path] = tmp_path / f"{path}.pt"
        proc = subprocess.run([sys.executable, "-c", _FEATURES, embedded_pair["target"], path, str(paths[path])],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert json.loads(proc.stdout.strip().splitlines()[-1])["kernel_path"] == path
    a, b = torch.load(paths["fla"]), torch.load(paths["torch"])
    drift = (a - b).abs().max().item()
    print(f"fla vs torch-fallback bf16 feature drift: max |diff| = {drift:.3e}")
    assert drift < 1.0, drift    # a few bf16 ulps are expected; a large drift means a kernel problem


def engine_run(pair: dict, drafter, out: Path) -> tuple[dict, list[dict], dict]:
    """``eval --engine`` on CUDA with SGLang started by the worker: (env.json, rows, summary.json)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "remote.worker", "--target", pair["target"], "--drafter",
                           str(drafter), "--prompts", "3", "--out", str(out), "--device", "cuda",
                           "--max-new-tokens", "64", "--engine", "--engine-kind", "sglang",
                           "--engine-python", SGLANG_PYTHON],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return json.loads((out / "env.json").read_text()), rows, json.loads((out / "summary.json").read_text())


@pytest.mark.models
@pytest.mark.worker
@NEEDS_SGLANG
def test_worker_engine_phase_with_a_real_sglang_server(tmp_path_factory, tmp_path):
    """eval --engine on a real SGLang server (DFLASH speculative algorithm) started by the worker:
    the engine's output equals ours, its counters are recorded and its τ is explained."""
    from enginelab import engine_pair

    pair = engine_pair(tmp_path_factory)
    env, rows, summary = engine_run(pair, pair["drafter"], tmp_path / "out")
    assert env["engine"]["served"]["drafter"]["algorithm"] == "DFLASH"
    for r in rows:
        e = r["engine"]
        assert e["kind"] == "sglang" and e["cycles"] and e["plain"]["output_ids"]
        assert e["tau"] == pytest.approx(e["tokens"] / e["cycles"])
        assert "unexplained" not in e["causes"], e["checks"]
    assert summary["engine"]["prompts"] == 3


@pytest.mark.models
@pytest.mark.worker
@NEEDS_SGLANG
@pytest.mark.parametrize("family,algorithm", [("dspark", "DSPARK"), ("domino", "DFLASH")])
def test_real_sglang_serves_specforge_families(family, algorithm, tmp_path_factory, tmp_path):
    """eval --engine with SGLang started by the worker for a drafter of SpecForge's ``family`` (the
    engine pair's trained backbone with the family's heads, in SpecForge's format): the server runs
    the family's algorithm (DSPARK with γ = 7, DFLASH scoring the full vocabulary for Domino) with
    the drafter's 7 drafts per verify; its τ is its own count (completion tokens / verify steps),
    beside ours, and every difference from ours is explained (an output that leaves ours in bfloat16
    included: ``divergence``)."""
    from enginelab import engine_pair, family_drafter

    pair = engine_pair(tmp_path_factory)
    drafter = family_drafter(pair["drafter"], family, tmp_path / "drafter", fmt="specforge")
    env, rows, summary = engine_run(pair, drafter, tmp_path / "out")
    served = env["engine"]["served"]["drafter"]
    assert served["algorithm"] == algorithm and served["num_speculative_tokens"] == 7, served
    for r in rows:
        e = r["engine"]
        assert e["kind"] == "sglang" and e["cycles"] and e["plain"]["output_ids"]
        assert e["tau"] == pytest.approx(e["tokens"] / e["cycles"]) and e["draft_tokens"] == 7 * e["cycles"]
        assert "unexplained" not in e["causes"], e["checks"]
    s = summary["engine"]
    print(f"SGLang {algorithm} ({family}): engine τ {s['tau_pooled']:.3f}, ours {summary['tau_pooled']:.3f} "
          f"over {s['prompts']} prompts; causes {s['causes']}")
    assert s["prompts"] == 3
