"""Issue 10 end to end: a speculators reduced-vocabulary drafter (with ``sample_from_anchor``) and a
speculators DFlash2 drafter, built with speculators' own classes and trained briefly with its own
training step on a tiny target (tests/references.py), evaluated through `dflash-ops eval` as a
subprocess on the built-in `local` host and on an SSH lab eval host at once (two shards), greedy
and at T = 1, online and offline; then `compare` refuses to pair runs at different temperatures.

remote/drafters/train.py is z-lab's DFlash loss (slot k against token p + k through the target's head): it
cannot train a reduced vocabulary, sample_from_anchor or the DFlash2 selector, so these drafters
are trained the way their authors train them.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAX_NEW = 32
pytestmark = [pytest.mark.timeout(900), pytest.mark.models, pytest.mark.worker,
              pytest.mark.xdist_group("variants")]   # the last test compares with the first one's run


@pytest.fixture(scope="module")
def lab(ssh_lab, tmp_path_factory):
    """The tiny target (eos: its mask id, which the walk language never emits), a 2-prompt suite of
    walks, the two trained drafters (built once, tests/buildcache.py), and an inventory of the lab
    plus `local`."""
    import copy

    import torch

    import buildcache
    from models import PROMPT_LEN, walk_sequences, walk_target
    from references import speculators_drafter, train_speculators
    from remote.drafters.tiny import walk_batch

    base = tmp_path_factory.mktemp("variants")
    target = copy.deepcopy(walk_target("qwen3"))
    target.generation_config.eos_token_id = target.config.vocab_size - 1
    target.save_pretrained(base / "target")
    prompts = walk_batch(2, PROMPT_LEN, target.config.vocab_size - 1, torch.Generator().manual_seed(7))
    (base / "walks.jsonl").write_text("".join(json.dumps({"id": f"walk-{i}", "input_ids": p.tolist()}) + "\n"
                                              for i, p in enumerate(prompts)))
    variants = {"reduced": {"draft_vocab": 200, "sample_from_anchor": True}, "dflash2": {"dflash2": True}}

    def build(out):
        sequences = walk_sequences(target, 24, new_tokens=40)
        for name, kwargs in variants.items():
            model = speculators_drafter(out / name, target, **kwargs)
            train_speculators(model, target, sequences, PROMPT_LEN, steps=300)
            model.save_pretrained(out / name)

    drafters = buildcache.built("speculators-walk-drafters", {"variants": variants, "sequences": [24, 40],
                                                              "steps": 300}, build)
    for name in variants:
        shutil.copytree(drafters / name, base / name)
    return {"base": base, "inventory": ssh_lab.write_inventory(base / "inventory.yaml"), "runs": base / "runs"}


def eval_run(lab, drafter: str, *args, hosts=("local", "eval")) -> tuple[subprocess.CompletedProcess, Path]:
    """`dflash-ops eval` of ``drafter`` on ``hosts``; returns the process and the new run folder."""
    base = lab["base"]
    before = set(lab["runs"].iterdir()) if lab["runs"].exists() else set()
    env = {**os.environ, "DFLASH_OPS_HOME": str(base / "local-home"), "DFLASH_OPS_RUNS": str(lab["runs"]), "COLUMNS": "160"}
    argv = [sys.executable, "-m", "orchestrator.cli", "--inventory", str(lab["inventory"]), "eval",
            *(x for h in hosts for x in ("--host", h)), "--drafter", str(base / drafter), "--target",
            str(base / "target"), "--suite", str(base / "walks.jsonl"), "--prompts", "2", "--max-new-tokens",
            str(MAX_NEW), "--device", "cpu", *args]
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run_dir,) = set(lab["runs"].iterdir()) - before
    return proc, run_dir


def read(run_dir: Path):
    rows = [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()]
    return rows, json.loads((run_dir / "summary.json").read_text()), json.loads((run_dir / "env.json").read_text())


def test_reduced_vocabulary_sample_from_anchor_drafter_offline_on_local_and_ssh(lab):
    proc, run_dir = eval_run(lab, "reduced")
    rows, summary, env = read(run_dir)
    assert sorted(s["host"] for s in env["shards"]) == ["eval", "local"]          # one prompt on each host
    variant = env["drafter"]["variant"]
    assert env["drafter"]["format"] == "speculators" and variant["sample_from_anchor"]
    assert variant["vocab"].startswith("reduced: 200 draft ids")
    assert env["settings"]["verify_block"] == 9 and env["settings"]["temperature"] == 0.0
    assert [r["id"] for r in rows] == ["walk-0", "walk-1"] and all(len(r["output_ids"]) == MAX_NEW for r in rows)
    lengths = [n for r in rows for n in r["acceptance_lengths"]]
    assert max(lengths) <= 9 and summary["tau_pooled"] > 1.5                      # it accepts something
    assert list(summary["acceptance_histogram"]) == [str(k) for k in range(1, 10)]
    assert len(summary["per_position_acceptance"]) == 8
    assert set(summary["ddtree"]) == {"8", "16", "32", "64"}
    assert summary["tau_sglang"] > summary["tau_pooled"]                            # + each response's prefill token
    md = (run_dir / "report.md").read_text()
    assert "| longest acceptance (sample_from_anchor: B drafts + bonus) | 9 |" in md and "## Warnings" not in md
    assert "sample_from_anchor, reduced vocabulary" in md and "| tau_sglang |" in md
    assert "tau_sglang" in proc.stdout and "tau_macro_turns" in proc.stdout


def test_dflash2_drafter_sampled_online_on_local_and_ssh(lab):
    proc, run_dir = eval_run(lab, "dflash2", "--mode", "online", "--temperature", "1", "--seed", "3")
    rows, summary, env = read(run_dir)
    assert sorted(s["host"] for s in env["shards"]) == ["eval", "local"]
    assert env["drafter"]["variant"]["architecture"] == "dflash2"
    s = env["settings"]
    assert (s["temperature"], s["top_p"], s["top_k"], s["seed"], s["enable_thinking"]) == (1.0, 1.0, 0, 3, False)
    assert all(r["lossless"] is None and r["acceptance_lengths"] for r in rows)
    assert summary["online"]["lossless"] is None and summary["tau_pooled"] >= 1.0
    assert max(n for r in rows for n in r["acceptance_lengths"]) <= 8
    md = (run_dir / "report.md").read_text()
    assert "sampled: T=1, top_p=1, top_k=0, seed=3" in md and "not checked per prompt at T > 0" in md
    assert "n/a (sampled)" in proc.stdout


def test_sampled_offline_run_reports_the_expected_tau_and_does_not_pair_with_greedy(lab):
    proc, run_dir = eval_run(lab, "dflash2", "--temperature", "1", hosts=("eval",))
    rows, summary, env = read(run_dir)
    assert env["host"] == "eval" and env["settings"]["ddtree_budgets"] == []    # no DDTree at T > 0 offline
    assert all(r["tau"] is None and r["expected"]["anchors"] > 0 for r in rows)
    assert summary["expected"]["tau_pooled"] > 1.0 and "estimate" in summary["expected"]["label"]
    assert "expected tau_macro (offline, T > 0: an estimate)" in proc.stdout
    md = (run_dir / "report.md").read_text()
    assert "| expected tau_macro (offline, T > 0: an estimate) |" in md
    greedy = next(d for d in lab["runs"].iterdir() if d != run_dir and (d / "run.json").exists()
                  and json.loads((d / "env.json").read_text())["settings"]["mode"] == "offline")
    cmp = subprocess.run([sys.executable, "-m", "orchestrator.cli", "compare", greedy.name, run_dir.name,
                          "--runs-dir", str(lab["runs"])], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "COLUMNS": "200"})
    text = " ".join((cmp.stdout + cmp.stderr).split())
    assert cmp.returncode == 3 and "decoding setting temperature differs" in text and "Traceback" not in text
