"""SpecForge's environment for the tests that compare with it (tests/test_specforge_ref.py,
tests/test_specforge_parity.py): where its python is, the marks that skip without it, the harness
(tests/specforge_ref.py) run as a subprocess, and the tiny target both compare on.

SpecForge pins transformers 5.8.1 (its spec_generate fails on the project's 5.25), so it has an
environment of its own, ``.ci/specforge-env``, found through ``$DFLASH_OPS_SPECFORGE_PYTHON``
(.ci/run sets it)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

import buildcache

PYTHON_ENV = "DFLASH_OPS_SPECFORGE_PYTHON"
SPECFORGE = os.environ.get(PYTHON_ENV, "")
HARNESS = Path(__file__).with_name("specforge_ref.py")
WHY = (f"SpecForge's environment is not installed: run .ci/specforge-env and set {PYTHON_ENV}=$(.ci/specforge-env) "
       "to compare with SpecForge" if not SPECFORGE else
       f"{PYTHON_ENV}={SPECFORGE} is not an executable (.ci/specforge-env prints the one to name)")
MARKS = [
    pytest.mark.skipif(not (SPECFORGE and os.path.isfile(SPECFORGE) and os.access(SPECFORGE, os.X_OK)), reason=WHY),
    pytest.mark.models,
    pytest.mark.xdist_group("specforge"),     # one worker runs the modules' builds and harness processes
]
# a tiny random Qwen3 (pure attention, 4 layers, vocab 256), weights at std 0.5: decisive logits
TARGET_RECIPE = {"kind": "qwen3", "init_std": 0.5, "tie": False, "seed": 0}
# two prompts of 8 ids (torch.randint(0, 255, (2, 8), generator=torch.Generator().manual_seed(11)))
PROMPTS = [[21, 219, 165, 77, 218, 42, 161, 60], [22, 17, 7, 105, 80, 79, 84, 240]]


def harness(*args: str) -> dict:
    done = subprocess.run([SPECFORGE, str(HARNESS), *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"specforge_ref.py {' '.join(args)}: exit {done.returncode}\n{done.stderr[-4000:]}"
    return json.loads(done.stdout)


def harness_batch(jobs: list[list[str]], folder: Path, name: str) -> list[dict]:
    """The harness's results of the command lines ``jobs``, run in one process (its ``batch``)."""
    path = folder / f"{name}.json"
    path.write_text(json.dumps(jobs))
    return harness("batch", str(path))["results"]


def ok(result: dict) -> dict:
    assert "error" not in result, f"{result['error']}\n{result['traceback']}"
    return result


def env_stamp() -> str:
    """What the harness's builds depend on besides their recipe: its source and SpecForge's environment."""
    pins = Path(SPECFORGE).parent.parent / "dflash-ops-pins.txt"      # written by .ci/specforge-env
    env = pins.read_text() if pins.is_file() else SPECFORGE
    return hashlib.sha256(HARNESS.read_bytes() + b"\0" + env.encode()).hexdigest()[:16]


def target_dir() -> Path:
    """The tiny target (:data:`TARGET_RECIPE`), saved with save_pretrained, built once (tests/buildcache.py)."""
    def build(out):
        from remote.drafters.tiny import tiny_target

        tiny_target(**TARGET_RECIPE).save_pretrained(out / "target")

    return buildcache.built("specforge-target", TARGET_RECIPE, build) / "target"
