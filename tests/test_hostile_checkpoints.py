"""A checkpoint folder is input: its size fields are bounded before anything is allocated from
them, and the memory plan reads the weights a loader reads, each header bounded. Real folders
(the embedded demo pair, safetensors files written with the safetensors library), the real
pre-flight process."""
from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from remote.drafters.checkpoint import CheckpointError, open_checkpoint
from remote.target.memory import WeightsError, parameter_count

REPO = Path(__file__).resolve().parents[1]
HUGE = 1_000_000_000


def preflight(drafter: Path, target: Path) -> dict:
    res = subprocess.run([sys.executable, "-m", "remote.preflight", str(drafter), "--target", str(target),
                          "--device", "cpu", "--prompts", "1", "--max-new-tokens", "8"], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert "Traceback" not in res.stderr, res.stderr
    return json.loads(res.stdout)


@pytest.fixture
def pair(embedded_pair, tmp_path):
    out = {}
    for name in ("drafter", "target"):
        out[name] = tmp_path / name
        shutil.copytree(embedded_pair[name], out[name])
    return out


@pytest.mark.worker
def test_a_huge_block_size_is_refused_by_preflight_before_any_prompt(pair):
    """`block_size: 1000000000` in the drafter's config: pre-flight refuses it, naming the field
    and the bound (it passed, the worker evaluated every prompt, then died building the summary)."""
    cfg = json.loads((pair["drafter"] / "config.json").read_text())
    cfg["block_size"] = HUGE
    (pair["drafter"] / "config.json").write_text(json.dumps(cfg))
    found = preflight(pair["drafter"], pair["target"])
    assert not found["inspect"]["ok"], found
    assert any(f"block_size {HUGE} is outside 0..1024" in p for p in found["inspect"]["problems"]), found
    for key in ("hidden_size", "num_hidden_layers", "vocab_size"):     # every size field is bounded
        bad = dict(cfg, block_size=8, **{key: HUGE})
        (pair["drafter"] / "config.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match=rf"{key} {HUGE} is outside"):
            open_checkpoint(pair["drafter"])


def test_show_refuses_a_run_whose_env_json_has_no_real_block_size(tmp_path):
    """`show` of a run folder whose env.json says block_size 2,000,000: one line, no metrics
    allocated per position of such a block."""
    import os

    from fakeruns import make_run

    runs = tmp_path / "runs"
    make_run(runs, "20261202-210130-zlab-ct129", "zlab")
    env_path = runs / "20261202-210130-zlab-ct129" / "env.json"
    env = json.loads(env_path.read_text())
    env["settings"]["block_size"] = 2_000_000
    env_path.write_text(json.dumps(env))
    res = subprocess.run([sys.executable, "-m", "orchestrator.cli", "show", "20261202-210130-zlab-ct129",
                          "--runs-dir", str(runs)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "COLUMNS": "120"})
    out = res.stdout + res.stderr
    assert res.returncode == 2 and "Traceback" not in out, out
    assert f"{env_path}: block_size 2000000 is not a block size (1..1024)" in out, out


def write_weights(folder: Path) -> None:
    """A consolidated model.safetensors and the same tensors as two shards with their index (what
    a checkpoint that saved both holds): 105 parameters."""
    a, b = np.zeros((10, 10), np.float32), np.zeros(5, np.float32)
    save_file({"a": a, "b": b}, str(folder / "model.safetensors"))
    save_file({"a": a}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({"b": b}, str(folder / "model-00002-of-00002.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))


def hostile(path: Path, header_length: int = 1 << 62) -> None:
    path.write_bytes(struct.pack("<Q", header_length) + b"{}")


def test_the_memory_plan_counts_each_weight_once_and_reads_no_unbounded_header(tmp_path):
    write_weights(tmp_path)
    hostile(tmp_path / "extra.safetensors")
    assert parameter_count(tmp_path) == 105                     # the index's shards, once; extra.* unread
    (tmp_path / "model.safetensors.index.json").unlink()
    assert parameter_count(tmp_path) == 105                     # model.safetensors alone
    only = tmp_path / "only"
    only.mkdir()
    hostile(only / "weights.safetensors")
    with pytest.raises(WeightsError, match=r"weights.safetensors: not a readable safetensors file \(header length"):
        parameter_count(only)


@pytest.mark.worker
def test_preflight_plans_a_drafter_with_a_consolidated_copy_of_its_weights_once(pair):
    """The drafter's weights also saved as a one-shard set beside model.safetensors (the reader
    loads model.safetensors): the plan's drafter term does not double; a hostile extra file is a
    pre-flight problem named in one line, not a MemoryError traceback."""
    plain = preflight(pair["drafter"], pair["target"])["memory"]["drafter"]
    shutil.copy(pair["drafter"] / "model.safetensors", pair["drafter"] / "model-00001-of-00001.safetensors")
    assert preflight(pair["drafter"], pair["target"])["memory"]["drafter"] == plain
    (pair["target"] / "model.safetensors").rename(pair["target"] / "model-00001-of-00001.safetensors")
    hostile(pair["target"] / "model-00001-of-00001.safetensors.extra.safetensors")
    found = preflight(pair["drafter"], pair["target"])
    assert not found["inspect"]["ok"] and any("not a readable safetensors file" in p
                                              for p in found["inspect"]["problems"]), found


def test_a_large_pickle_rewritten_at_the_same_size_is_checked_again(tmp_path):
    """A `.bin` over 64 MiB (not hashed: a pickle is loaded whole) rewritten with other bytes of the
    same size, its modification time put back: the kept pre-flight checks are not reused (they were
    keyed on its size alone, and said ok for a file of zeros)."""
    import argparse
    import os

    from remote.preflight import HASHED_WHOLE, pass_keys

    drafter, target = tmp_path / "drafter", tmp_path / "target"
    for folder in (drafter, target):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    weights = drafter / "model.bin"
    with open(weights, "wb") as fh:
        fh.truncate(HASHED_WHOLE + 1)                 # sparse: no 64 MiB written
    args = argparse.Namespace(drafter=str(drafter), target=str(target), verify_hashes=False, suite="default")
    versions = {"torch": "2.13.0", "transformers": "5.25.0"}
    first = pass_keys(args, "cpu", versions)
    assert pass_keys(args, "cpu", versions) == first
    st = weights.stat()
    with open(weights, "r+b") as fh:
        fh.write(b"\x80")                             # the same size, other content
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_size == st.st_size and weights.stat().st_mtime_ns == st.st_mtime_ns
    assert pass_keys(args, "cpu", versions)["checks"] != first["checks"]


@pytest.mark.worker
def test_no_load_of_a_target_runs_its_folders_code(tmp_path):
    """A target of a model type transformers does not know, with an auto_map naming its own code,
    and "y" on stdin: the pre-flight's config read, the tokenizer count and the model load refuse it
    without asking, and the code never runs (it ran on "y", and transformers' question went to stdout)."""
    import os

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({
        "model_type": "hostile_remote", "architectures": ["HostileModel"], "num_hidden_layers": 2, "hidden_size": 8,
        "vocab_size": 16, "auto_map": {"AutoConfig": "configuration_hostile.HostileConfig",
                                       "AutoModelForCausalLM": "modeling_hostile.HostileModel",
                                       "AutoTokenizer": ["tokenization_hostile.HostileTokenizer", None]}}))
    (target / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "HostileTokenizer", "auto_map": {
        "AutoTokenizer": ["tokenization_hostile.HostileTokenizer", None]}}))
    ran = tmp_path / "ran"
    for module in ("configuration_hostile", "modeling_hostile", "tokenization_hostile"):
        (target / f"{module}.py").write_text(f"import pathlib\npathlib.Path({str(ran)!r}).write_text('{module}')\n")
    code = ("import sys\n"
            "from remote.preflight import runtime_problems\n"
            "from remote.suites.prompts import PromptRow\n"
            "from remote.target.memory import count_tokens\n"
            "from remote.target.model import load_target\n"
            f"target = {str(target)!r}\n"
            "problems = runtime_problems(target)\n"
            "assert len(problems) == 1 and 'custom code' in problems[0] and '\\n' not in problems[0], problems\n"
            "assert count_tokens(target, [PromptRow('a', None, ['hello'], None)]) == [[None, 5, 1]]\n"
            "try:\n    load_target(target)\nexcept ValueError as e:\n    assert 'custom code' in str(e)\n"
            "else:\n    raise AssertionError('loaded')\n"
            "print('refused', file=sys.stderr)\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, input="y\ny\ny\n", capture_output=True, text=True,
                         timeout=300, env={**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")})
    assert res.returncode == 0 and "refused" in res.stderr, res.stderr[-3000:]
    assert res.stdout == "" and not ran.exists()
