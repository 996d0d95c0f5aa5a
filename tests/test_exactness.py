"""Exact decoding on the transformers a host has: the rollback's self-test, the supported range,
and a greedy online run that is not lossless ending as an error, never as a result."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
import yaml
from hostpython import host_python

from remote.contract import exits
from remote.target import cache as target_cache
from remote.target.cache import CacheMark, self_test
from remote.drafters.tiny import tiny_target
from remote.contract.versions import (TRANSFORMERS_TESTED, parse, transformers_problem, transformers_range,
                                      transformers_status)

pytestmark = pytest.mark.exactness
REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- the self-test

CONFIGS = {
    "qwen3 (tiny)": lambda: tiny_target("qwen3").config,
    "qwen3_5 hybrid (tiny)": lambda: tiny_target("qwen3_5").config,
    "Qwen3_5Config (the VLM, text_config)": lambda: transformers.Qwen3_5Config(),
    "Qwen3_5MoeConfig": lambda: transformers.Qwen3_5MoeConfig(),
}


@pytest.mark.models
@pytest.mark.parametrize("name", CONFIGS)
def test_rollback_self_test_passes_with_this_transformers(name):
    assert self_test(CONFIGS[name]()) is None


def known_states_only(cache) -> CacheMark:
    """A rollback that copies only the conv and recurrent states of a linear layer (what a
    hand-written copy of the layer's known tensors does)."""
    return CacheMark([(layer, {"conv_states": {i: t.clone() for i, t in layer.conv_states.items() if t is not None},
                               "recurrent_states": {i: t.clone() for i, t in layer.recurrent_states.items()
                                                    if t is not None}})
                      for layer in cache.layers if target_cache.is_linear(layer)])


def restore_known_states(cache, mark: CacheMark, forwarded: int) -> None:
    for layer, state in mark.states:
        for name, saved in state.items():
            for i, t in saved.items():
                getattr(layer, name)[i].copy_(t)
    target_cache.crop_attention(cache, forwarded)


@pytest.mark.models
def test_self_test_catches_a_rollback_that_misses_state(monkeypatch):
    config = tiny_target("qwen3_5").config
    monkeypatch.setattr(target_cache, "checkpoint", lambda cache: CacheMark([]))
    failure = self_test(config)
    assert failure and ("differ" in failure or "positions" in failure)
    # a copy of the two known states is enough only where the layer keeps nothing else that a forward
    # changes; transformers 5.25 added a token counter that sets the next position ids
    monkeypatch.setattr(target_cache, "checkpoint", known_states_only)
    monkeypatch.setattr(target_cache, "rewind", restore_known_states)
    cache = target_cache.new_cache(tiny_target("qwen3_5"))
    extra = {n for layer in cache.layers if target_cache.is_linear(layer) for n in vars(layer)} - {
        "conv_states", "recurrent_states"}
    if any(n.startswith("cumulative_length") for n in extra):
        assert self_test(config), "a conv/recurrent-only copy passed although the layer counts tokens"
    else:
        assert self_test(config) is None


# ----------------------------------------------------------------------------- the supported range

def test_version_range_is_one_fact():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"transformers{transformers_range()}"' in pyproject
    constraints = (REPO / ".ci" / "constraints.txt").read_text()
    pinned = re.search(r"^transformers==(\S+)$", constraints, re.M).group(1)
    assert pinned == TRANSFORMERS_TESTED[0], "the constraints file pins the first tested version"
    assert all(transformers_status(v) == "tested" for v in TRANSFORMERS_TESTED)
    installed = transformers.__version__
    assert transformers_problem(installed) is None, f"this suite runs on an unsupported {installed}"


def test_versions_in_and_out_of_range():
    assert parse("5.25.0") == (5, 25, 0) and parse("5.26.0rc1") == (5, 26, 0) and parse("2.13.0+cpu") == (2, 13, 0)
    assert transformers_status("5.13.9") == "unsupported" and transformers_status("6.0.0") == "unsupported"
    assert transformers_status("5.20.1") == "untested"
    assert "outside the range" in transformers_problem("5.2.0") and "tested:" in transformers_problem("5.2.0")
    assert transformers_problem(None) == "transformers is not installed"


def fake_transformers_version(folder: Path, version: str) -> Path:
    """A ``transformers-VERSION.dist-info`` that importlib.metadata finds first: the host reports
    that version while the real package still imports."""
    info = folder / f"transformers-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: transformers\nVersion: {version}\n")
    return folder


