"""Checkpoints a training run really produces: a step that diverged (NaN or infinite weights), a copy
re-exported in another format, a SpecForge head whose drafts depend on the draft before. Each is
told in one line before any run exists, or, met in a run, stops it with one line and no τ. Real
parts: the embedded pair, SpecForge-family drafters made from its drafter (tests/enginelab.py),
weights poisoned through safetensors, the real inspect, pre-flight, worker, export and CLI."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from remote.contract import exits

REPO = Path(__file__).resolve().parents[1]


def poisoned(src: Path, out: Path, values: dict[str, tuple[tuple, float]]) -> Path:
    """A copy of the checkpoint folder ``src`` with ``values[name] = (index, value)`` written into its
    safetensors weights (``index`` ``()``: every element)."""
    shutil.copytree(src, out)
    (weights,) = out.glob("*.safetensors")
    state = load_file(weights)
    for name, (index, value) in values.items():
        state[name][index] = value
    save_file(state, weights, metadata={"format": "pt"})
    return out


def cli(home: Path, cwd: Path, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "DFLASH_OPS_HOME": str(home), "DFLASH_OPS_RUNS": str(cwd / "runs"), "COLUMNS": "200"}
    env.pop("DFLASH_OPS_INVENTORY", None)
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


def no_runs(cwd: Path) -> bool:
    return not (cwd / "runs").exists() or not any((cwd / "runs").iterdir())


@pytest.fixture(scope="module")
def families(embedded_pair, tmp_path_factory) -> dict[str, Path]:
    """The embedded drafter's backbone with SpecForge's heads (tests/enginelab.py), in SpecForge's
    format: DSpark with a Markov head and a confidence head, Domino."""
    from enginelab import family_drafter

    out = tmp_path_factory.mktemp("families")
    return {family: family_drafter(embedded_pair["drafter"], family, out / family, fmt="specforge")
            for family in ("dspark", "domino")}


# ----------------------------------------------------------------------------- non-finite weights

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e5m2,
                torch.float8_e4m3fn)


def test_every_nonfinite_weight_is_found_in_each_float_type_and_no_finite_one(tmp_path):
    """In every float type safetensors holds, in a safetensors file and in a state dict: a NaN, an
    infinity or a negative infinity anywhere (first, last, middle element, a scalar) is found, and
    none of a type's finite extremes (its largest and smallest values, subnormals, -0.0) is."""
    from remote.drafters.checkpoint import DrafterCheckpoint, nonfinite_tensors
    from remote.drafters.config import DrafterConfig

    tensors, bad = {}, []
    for dtype in FLOAT_DTYPES:
        name = str(dtype).removeprefix("torch.")
        info = torch.finfo(dtype)
        finite = torch.tensor([info.max, -info.max, info.tiny, info.smallest_normal / 4, -0.0, 1.0, info.min]
                              * 1000, dtype=torch.float64).to(dtype)
        tensors[f"{name}.finite"] = finite
        tensors[f"{name}.scalar_finite"] = torch.tensor(info.max, dtype=dtype)
        specials = {"nan": float("nan")} if dtype == torch.float8_e4m3fn else \
            {"nan": float("nan"), "inf": float("inf"), "neginf": float("-inf")}     # e4m3fn has no infinity
        for special, value in specials.items():
            for where in (0, 3500, -1):
                t = finite.clone()
                t[where] = torch.tensor(value).to(dtype)
                tensors[f"{name}.{special}_at_{where}"] = t
                bad.append(f"{name}.{special}_at_{where}")
        tensors[f"{name}.scalar_nan"] = torch.tensor(float("nan")).to(dtype)
        bad.append(f"{name}.scalar_nan")
    assert all(bool(torch.isfinite(tensors[n].double()).all()) != (n in bad) for n in tensors)   # as torch sees them
    cfg = DrafterConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, target_layer_ids=[0], mask_token_id=0, vocab_size=8)
    save_file(tensors, tmp_path / "model.safetensors")
    torch.save(tensors, tmp_path / "drafter.pt")
    for f in ("model.safetensors", "drafter.pt"):
        ckpt = DrafterCheckpoint(tmp_path, "state_dict", cfg, [tmp_path / f])
        assert sorted(nonfinite_tensors(ckpt, tensors)) == sorted(bad), f


