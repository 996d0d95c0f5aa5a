"""Tiny models shared by tests (all CPU, seeded). The trained ones are built once and kept on disk
(tests/buildcache.py): every test process and session loads the same weights."""
from __future__ import annotations

from functools import lru_cache

import torch

import buildcache
from remote.drafters.tiny import (pretrain_target, tiny_drafter, tiny_drafter_config, tiny_target, training_batches,
                                  walk_batch)
from remote.drafters.train import Batch

PROMPT_LEN = 6


def freeze(model):
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _load(model, folder, name: str = "model.pt"):
    model.load_state_dict(torch.load(folder / name, weights_only=True))
    return model


@lru_cache(maxsize=None)
def random_target(kind: str = "qwen3"):
    return freeze(tiny_target(kind))


@lru_cache(maxsize=None)
def walk_target(kind: str = "qwen3", steps: int = 120):
    """A tiny target taught the permutation-walk language (structured greedy output)."""
    def build(out):
        model = tiny_target(kind, tie=False)
        pretrain_target(model, steps=steps)
        torch.save(model.state_dict(), out / "model.pt")

    folder = buildcache.built("walk-target", {"kind": kind, "steps": steps}, build)
    return freeze(_load(tiny_target(kind, tie=False), folder))


def walk_sequences(target, n: int, new_tokens: int = 50, seed: int = 1) -> list[torch.Tensor]:
    prompts = walk_batch(n, PROMPT_LEN, target.config.vocab_size - 1, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return [row[None] for row in out]


@lru_cache(maxsize=None)
def walk_batches(kind: str = "qwen3", n: int = 72):
    """``(drafter config, training batches)``: ``walk_target(kind)``'s greedy walks and its features."""
    target = walk_target(kind)
    cfg = tiny_drafter_config(target)

    def build(out):
        batches = training_batches(target, cfg, walk_sequences(target, n), prompt_len=PROMPT_LEN)
        torch.save([(b.input_ids, b.target_hidden, b.loss_mask) for b in batches], out / "batches.pt")

    folder = buildcache.built("walk-batches", {"kind": kind, "n": n}, build)
    return cfg, [Batch(*b) for b in torch.load(folder / "batches.pt", weights_only=True)]


def random_drafter(target, **kw):
    return tiny_drafter(tiny_drafter_config(target, **kw))


def _walk_drafter(kind: str, steps: int, held_out: int) -> tuple[object, list[float]]:
    """A drafter trained with the reference training step on ``walk_target(kind)``'s greedy walks but
    the first ``held_out``, and its losses."""
    from remote.drafters.train import train

    target = walk_target(kind)
    cfg = tiny_drafter_config(target)

    def build(out):
        _, batches = walk_batches(kind)
        drafter = tiny_drafter(cfg, seed=0)
        losses = train(drafter, batches[held_out:], target.get_input_embeddings(), target.get_output_embeddings(),
                       steps=steps, lr=1e-2)
        torch.save({"state": drafter.state_dict(), "losses": torch.tensor(losses)}, out / "drafter.pt")

    folder = buildcache.built("walk-drafter", {"kind": kind, "steps": steps, "held_out": held_out}, build)
    saved = torch.load(folder / "drafter.pt", weights_only=True)
    drafter = tiny_drafter(cfg, seed=0)
    drafter.load_state_dict(saved["state"])
    return freeze(drafter), saved["losses"].tolist()


@lru_cache(maxsize=None)
def trained_drafter(kind: str = "qwen3", steps: int = 300):
    """A drafter trained on all of ``walk_batches(kind)`` (real acceptance: partial and full accepts)."""
    return _walk_drafter(kind, steps, held_out=0)[0]


HELD_OUT = 8


@lru_cache(maxsize=None)
def held_out_drafter(kind: str = "qwen3", steps: int = 400):
    """``(drafter, losses)``: trained on ``walk_batches(kind)[HELD_OUT:]``, so the first ``HELD_OUT``
    batches are walks it never saw."""
    return _walk_drafter(kind, steps, held_out=HELD_OUT)