@pytest.mark.worker
def test_preflight_refuses_a_host_outside_the_range_naming_the_versions(embedded_pair, tmp_path):
    site = fake_transformers_version(tmp_path / "site", "5.13.0")
    proc = subprocess.run([sys.executable, "-m", "remote.preflight", embedded_pair["drafter"], "--target",
                           embedded_pair["target"], "--device", "cpu"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}"}, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    problems = json.loads(proc.stdout)["inspect"]["problems"]
    assert problems == [f"transformers 5.13.0 is outside the range the worker supports ({transformers_range()}; "
                        f"tested: {', '.join(TRANSFORMERS_TESTED)})"]


def preflight(drafter, target, *args: str, site: Path | None = None) -> tuple[int, dict]:
    path = f"{site}{os.pathsep}{REPO}" if site else str(REPO)
    proc = subprocess.run([sys.executable, "-m", "remote.preflight", str(drafter), "--target", str(target), "--device",
                           "cpu", "--prompts", "2", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": path}, timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.worker
def test_a_kept_preflight_pass_is_reused_only_for_the_same_files_and_libraries(embedded_pair, tmp_path):
    """`--cache`: a pass (the checks, the self-test and the prompts' token counts) is reused for the
    same inputs, the memory plan computed again (with the free memory measured now, and the run's
    prompts and tokens), also for the same files elsewhere or touched (the report naming the paths
    of the pre-flight that reuses it); another transformers version, a changed file, a failure or
    --verify-hashes is checked afresh."""
    from remote.target.memory import plan_for_suite

    pair = {k: shutil.copytree(v, tmp_path / k) for k, v in embedded_pair.items()}
    cache = ("--cache", str(tmp_path / "cache"))

    def kept() -> list[str]:
        return sorted(p.name.split("-")[0] for p in (tmp_path / "cache").iterdir())

    code, first = preflight(pair["drafter"], pair["target"], *cache)
    assert code == 0 and not first["reused"] and first["memory"]["fits"]
    assert kept() == ["checks", "self", "tokens"]
    code, again = preflight(pair["drafter"], pair["target"], *cache)
    assert code == 0 and again["reused"] and again["inspect"] == first["inspect"]
    assert {k: again["memory"][k] for k in ("need", "context_tokens")} == \
        {k: first["memory"][k] for k in ("need", "context_tokens")}
    code, settings = preflight(pair["drafter"], pair["target"], *cache, "--prompts", "7", "--max-new-tokens", "40",
                               "--dtype", "bfloat16")
    assert code == 0 and settings["reused"] and settings["memory"]["context_tokens"] != first["memory"]["context_tokens"]
    fresh = plan_for_suite(pair["target"], pair["drafter"], "default", 7, 40, "cpu", "bfloat16").to_dict()  # counted now
    sizes = ("target", "drafter", "kv_cache", "logits", "context_tokens", "need")
    assert {k: settings["memory"][k] for k in sizes} == {k: fresh[k] for k in sizes}
    code, tight = preflight(pair["drafter"], pair["target"], *cache, "--max-memory", "0.0001")
    assert code == 1 and tight["reused"] and not tight["memory"]["fits"]        # the free memory is now's
    (kept_test,) = (tmp_path / "cache").glob("self-test-*.json")
    kept_test.write_text('{"not": "a self-test"}')                               # not a part: run again
    code, garbled = preflight(pair["drafter"], pair["target"], *cache)
    assert code == 0 and not garbled["reused"] and json.loads(kept_test.read_text()) == []
    elsewhere = {k: shutil.copytree(v, tmp_path / f"elsewhere-{k}") for k, v in pair.items()}
    code, moved = preflight(elsewhere["drafter"], elsewhere["target"], *cache)
    assert code == 0 and moved["reused"] and kept() == ["checks", "self", "tokens"]
    assert moved["inspect"]["drafter"] == str(elsewhere["drafter"])
    assert moved["inspect"]["config"]["path"] == str(elsewhere["drafter"])
    assert moved["inspect"]["target"]["path"] == str(elsewhere["target"])
    assert {k: v for k, v in moved["inspect"].items() if k not in ("drafter", "config", "target")} == \
        {k: v for k, v in first["inspect"].items() if k not in ("drafter", "config", "target")}
    code, other = preflight(pair["drafter"], pair["target"], *cache,
                            site=fake_transformers_version(tmp_path / "site", "5.13.0"))
    assert code == 1 and not other["reused"] and "outside the range" in other["inspect"]["problems"][0]
    code, verified = preflight(pair["drafter"], pair["target"], *cache, "--verify-hashes")
    assert code == 0 and not verified["reused"]
    os.utime(pair["target"] / "config.json")                                   # touched, not changed
    code, touched = preflight(pair["drafter"], pair["target"], *cache)
    assert code == 0 and touched["reused"]
    config = json.loads((pair["drafter"] / "config.json").read_text())
    config["num_target_layers"] = 9                                              # changed: refused, not kept
    (pair["drafter"] / "config.json").write_text(json.dumps(config))
    before = sorted((tmp_path / "cache").iterdir())
    code, changed = preflight(pair["drafter"], pair["target"], *cache)
    assert code == 1 and not changed["reused"] and changed["inspect"]["problems"], changed
    assert sorted((tmp_path / "cache").iterdir()) == before


def test_each_kept_part_is_keyed_by_what_it_reads_and_none_when_a_pass_cannot_be_trusted_again(embedded_pair,
                                                                                              tmp_path):
    import argparse

    from remote.preflight import folder_entries, pass_keys

    copy = shutil.copytree(embedded_pair["drafter"], tmp_path / "copy")     # keeps times: the same entries
    assert folder_entries(str(copy)) == folder_entries(embedded_pair["drafter"])
    args = argparse.Namespace(drafter=embedded_pair["drafter"], target=embedded_pair["target"], verify_hashes=False,
                              suite="default", prompts=2, max_new_tokens=256, dtype=None)
    versions = {"torch": "2.13.0", "transformers": "5.25.0"}
    keys = pass_keys(args, "cpu", versions)
    assert keys == pass_keys(args, "cpu", dict(versions)) and sorted(keys) == ["checks", "self-test", "tokens"]
    assert all(len(key) == 64 for key in keys.values()) and len(set(keys.values())) == 3

    def changed(change: dict, device: str = "cpu", libraries: dict = versions) -> set[str]:
        other = pass_keys(argparse.Namespace(**{**vars(args), **change}), device, libraries)
        return {part for part in keys if other[part] != keys[part]}

    assert changed({}, libraries={**versions, "transformers": "5.14.1"}) == set(keys)
    assert changed({}, device="cuda") == {"self-test"}
    assert changed({"drafter": str(copy)}) == set()                       # the same content elsewhere
    target = shutil.copytree(embedded_pair["target"], tmp_path / "target")
    assert changed({"target": str(target)}) == set()
    os.utime(target / "config.json")
    assert changed({"target": str(target)}) == set()                      # touched, not changed
    weights = next(copy.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes() + b" ")                      # a byte more: another file
    assert changed({"drafter": str(copy)}) == {"checks"}
    (target / "tokenizer_config.json").write_text((target / "tokenizer_config.json").read_text() + "\n")
    assert changed({"target": str(target)}) == set(keys)
    assert changed({"suite": "humaneval"}) == {"tokens"}
    for computed_anew in ({"prompts": 3}, {"max_new_tokens": 16}, {"dtype": "bfloat16"}):
        assert changed(computed_anew) == set(), computed_anew
    for untrusted in ({"verify_hashes": True}, {"suite": "hf:gsm8k"}, {"target": "Qwen/Qwen3-8B"}):
        assert pass_keys(argparse.Namespace(**{**vars(args), **untrusted}), "cpu", versions) is None, untrusted


# ----------------------------------------------------------------------------- a wrong result is an error

def planted_python(tmp_path: Path, plant: str) -> Path:
    """A host `python` whose worker carries the fault in tests/plants/PLANT."""
    return host_python(tmp_path / f"python-{plant}", plant)


def worker(python: Path, pair: dict, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "remote.worker", "--target", pair["target"], "--drafter", pair["drafter"],
                           "--prompts", "2", "--out", str(out), "--device", "cpu", "--mode", "online",
                           "--max-new-tokens", "64", *extra], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.worker
def test_a_diverging_greedy_online_run_is_invalid_not_a_result(embedded_pair, tmp_path):
    """The planted fault passes pre-flight (the self-test's rollback is intact) and breaks decoding:
    the worker stops at the first diverging prompt, names it and the token, keeps its row and writes
    a summary with no τ; a resume does not turn it into a result."""
    out = tmp_path / "out"
    proc = worker(planted_python(tmp_path, "norollback"), embedded_pair, out)
    assert proc.returncode == exits.INVALID, proc.stderr[-3000:]
    error = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")][-1]
    assert error["event"] == "error"
    assert re.search(r"differs from the target's own greedy output on prompt \S+ at token \d+: ours \d+, target \d+",
                     error["message"]), error["message"]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["lossless"] is False and rows[0]["divergence"]["near_tie"] is False
    summary = json.loads((out / "summary.json").read_text())
    assert summary["invalid"]["prompt"] == rows[0]["id"] and summary["invalid"]["position"] == \
        rows[0]["divergence"]["position"]
    assert not [k for k in summary if "tau" in k or k in ("online", "per_position_acceptance")], summary
    again = worker(sys.executable, embedded_pair, out, "--resume")
    assert again.returncode == exits.INVALID, again.stderr[-3000:]
    assert len((out / "results.jsonl").read_text().splitlines()) == 1      # nothing evaluated after it


@pytest.mark.worker
def test_eval_of_an_invalid_run_exits_7_and_compare_refuses_it(embedded_pair, tmp_path):
    """`dflash-ops eval --mode online` on a host whose decoding diverges: exit 7 with the prompt and
    token named; `compare` will not pair the run."""
    home = tmp_path / "home"
    shutil.copytree(Path(embedded_pair["target"]).parent, home / "embedded")
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"local": {"python": str(planted_python(tmp_path, "norollback"))}}}))
    env = {**os.environ, "DFLASH_OPS_HOME": str(home), "DFLASH_OPS_RUNS": str(tmp_path / "runs"), "COLUMNS": "160"}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "orchestrator.cli", "--inventory", str(inventory), *args],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)

    proc = cli("eval", "--host", "local", "--prompts", "2", "--mode", "online", "--max-new-tokens", "64")
    assert proc.returncode == 7, proc.stdout + proc.stderr
    assert re.search(r"is invalid: on local, greedy online output differs .* at token \d+", proc.stdout + proc.stderr)
    assert "Traceback" not in proc.stdout + proc.stderr
    (run,) = [d.name for d in (tmp_path / "runs").iterdir()]
    inventory.write_text(yaml.safe_dump({"hosts": {}}))
    good = cli("eval", "--host", "local", "--prompts", "2", "--mode", "online", "--max-new-tokens", "64")
    assert good.returncode == 0, good.stdout + good.stderr
    (other,) = [d.name for d in (tmp_path / "runs").iterdir() if d.name != run]
    refused = cli("compare", other, run)
    assert refused.returncode != 0 and f"run {run}" in refused.stdout + refused.stderr
    assert "is invalid, its τ is not a result" in refused.stdout + refused.stderr
