"""Tiny models shared by tests (built once per test process; all CPU, seeded)."""
from __future__ import annotations

from functools import lru_cache

import torch

from remote.tiny import pretrain_target, tiny_drafter, tiny_drafter_config, tiny_target, training_batches, walk_batch

PROMPT_LEN = 6


def freeze(model):
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@lru_cache(maxsize=None)
def random_target(kind: str = "qwen3"):
    return freeze(tiny_target(kind))


@lru_cache(maxsize=None)
def walk_target(kind: str = "qwen3", steps: int = 120):
    """A tiny target taught the permutation-walk language (structured greedy output)."""
    model = tiny_target(kind, tie=False)
    pretrain_target(model, steps=steps)
    return freeze(model)


def walk_sequences(target, n: int, new_tokens: int = 50, seed: int = 1) -> list[torch.Tensor]:
    prompts = walk_batch(n, PROMPT_LEN, target.config.vocab_size - 1, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return [row[None] for row in out]


@lru_cache(maxsize=None)
def walk_batches(kind: str = "qwen3", n: int = 72):
    target = walk_target(kind)
    cfg = tiny_drafter_config(target)
    return cfg, training_batches(target, cfg, walk_sequences(target, n), prompt_len=PROMPT_LEN)


def random_drafter(target, **kw):
    return tiny_drafter(tiny_drafter_config(target, **kw))


@lru_cache(maxsize=None)
def trained_drafter(kind: str = "qwen3", steps: int = 300):
    """A drafter trained with the reference training step on ``walk_target(kind)``'s greedy walks
    (real acceptance: partial and full accepts)."""
    from remote.train import train

    target = walk_target(kind)
    cfg, batches = walk_batches(kind)
    drafter = tiny_drafter(cfg, seed=0)
    train(drafter, batches, target.get_input_embeddings(), target.get_output_embeddings(), steps=steps, lr=1e-2)
    return freeze(drafter)
