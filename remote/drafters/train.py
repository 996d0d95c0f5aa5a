"""Reference DFlash training loss and a tiny training loop (tests and the embedded demo).

Loss: random anchors on supervised positions; for a block anchored at ``p``, slot ``k``
(1 <= k < B) is trained with cross-entropy against the true token ``p + k``, weighted
``exp(-(k-1)/gamma)``; slot 0 (the anchor itself) is not supervised. All anchors of a sequence
go through one forward with the training-style mask (:meth:`DFlashDrafter.forward_anchors`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from remote.drafters.dflash import DFlashDrafter, block_input_ids


@dataclass
class Batch:
    """One training row: tokens, their target features and which positions are supervised."""
    input_ids: torch.Tensor      # [1, T]
    target_hidden: torch.Tensor  # [1, T, K*H]
    loss_mask: torch.Tensor      # [1, T] bool: position t is a supervised label


def sample_anchors(loss_mask: torch.Tensor, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Up to ``n`` distinct anchors ``p`` (sorted) whose next token ``p + 1`` is supervised."""
    T = loss_mask.shape[-1]
    candidates = torch.nonzero(loss_mask[0, 1:]).flatten()  # p + 1 supervised  <=>  p in candidates
    if candidates.numel() == 0:
        return candidates
    pick = torch.randperm(candidates.numel(), generator=generator)[:n]
    return candidates[pick].sort().values.clamp(max=T - 2)


def block_logits(drafter: DFlashDrafter, batch: Batch, anchors: torch.Tensor, embed, lm_head) -> torch.Tensor:
    """Logits of slots 1..B-1 for every anchor: ``[n, B-1, V]``."""
    B, mask_id = drafter.block_size, drafter.config.mask_token_id
    blocks = block_input_ids(batch.input_ids[0, anchors], B, mask_id)[None]      # [1, n*B]
    hidden = drafter.forward_anchors(batch.target_hidden, drafter.embed(blocks, embed.weight), anchors[None])
    hidden = hidden.view(anchors.numel(), B, -1)[:, 1:]
    return drafter.logits(hidden, lm_head)


def block_labels(batch: Batch, anchors: torch.Tensor, block_size: int):
    """True tokens ``p+1 .. p+B-1`` for each anchor and whether each is a valid, supervised label."""
    T = batch.input_ids.shape[1]
    idx = anchors[:, None] + torch.arange(1, block_size, device=anchors.device)  # [n, B-1]
    valid = idx < T
    idx = idx.clamp(max=T - 1)
    return batch.input_ids[0, idx], valid & batch.loss_mask[0, idx]


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def dflash_loss(drafter, batch: Batch, anchors, embed, lm_head, gamma: float = 7.0):
    """Weighted CE over slots 1..B-1. Returns ``(loss, correct [n, B-1] bool, valid [n, B-1])``."""
    logits = block_logits(drafter, batch, anchors, embed, lm_head)
    labels, valid = block_labels(batch, anchors, drafter.block_size)
    ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none").view_as(labels)
    w = position_weights(drafter.block_size, gamma, ce.device) * valid
    loss = (ce * w).sum() / w.sum().clamp_min(1e-9)
    return loss, (logits.argmax(-1) == labels) & valid, valid


@torch.no_grad()
def teacher_forced_accuracy(drafter, batches: list[Batch], embed, lm_head) -> dict:
    """Per-position accuracy with every supervised position an anchor (the training-log metric),
    and its cumulative product (an estimate of how far a block is accepted)."""
    B = drafter.block_size
    correct = torch.zeros(B - 1)
    count = torch.zeros(B - 1)
    for batch in batches:
        anchors = sample_anchors(batch.loss_mask, batch.input_ids.shape[1])
        _, ok, valid = dflash_loss(drafter, batch, anchors, embed, lm_head)
        correct += ok.sum(0).float()
        count += valid.sum(0).float()
    acc = (correct / count.clamp_min(1)).tolist()
    return {"per_position": acc, "cumulative": torch.tensor(acc).cumprod(0).tolist(),
            "tau_estimate": 1 + float(torch.tensor(acc).cumprod(0).sum())}


def train(drafter, batches: list[Batch], embed, lm_head, steps: int = 300, lr: float = 3e-3,
          anchors_per_seq: int = 32, gamma: float = 7.0, seed: int = 0, log_every: int = 0, log=print) -> list[float]:
    """A tiny AdamW loop with cosine decay; embed and lm_head (the target's) stay frozen."""
    gen = torch.Generator().manual_seed(seed)
    drafter.train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    losses = []
    for step in range(steps):
        batch = batches[int(torch.randint(len(batches), (1,), generator=gen))]
        anchors = sample_anchors(batch.loss_mask, anchors_per_seq, gen)
        loss, _, _ = dflash_loss(drafter, batch, anchors, embed, lm_head, gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            log(f"step {step + 1}/{steps} loss {sum(losses[-log_every:]) / log_every:.3f}")
    drafter.eval()
    return losses