def test_a_drafters_large_weights_rewritten_in_place_are_checked_again(tmp_path):
    """A drafter's safetensors file over 64 MiB rewritten with the same header and size (a NaN
    written into its data), its modification time put back: the pre-flight's kept checks are not
    reused, since they read every weight (they were keyed on the header alone); a target's weights,
    of which only the header is read, stay keyed on it."""
    import argparse
    import struct

    from remote.preflight import HASHED_WHOLE, pass_keys

    drafter, target = tmp_path / "drafter", tmp_path / "target"
    header = json.dumps({"fc.weight": {"dtype": "F32", "shape": [HASHED_WHOLE // 4],
                                       "data_offsets": [0, HASHED_WHOLE]}}).encode()
    for folder in (drafter, target):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        with open(folder / "model.safetensors", "wb") as fh:
            fh.write(struct.pack("<Q", len(header)) + header)
            fh.truncate(8 + len(header) + HASHED_WHOLE)            # sparse: zeros, no 64 MiB written
    args = argparse.Namespace(drafter=str(drafter), target=str(target), verify_hashes=False, suite="default")
    versions = {"torch": "2.13.0", "transformers": "5.25.0"}
    first = pass_keys(args, "cpu", versions)
    assert pass_keys(args, "cpu", versions) == first
    for folder, checks_again in ((target, False), (drafter, True)):
        weights = folder / "model.safetensors"
        st = weights.stat()
        with open(weights, "r+b") as fh:
            fh.seek(8 + len(header) + 4 * 1000)
            fh.write(struct.pack("<f", float("nan")))
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert weights.stat().st_size == st.st_size and weights.stat().st_mtime_ns == st.st_mtime_ns
        assert (pass_keys(args, "cpu", versions)["checks"] != first["checks"]) == checks_again, folder


@pytest.mark.worker
def test_inspect_and_preflight_name_each_nonfinite_tensor_by_head(families, embedded_pair, tmp_path):
    """A DSpark drafter whose training step diverged: inspect and the pre-flight refuse it in one
    line naming each tensor with NaN or an infinity, by the head it belongs to; the same drafter
    with finite weights passes both."""
    bad = poisoned(families["dspark"], tmp_path / "diverged", {
        "confidence_head.proj.weight": ((0, 3), float("nan")), "markov_head.markov_w2.weight": ((5, 1), float("inf")),
        "fc.weight": ((2, 7), float("nan")), "layers.1.mlp.down_proj.weight": ((0, 0), float("-inf"))})
    target = embedded_pair["target"]
    line = (f"{bad}: weights that are NaN or infinite in 4 tensor(s), by part: confidence head: "
            f"confidence_head.proj.weight; Markov head: markov_head.markov_w2.weight; fc: fc.weight; layers: "
            f"layers.1.mlp.down_proj.weight (nothing drafted with them is a result)")
    ok = subprocess.run([sys.executable, "-m", "remote.inspect", str(families["dspark"]), "--target", target],
                        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0 and "verdict   compatible" in ok.stdout, ok.stdout + ok.stderr
    res = subprocess.run([sys.executable, "-m", "remote.inspect", str(bad), "--target", target], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert [x for x in res.stderr.splitlines() if x.startswith("error")] == [f"error     {line}"], res.stderr
    pre = subprocess.run([sys.executable, "-m", "remote.preflight", str(bad), "--target", target, "--device", "cpu",
                          "--prompts", "1"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert pre.returncode == 1 and json.loads(pre.stdout)["inspect"]["problems"] == [line], pre.stdout + pre.stderr


@pytest.mark.worker
def test_eval_of_a_drafter_with_nan_weights_is_one_line_and_starts_nothing(families, local_home, embedded_pair,
                                                                           tmp_path):
    """`eval` of a DSpark drafter whose confidence head holds a NaN: the pre-flight's one line, no
    run folder (it passed the pre-flight, every prompt was decoded, and the worker died with a
    ValueError traceback writing the summary)."""
    bad = poisoned(families["dspark"], tmp_path / "diverged", {"confidence_head.proj.weight": ((0, 3), float("nan"))})
    res = cli(local_home, tmp_path, "eval", "--host", "local", "--drafter", bad, "--target", embedded_pair["target"],
              "--prompts", 1, "--max-new-tokens", 8)
    out = res.stdout + res.stderr
    assert res.returncode == 1 and "Traceback" not in out, out
    assert (f"error: host local: {bad}: weights that are NaN or infinite in 1 tensor(s), by part: confidence head: "
            f"confidence_head.proj.weight") in " ".join(out.split()), out
    assert no_runs(tmp_path), list((tmp_path / "runs").iterdir())


def worker(drafter: Path, target: str, out: Path, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "remote.worker", "--target", target, "--drafter", str(drafter),
                           "--out", str(out), "--prompts", "2", "--max-new-tokens", "16", "--device", "cpu", *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=900)


@pytest.mark.worker
@pytest.mark.parametrize("head, weights, mode", [
    # finite weights whose products overflow float32: the bias is +inf wherever the previous token is
    ("Markov head", {"markov_head.markov_w2.weight": ((), 3e38), "markov_head.markov_w1.weight": ((), 10.0)},
     "offline"),
    # +3e38 and -3e38 over the hidden state: inf - inf, the confidence NaN
    ("confidence head", {"confidence_head.proj.weight": ((), 3e38)}, "online"),
])
def test_a_forward_that_overflows_stops_the_run_naming_the_head(head, weights, mode, families, embedded_pair,
                                                                 tmp_path):
    """Finite weights whose forward overflows pass every check, and the run meets NaN or infinite
    outputs: it stops at that prompt with one line naming the head, keeps the rows before it and
    writes a summary marked invalid with no τ (the Markov head reported τ 1.00; the confidence head
    died with a traceback writing the summary, and `eval --resume` and `show` failed the same
    way); a resume ends the same way, and `show` shows why."""
    drafter = poisoned(families["dspark"], tmp_path / "overflow", weights)
    if head == "confidence head":
        state = load_file(drafter / "model.safetensors")
        state["confidence_head.proj.weight"][0, ::2] = -3e38
        save_file(state, drafter / "model.safetensors", metadata={"format": "pt"})
    runs = tmp_path / "runs"
    out = runs / "overflow-run"
    for extra in ((), ("--resume",)):
        res = worker(drafter, embedded_pair["target"], out, "--mode", mode, *extra)
        assert res.returncode == exits.INVALID and "Traceback" not in res.stderr, res.stderr[-3000:]
        error = json.loads(res.stdout.splitlines()[-1])
        assert error["event"] == "error" and error["message"].startswith(
            f"the drafter's {head} gave NaN or infinite outputs on prompt "), error
        summary = json.loads((out / "summary.json").read_text())
        assert summary["invalid"]["head"] == head and summary["invalid"]["message"] == error["message"]
        assert not [k for k in summary if "tau" in k], summary
        assert not (out / "results.jsonl").read_text()          # the first prompt stopped: nothing before it
    show = subprocess.run([sys.executable, "-m", "orchestrator.cli", "show", "overflow-run", "--runs-dir", runs],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "400"})
    assert "Traceback" not in show.stdout + show.stderr, show.stderr
    assert f"the drafter's {head} gave NaN or infinite outputs" in show.stdout, show.stdout + show.stderr


@pytest.mark.worker
def test_export_of_a_checkpoint_with_a_nan_weight_copies_it_bit_for_bit(embedded_pair, tmp_path):
    """A NaN is a NaN read back: the export writes the weights as they are (it said "tensor fc.weight
    read back differs from the one written"), and inspect then names the tensor."""
    from remote.drafters.export import export

    src = poisoned(Path(embedded_pair["drafter"]), tmp_path / "diverged", {"fc.weight": ((1, 2), float("nan"))})
    result = export(src, "specforge", tmp_path / "diverged.specforge")
    written = load_file(Path(result["out"]) / "model.safetensors")
    source = load_file(src / "model.safetensors")
    assert set(written) == set(source)
    for name, t in source.items():
        assert torch.equal(written[name].view(torch.int32), t.view(torch.int32)), name
    assert torch.isnan(written["fc.weight"][1, 2])
    res = subprocess.run([sys.executable, "-m", "remote.inspect", result["out"]], cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 1 and "in 1 tensor(s), by part: fc: fc.weight" in res.stderr, res.stderr


# ----------------------------------------------------------------------------- the family's rules


@pytest.mark.worker
def test_a_plain_dflash_drafter_is_counted_by_zlab_rules_in_either_format_and_its_copies_pair(
        embedded_pair, local_home, tmp_path):
    """The embedded DFlash drafter and its `export --to specforge` copy (whose dflash_config has
    pure_draft_prefix_len and shift_label, so it reads as SpecForge's format): both runs are counted
    by z-lab's rules, and `compare` pairs them, the same τ on every prompt (the copy was counted by
    SpecForge's rules and compare refused to pair them)."""
    from remote.drafters.checkpoint import open_checkpoint
    from remote.drafters.export import export

    copy = Path(export(embedded_pair["drafter"], "specforge", tmp_path / "drafter.specforge")["out"])
    assert open_checkpoint(copy).format == "specforge"
    ids: list[str] = []
    for drafter in (embedded_pair["drafter"], copy):
        res = cli(local_home, tmp_path, "eval", "--host", "local", "--drafter", drafter, "--target",
                  embedded_pair["target"], "--prompts", 2, "--max-new-tokens", 24, "--ddtree", "")
        assert res.returncode == 0, res.stdout + res.stderr
        (run,) = [d.name for d in (tmp_path / "runs").iterdir() if d.name not in ids]
        ids.append(run)
        env = json.loads((tmp_path / "runs" / run / "env.json").read_text())
        assert env["settings"]["semantics"] == "zlab"
    res = cli(local_home, tmp_path, "compare", *ids, "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    (comparison,) = json.loads(res.stdout)["comparisons"]
    assert (comparison["n"], comparison["ties"], comparison["macro"]["diff"]) == (2, 2, 0.0), comparison


@pytest.mark.worker
def test_ddtree_on_a_sequential_head_is_refused_before_a_run_exists(families, local_home, embedded_pair, tmp_path):
    """`--ddtree` on Domino and on DSpark with a Markov head (each draft depends on the one before):
    refused by the pre-flight in the worker's own words, before a run exists (the worker refused it
    after the run was created and started, which was left failed with resume advice that could only
    fail again); the pre-flight refuses vLLM as the engine of such a drafter the same way."""
    from remote.contract.families import tree_refusal

    for family, drafter in families.items():
        res = cli(local_home, tmp_path, "eval", "--host", "local", "--drafter", drafter, "--target",
                  embedded_pair["target"], "--prompts", 1, "--max-new-tokens", 8, "--ddtree", "8")
        out = " ".join((res.stdout + res.stderr).split())
        assert res.returncode == 1 and "Traceback" not in out, out
        assert f"error: host local: --ddtree 8: {tree_refusal(family, True)}; leave out --ddtree" in out, out
        assert no_runs(tmp_path), list((tmp_path / "runs").iterdir())
    pre = subprocess.run([sys.executable, "-m", "remote.preflight", str(families["dspark"]), "--target",
                          embedded_pair["target"], "--device", "cpu", "--prompts", "1", "--engine", "--engine-kind",
                          "vllm"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert pre.returncode == 1, pre.stdout + pre.stderr
    assert json.loads(pre.stdout)["inspect"]["problems"] == [
        "--engine: vLLM serves DFlash drafters only; this is SpecForge's dspark drafter, which SGLang serves"]


# ----------------------------------------------------------------------------- confidence labels

@pytest.mark.models
def test_a_cut_last_cycle_labels_its_drafts_confidences_truly(embedded_pair):
    """Under z-lab's rules the last block is cut to the tokens still needed and a cycle that accepts
    all its drafts commits no bonus token, so its acceptance length counts the drafts alone: the
    calibration's label (draft k accepted iff k <= length - 1) would call the last accepted draft
    rejected. With a DSpark drafter whose Markov head knows the target's greedy path (its drafts
    known here), every confidence a run records, online and offline, is labelled as the draft was
    judged, and the cut cycles are met."""
    from dataclasses import replace

    from remote.decode.offline import evaluate_offline
    from remote.decode.online import speculative_generate, target_decode
    from remote.drafters.checkpoint import load_drafter
    from remote.drafters.tiny import tiny_drafter
    from remote.target.model import load_target

    target = load_target(embedded_pair["target"], "cpu", "float32")
    base, _ = load_drafter(embedded_pair["drafter"])
    V = base.config.vocab_size
    drafter = tiny_drafter(replace(base.config, family="dspark", markov_rank=V, confidence_head=True))
    drafter.load_state_dict(base.state_dict(), strict=False)
    prompt = [5, 17, 40, 99, 3, 61]
    path = [prompt[-1], *target_decode(target, torch.tensor([prompt]), 64).output_ids]
    successor = {}
    for a, b in zip(path, path[1:]):
        successor.setdefault(a, b)
    with torch.no_grad():             # the bias for previous token a: 1e4 on its successor on the path
        drafter.markov_head.markov_w1.weight.copy_(torch.eye(V))
        drafter.markov_head.markov_w2.weight.zero_()
        for a, b in successor.items():
            drafter.markov_head.markov_w2.weight[b, a] = 1e4

    cut = 0
    for n in (13, 18, 22):
        ref = path[1:n + 1]
        online = speculative_generate(target, drafter, torch.tensor([prompt]), n)
        offline = evaluate_offline(drafter, target, prompt, ref, budgets=())
        assert online.output_ids == ref and offline["acceptance_lengths"] == online.acceptance_lengths
        for confidences in (online.confidences, offline["confidences"]):
            start = len(prompt)
            seq = prompt + ref
            for length, conf in zip(online.acceptance_lengths, confidences):
                token, judged = seq[start], []
                for k in range(len(conf)):           # the drafts: the path's successors from the cycle's token
                    token = successor[token]
                    judged.append(start + 1 + k < len(seq) and token == seq[start + 1 + k]
                                  and (not judged or judged[-1]))
                assert [k + 1 <= length - 1 for k in range(len(conf))] == judged, (n, start, length, conf)
                drafts = min(drafter.config.num_drafts, len(seq) - start - 1)
                cut += len(conf) < drafts
                start += length
    assert cut >= 2                          # cycles whose last accepted drafts the labels would have missed
