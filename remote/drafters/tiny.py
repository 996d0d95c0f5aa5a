"""Tiny, deterministic targets and drafters (CPU, milliseconds): tests, benchmarks, the demo."""
from __future__ import annotations

import torch

from remote.drafters.dflash import DFlashDrafter, init_weights
from remote.drafters.families import build_drafter
from remote.drafters.config import FULL, SLIDING, DrafterConfig
from remote.target.model import guard_cpu_kernels, target_features
from remote.drafters.train import Batch


def tiny_target(kind: str = "qwen3", vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 4, seed: int = 0,
                tie: bool = True, init_std: float = 0.02, head_dim: int = 16):
    """A random tiny ``qwen3`` or hybrid ``qwen3_5`` (Gated DeltaNet + full attention) CausalLM.
    ``head_dim`` is the attention layers' (vLLM's CPU attention needs 32 or more)."""
    guard_cpu_kernels("cpu")
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                  max_position_embeddings=4096, tie_word_embeddings=tie,
                  initializer_range=init_std)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif kind == "qwen3_5":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
        types = (["linear_attention"] * 3 + ["full_attention"]) * (num_layers // 4) or ["full_attention"] * num_layers
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(
            **common, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, layer_types=types))
    else:
        raise ValueError(f"unknown tiny target kind {kind!r}")
    return model.eval()


def tiny_drafter_config(target, layers: int = 2, block_size: int = 8, target_layer_ids=None,
                        sliding: bool = False, sliding_window: int = 12, head_dim: int = 16) -> DrafterConfig:
    tc = target.config
    L = tc.num_hidden_layers
    ids = target_layer_ids if target_layer_ids is not None else sorted({0, L // 2 - 1, L - 2})
    return DrafterConfig(
        hidden_size=tc.hidden_size, intermediate_size=2 * tc.hidden_size, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, target_layer_ids=list(ids),
        mask_token_id=tc.vocab_size - 1, vocab_size=tc.vocab_size, block_size=block_size, num_target_layers=L,
        layer_types=([SLIDING] + [FULL] * (layers - 1)) if sliding else [FULL] * layers,
        sliding_window=sliding_window if sliding else None)


def tiny_drafter(cfg: DrafterConfig, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    model = build_drafter(cfg)
    init_weights(model, generator=torch.Generator().manual_seed(seed))
    return model.eval()


@torch.no_grad()
def greedy_sequences(target, n: int, prompt_len: int = 8, new_tokens: int = 56, seed: int = 0,
                     exclude: int | None = None) -> list[torch.Tensor]:
    """Random prompts continued greedily by the target: ``[1, prompt_len + new_tokens]`` each."""
    gen = torch.Generator().manual_seed(seed)
    V = target.config.vocab_size - (1 if exclude is None else 0)
    ids = torch.randint(0, V - 1, (n, prompt_len), generator=gen)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return [row[None] for row in out]


def training_batches(target, drafter_cfg: DrafterConfig, seqs: list[torch.Tensor], prompt_len: int = 8) -> list[Batch]:
    batches = []
    for ids in seqs:
        _, th = target_features(target, ids, drafter_cfg.target_layer_ids)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[:, prompt_len:] = True
        batches.append(Batch(ids, th, mask))
    return batches


def walk_batch(n: int, length: int, vocab: int, gen: torch.Generator, seed: int = 0) -> torch.Tensor:
    """Walks of a fixed random permutation ``next = perm[token]`` over ``vocab`` ids: a tiny language
    whose greedy continuation is learnable (and a drafter can learn ``perm^k``)."""
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed + 1234))
    ids = torch.empty(n, length, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (n,), generator=gen)
    for t in range(1, length):
        ids[:, t] = perm[ids[:, t - 1]]
    return ids


def teach_lm(model, batches, steps: int, lr: float = 3e-3) -> float:
    """Plain causal-LM training of a tiny target: ``batches()`` -> ``(input_ids, labels)``."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        ids, labels = batches()
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    return loss.item()


def pretrain_target(target, steps: int = 200, batch: int = 32, length: int = 48, lr: float = 3e-3, seed: int = 0):
    """Teach a random tiny target the permutation-walk language so its greedy output is structured."""
    gen = torch.Generator().manual_seed(seed)
    V = target.config.vocab_size - 1  # keep the last id free for the mask token

    def batches():
        ids = walk_batch(batch, length, V, gen, seed)
        return ids, ids
    return teach_lm(target, batches, steps, lr)
