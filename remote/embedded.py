"""The embedded demo pair, built deterministically on first use: a tiny hybrid Qwen3.5-style target
(Gated DeltaNet + full attention) with a tiny chat tokenizer, taught a small chat corpus, and a
DFlash drafter trained for it with the reference training step. CPU, under two minutes. The
``qwen3`` recipe builds the same with a pure-attention Qwen3 target and head_dim 32.

``python -m remote.embedded --out DIR [--recipe qwen3]`` builds into DIR (or finds it there) and prints
``{"target": DIR/target, "drafter": DIR/drafter}``; with ``--check`` it builds nothing and prints ``{}``
when the pair is not built. A build stamp records the recipe; a changed
recipe rebuilds, an interrupted build never leaves a half-written pair behind (staging + rename).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

RECIPE = {"version": 2, "vocab": 256, "hidden": 64, "layers": 4, "target_steps": 300, "drafter_steps": 400,
          "block_size": 8, "seed": 0}
# A pure-attention Qwen3 pair taught the same corpus, with head_dim 32 (vLLM's CPU attention refuses
# 16): the pair a serving engine runs in tests.
QWEN3_RECIPE = {**RECIPE, "kind": "qwen3", "head_dim": 32}
RECIPES = {"demo": RECIPE, "qwen3": QWEN3_RECIPE}


def log(msg: str) -> None:
    print(f"[embedded] {msg}", file=sys.stderr, flush=True)


def corpus(tokenizer) -> list[tuple[list[int], list[int]]]:
    """Chat conversations: every prompt of the default suite (and a few extra) answered with a fixed
    paragraph — a tiny language the target memorises, so its greedy answers are prompt dependent.
    Each prompt is rendered with thinking off (the worker's default: an empty think block) and with
    the template's own default, so the demo answers either way."""
    from remote.suites.prompts import format_chat, load_suite
    from remote.target.tokenizer import PARAGRAPHS

    prompts = [t for row in load_suite("default").rows for t in (row.turns or [])]
    prompts += ["Tell me something.", "Write some code.", "Solve this problem.", "Summarize the text above."]
    convs = []
    for i, text in enumerate(prompts):
        answer = tokenizer(PARAGRAPHS[i % len(PARAGRAPHS)] + "<|im_end|>", add_special_tokens=False)["input_ids"]
        for thinking in (False, None):
            convs.append((format_chat(tokenizer, [{"role": "user", "content": text}], thinking), answer))
    return convs


def _bypass_linear_attention(model, on: bool) -> None:
    """While teaching the target, its Gated DeltaNet layers contribute nothing (out_proj is zero)
    and are skipped: the pure-torch GDN backward is far too slow on CPU. Afterwards they are
    switched back on with small random output weights, so the demo target is really hybrid."""
    import torch
    from remote.target.model import decoder_layers

    for layer in decoder_layers(model):
        attn = getattr(layer, "linear_attn", None)
        if attn is None:
            continue
        if on:
            attn.out_proj.weight.data.zero_()
            attn.out_proj.weight.requires_grad_(False)
            attn._saved_forward = attn.forward
            attn.forward = lambda hidden_states, *a, **k: torch.zeros_like(hidden_states)
        else:
            attn.forward = attn._saved_forward
            del attn._saved_forward
            g = torch.Generator().manual_seed(RECIPE["seed"] + 7)
            attn.out_proj.weight.data.normal_(0.0, 0.002, generator=g)


def teach_target(model, pairs: list[tuple[list[int], list[int]]], steps: int, seed: int) -> float:
    """Causal-LM training on the conversations, 8 padded rows a step (padding is not a label)."""
    import torch

    from remote.drafters.tiny import teach_lm

    convs = [p + a for p, a in pairs]
    gen = torch.Generator().manual_seed(seed)
    width = max(len(c) for c in convs)

    def batches():
        ids = torch.zeros(8, width, dtype=torch.long)
        labels = torch.full((8, width), -100, dtype=torch.long)
        for r, i in enumerate(torch.randint(len(convs), (8,), generator=gen).tolist()):
            ids[r, :len(convs[i])] = torch.tensor(convs[i])
            labels[r, :len(convs[i])] = torch.tensor(convs[i])
        return ids, labels
    return teach_lm(model, batches, steps)


def build(out: Path, recipe: dict = RECIPE) -> dict:
    import torch

    from remote.drafters.checkpoint import save_drafter
    from remote.decode.online import target_decode
    from remote.target.model import target_features
    from remote.drafters.tiny import tiny_drafter, tiny_drafter_config, tiny_target
    from remote.target.tokenizer import build_tiny_tokenizer
    from remote.drafters.train import Batch, teacher_forced_accuracy, train

    t0 = time.time()
    kind, head_dim = recipe.get("kind", "qwen3_5"), recipe.get("head_dim", 16)
    torch.manual_seed(recipe["seed"])
    staging = out.with_name(out.name + f".staging-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    tokenizer = build_tiny_tokenizer(staging / "target", vocab_size=recipe["vocab"] - 1)
    target = tiny_target(kind, vocab_size=recipe["vocab"], hidden_size=recipe["hidden"],
                         num_layers=recipe["layers"], seed=recipe["seed"], tie=False, head_dim=head_dim)
    target.config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    target.generation_config.eos_token_id = target.config.eos_token_id
    target.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    convs = corpus(tokenizer)
    _bypass_linear_attention(target, True)
    loss = teach_target(target, convs, recipe["target_steps"], recipe["seed"])
    _bypass_linear_attention(target, False)
    for p in target.parameters():
        p.requires_grad_(False)
    log(f"target taught (loss {loss:.3f}) in {time.time() - t0:.0f}s")

    cfg = tiny_drafter_config(target, layers=2, block_size=recipe["block_size"], head_dim=head_dim)
    stop = [target.config.eos_token_id]
    batches = []
    for prompt, _ in convs:
        prompt_len = len(prompt)
        out_ids = target_decode(target, torch.tensor([prompt]), 96, stop).output_ids
        ids = torch.tensor([prompt + out_ids])
        _, feats = target_features(target, ids, cfg.target_layer_ids)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[:, prompt_len:] = True
        batches.append(Batch(ids, feats, mask))
    drafter = tiny_drafter(cfg, seed=recipe["seed"])
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    train(drafter, batches, embed, head, steps=recipe["drafter_steps"], lr=1e-2, seed=recipe["seed"])
    acc = teacher_forced_accuracy(drafter, batches, embed, head)
    log(f"drafter trained: teacher-forced acc@1 {acc['per_position'][0]:.2f}, est. τ {acc['tau_estimate']:.2f} "
        f"({time.time() - t0:.0f}s total)")

    target.save_pretrained(staging / "target")
    save_drafter(drafter, staging / "drafter", fmt="zlab")
    (staging / "stamp.json").write_text(json.dumps({"recipe": recipe, "tau_estimate": acc["tau_estimate"]}))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(staging, out)
    return paths(out)


def paths(out: Path) -> dict:
    return {"target": str(out / "target"), "drafter": str(out / "drafter")}


def built(out: Path, recipe: dict = RECIPE) -> dict | None:
    """The pair in ``out`` when it is built with ``recipe`` (:func:`paths`), else None."""
    stamp = out / "stamp.json"
    try:
        return paths(out) if json.loads(stamp.read_text()).get("recipe") == recipe else None
    except (OSError, json.JSONDecodeError):
        return None


def ensure(out: Path, recipe: dict = RECIPE) -> dict:
    if built(out, recipe):
        return paths(out)
    log(f"building the embedded {recipe.get('kind', 'demo')} target and drafter in {out} (first use, about a minute)")
    out.parent.mkdir(parents=True, exist_ok=True)
    import fcntl
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)       # two concurrent first uses build once
        return built(out, recipe) or build(out, recipe)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m remote.embedded", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for the pair (e.g. <workdir>/embedded)")
    p.add_argument("--recipe", choices=sorted(RECIPES), default="demo",
                   help="demo: the hybrid Qwen3.5-style target (default); qwen3: pure attention, head_dim 32")
    p.add_argument("--check", action="store_true",
                   help="build nothing: print the pair if it is built, else {} (torch is not imported)")
    args = p.parse_args(argv)
    if args.check:
        print(json.dumps(built(Path(args.out).expanduser(), RECIPES[args.recipe]) or {}), flush=True)
        return 0
    from remote.target.model import guard_cpu_kernels
    guard_cpu_kernels("cpu")
    with contextlib.redirect_stdout(sys.stderr):     # what a library prints never mixes with the answer
        pair = ensure(Path(args.out).expanduser(), RECIPES[args.recipe])
    print(json.dumps(pair), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
