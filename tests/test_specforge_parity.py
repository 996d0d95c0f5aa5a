"""`parity`'s SpecForge numbers (remote/parity.py ``SpecForgeTally``) against SpecForge 0.2.0's own:
its training wrappers (OnlineDFlashModel, OnlineDominoModel, OnlineDSparkModel), their objectives and
its Evaluator, run by tests/specforge_ref.py's ``metrics`` command in SpecForge's environment
(``$DFLASH_OPS_SPECFORGE_PYTHON``, as tests/test_specforge_ref.py) on the same sequences.

The drafters are made by the harness's ``build`` (SpecForge's classes) on a tiny random Qwen3 target,
in the build cache (tests/buildcache.py): a plain DFlash, a Domino with ``shift_label`` and a pure
prefix (its slot ``i`` scored on token ``p + 1 + i``, B positions), a DSpark (vanilla Markov head,
confidence head) and a DSpark whose head is the recurrent one and whose confidence head reads the
previous token (both teacher-forced through the block). The sequences: each prompt with the target's
greedy continuation, and one with the drafter's own block at the first anchor spliced in (every draft
of that block a hit where SpecForge scores the positions we draft), so that the counts are not all 0.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import buildcache
from specforge_env import MARKS, PROMPTS, env_stamp, harness_batch, ok
from specforge_env import target_dir as built_target

pytestmark = MARKS

BLOCK, N = 8, 24
DRAFTERS = {   # name: (family, --set overrides)
    "dflash": ("dflash", []),
    "domino-shift": ("domino", ["dflash_config.shift_label=true", "dflash_config.pure_draft_prefix_len=1"]),
    "dspark": ("dspark", []),
    "dspark-rnn": ("dspark", ["dflash_config.markov_head_type=rnn", "dflash_config.confidence_head_with_markov=true"]),
}


def harness(jobs: list[list[str]], folder: Path, name: str) -> list[dict]:
    """The harness's results of the command lines ``jobs``, in one process (none failed)."""
    return [ok(r) for r in harness_batch(jobs, folder, name)]


@pytest.fixture(scope="module")
def target_dir() -> Path:
    return built_target()


@pytest.fixture(scope="module")
def drafters(target_dir) -> dict[str, Path]:
    common = ["--target", str(target_dir), "--seed", "0", "--block-size", str(BLOCK)]
    recipe = {"target": target_dir.parent.name, "drafters": DRAFTERS, "common": common[2:],
              "harness": env_stamp()}

    def build(out):
        harness([["build", family, str(out / name), *common, *[a for s in sets for a in ("--set", s)]]
                 for name, (family, sets) in DRAFTERS.items()], out, "builds")

    folder = buildcache.built("specforge-parity-drafters", recipe, build)
    return {name: folder / name for name in DRAFTERS}


def loaded(target_dir: Path, folder: Path):
    import torch
    from transformers import AutoModelForCausalLM

    from remote.drafters.checkpoint import load_drafter

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval(), load_drafter(folder)[0]


def own_block(target, drafter, prompt: list[int], first: int) -> list[int]:
    """The drafter's B - 1 drafts at the first anchor (``first``, the completion's first token), as the
    training-way table drafts them: they depend on the context before it and on it alone."""
    import torch

    from remote.decode.offline import DraftTable
    from remote.target.model import target_features

    ids = torch.tensor([*prompt, first, first])
    _, th = target_features(target, ids[None], drafter.config.target_layer_ids)
    table = DraftTable(drafter, th, ids, target.get_input_embeddings().weight, target.get_output_embeddings(),
                       cut_last_blocks=False)
    return table[len(prompt)]


@pytest.fixture(scope="module")
def sequences(target_dir, drafters) -> dict[str, list[dict]]:
    """Per drafter ``[{"ids", "prompt_len"}]`` (the loss mask on the completion)."""
    import torch

    from remote.decode.online import target_decode

    target, _ = loaded(target_dir, drafters["dflash"])
    greedy = [target_decode(target, torch.tensor([p]), N).output_ids for p in PROMPTS]
    out = {}
    for name, folder in drafters.items():
        _, drafter = loaded(target_dir, folder)
        spliced = [greedy[1][0], *own_block(target, drafter, PROMPTS[1], greedy[1][0]), *greedy[1][1:5]]
        out[name] = [{"ids": [*p, *g], "prompt_len": len(p)} for p, g in zip(PROMPTS, greedy)]
        out[name].append({"ids": [*PROMPTS[1], *spliced], "prompt_len": len(PROMPTS[1])})
    return out


@pytest.fixture(scope="module")
def theirs(target_dir, drafters, sequences, tmp_path_factory) -> dict[str, dict]:
    """The harness's ``metrics`` of each drafter, in one process."""
    folder = tmp_path_factory.mktemp("specforge-parity")
    jobs = []
    for name in DRAFTERS:
        path = folder / f"{name}.json"
        path.write_text(json.dumps(sequences[name]))
        jobs.append(["metrics", str(drafters[name]), str(target_dir), "--sequences", str(path)])
    return dict(zip(DRAFTERS, harness(jobs, folder, "metrics")))


@pytest.mark.parametrize("name", DRAFTERS)
def test_specforge_numbers_equal_specforges_own(name, target_dir, drafters, sequences, theirs):
    """Per position the same correct counts and denominators (SpecForge's block columns from the
    first scored slot), the evaluator's pooled accuracy, Domino's accept_len, DSpark's expected τ and
    the confidence head's τ, to float tolerance. (SpecForge's evaluator logs ``simulated_acc_len`` as
    the accuracy itself for these families.)"""
    from remote.parity import parity

    target, drafter = loaded(target_dir, drafters[name])
    pairs = [(s["ids"][:s["prompt_len"]], s["ids"][s["prompt_len"]:]) for s in sequences[name]]
    report = parity(drafter, target, pairs)
    sf, want = report["specforge"], theirs[name]
    first = sf["first_slot"]
    assert (sf["family"], first) == (want["family"], 1 if name == "dflash" else 0)
    assert want["per_position"]["count"][:first] == [0.0] * first
    assert sf["per_position_count"] == want["per_position"]["count"][first:]
    assert [a * n for a, n in zip(sf["per_position"], sf["per_position_count"])] == \
        pytest.approx(want["per_position"]["correct"][first:], abs=1e-9)
    assert (sf["correct"], sf["denominator"]) == (want["correct"], want["denominator"])
    assert sf["accuracy"] == pytest.approx(want["evaluator"]["eval/avg_acc"], rel=1e-5, abs=1e-9)
    assert want["evaluator"]["eval/simulated_acc_len"] == want["evaluator"]["eval/avg_acc"]
    assert sf["blocks"] == sum(len(s["ids"]) - 1 - s["prompt_len"] for s in sequences[name])
    keys = ("accept_len", "expected_tau", "confidence_tau")
    assert [k for k in keys if k in sf] == [k for k in keys if k in want] == \
        {"dflash": [], "domino": ["accept_len"], "dspark": ["expected_tau", "confidence_tau"]}[sf["family"]]
    for key in keys:
        if key in want:
            assert sf[key] == pytest.approx(want[key], rel=1e-5), key
    if name == "dflash":      # the same drafts at the same positions: SpecForge's accuracy is our training way's
        assert sf["accuracy_tau"] == pytest.approx(report["tau_estimate"]["training"])
    if sf["family"] != "dspark":                   # positions SpecForge scores as we draft them
        assert sf["correct"] >= BLOCK - 1          # the spliced block at least
