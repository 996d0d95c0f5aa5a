"""Offline evaluation: walk a reference completion the way greedy speculative decoding would.

With greedy decoding the target's verify step accepts exactly the drafted tokens that match its
own greedy output, so given the reference completion (the target's greedy output) we need no
verify forwards: one target forward over ``prompt + completion`` gives every context feature,
and the drafts of every anchor come from the batched training-style mask.

The walk (identical to :func:`remote.online.speculative_generate`, cycle by cycle):
``max_length = P + N``; the first anchor is the first completion token (position ``P``); while
``start + 1 < max_length``: draft the block anchored at ``start`` (context ``[:start]``), accept
the longest prefix of drafts matching the reference (at most ``verify_size - 1`` with
``verify_size = min(B, max_length - start)``), commit it plus the bonus token:
``produced = min(a + 1, max_length - start - 1)``, ``start += produced``.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

from remote.drafter import DFlashDrafter, block_input_ids

DEFAULT_BUDGETS = (8, 16, 32, 64)


@dataclass
class DraftTable:
    """Drafts of anchors along one sequence, computed on demand in chunks of anchors through the
    batched anchor-block mask and cached. ``ids [T]`` are prompt + reference completion."""
    drafter: DFlashDrafter
    target_hidden: torch.Tensor        # [1, T, K*H]
    ids: torch.Tensor                  # [T]
    embed: torch.nn.Module
    lm_head: torch.nn.Module
    topk: int = 0                      # keep per-slot top-k log-probs (DDTree)
    chunk: int = 64
    tokens: dict = field(default_factory=dict)   # anchor -> [B-1] argmax drafts
    top: dict = field(default_factory=dict)      # anchor -> (logp [B-1, k], idx [B-1, k])
    blocks_drafted: int = 0

    def __getitem__(self, anchor: int) -> list[int]:
        if anchor not in self.tokens:
            self.compute(range(anchor, min(anchor + self.chunk, self.ids.numel() - 1)))
        return self.tokens[anchor]

    @torch.no_grad()
    def compute(self, anchors) -> None:
        anchors = torch.tensor([a for a in anchors if a not in self.tokens], dtype=torch.long,
                               device=self.ids.device)
        if anchors.numel() == 0:
            return
        B, cfg = self.drafter.block_size, self.drafter.config
        blocks = block_input_ids(self.ids[anchors], B, cfg.mask_token_id)[None]
        last = int(anchors.max())
        hidden = self.drafter.forward_anchors(self.target_hidden[:, :last + 1], self.embed(blocks), anchors[None])
        logits = self.lm_head(hidden.view(anchors.numel(), B, -1)[:, 1:]).float()     # [n, B-1, V]
        drafts = logits.argmax(-1).tolist()
        if self.topk:
            logp, idx = logits.log_softmax(-1).topk(self.topk, dim=-1)
            logp, idx = logp.cpu(), idx.cpu()
        for j, a in enumerate(anchors.tolist()):
            self.tokens[a] = drafts[j]
            if self.topk:
                self.top[a] = (logp[j], idx[j])
        self.blocks_drafted += anchors.numel()


def greedy_walk(drafts, ref: list[int], prompt_len: int, block_size: int, max_blocks: int | None = None,
                accept=None) -> list[int]:
    """Acceptance lengths of the walk over ``ref`` (prompt + completion). ``accept(start, n)``
    returns the accepted draft count at ``start`` (at most ``n``); default: longest matching prefix
    of ``drafts[start]``."""
    if accept is None:
        def accept(start, n):
            d, a = drafts[start], 0
            while a < n and d[a] == ref[start + 1 + a]:
                a += 1
            return a
    max_length, start = len(ref), prompt_len
    lengths: list[int] = []
    while start + 1 < max_length and (max_blocks is None or len(lengths) < max_blocks):
        verify_size = min(block_size, max_length - start)
        a = accept(start, verify_size - 1)
        produced = min(a + 1, max_length - start - 1)
        lengths.append(produced)
        start += produced
    return lengths


def ddtree_depth(logp: torch.Tensor, idx: torch.Tensor, truth: list[int], budget: int) -> int:
    """Depth accepted by a DDTree of ``budget`` nodes (root excluded) grown best-first by summed
    log-prob from one draft pass (per-slot top-k ``logp/idx [B-1, k]``), against the target's
    tokens ``truth`` for slots 1..; the tree is prefix-closed, so the accepted depth is the longest
    prefix of ``truth`` that is a node."""
    depth_max, k = logp.shape
    lp, ix = logp.tolist(), idx.tolist()
    tree: set[tuple[int, ...]] = set()
    heap = [(-lp[0][0], (0,))]          # a path is the tuple of ranks per depth
    while heap and len(tree) < budget:
        neg, ranks = heapq.heappop(heap)
        tree.add(tuple(ix[d][r] for d, r in enumerate(ranks)))
        d = len(ranks) - 1
        if d + 1 < depth_max:        # first child
            heapq.heappush(heap, (neg - lp[d + 1][0], ranks + (0,)))
        if ranks[-1] + 1 < k:        # next sibling
            heapq.heappush(heap, (neg + lp[d][ranks[-1]] - lp[d][ranks[-1] + 1], ranks[:-1] + (ranks[-1] + 1,)))
    a = 0
    while a < min(len(truth), depth_max) and tuple(truth[:a + 1]) in tree:
        a += 1
    return a


def ddtree_walk(table: DraftTable, ref: list[int], prompt_len: int, block_size: int, budget: int,
                max_blocks: int | None = None) -> list[int]:
    def accept(start, n):
        table[start]
        logp, idx = table.top[start]
        return min(n, ddtree_depth(logp, idx, ref[start + 1:start + block_size], budget))
    return greedy_walk(None, ref, prompt_len, block_size, max_blocks, accept)


def all_anchor_hits(table: DraftTable, ref: list[int], prompt_len: int, block_size: int) -> dict:
    """Teacher-forced per-slot hits with every completion position an anchor."""
    correct = [0] * (block_size - 1)
    count = [0] * (block_size - 1)
    table.compute(range(prompt_len, len(ref) - 1))
    for p in range(prompt_len, len(ref) - 1):
        d = table[p]
        for k in range(1, block_size):
            if p + k < len(ref):
                count[k - 1] += 1
                correct[k - 1] += int(d[k - 1] == ref[p + k])
    return {"correct": correct, "count": count}


def evaluate_offline(drafter, target, prompt_ids: list[int], output_ids: list[int], *, max_blocks=None,
                     budgets=DEFAULT_BUDGETS, all_anchors: bool = False, chunk: int = 64) -> dict:
    """One target forward over prompt + reference, then the greedy walk, DDTree walks and
    optionally the all-anchors hits. Returns the per-turn fields of a results row."""
    from remote.target import target_features

    device = next(target.parameters()).device
    ref = list(prompt_ids) + list(output_ids)
    ids = torch.tensor(ref, dtype=torch.long, device=device)
    _, target_hidden = target_features(target, ids[None, :-1] if len(ref) > 1 else ids[None],
                                       drafter.config.target_layer_ids)
    target_hidden = target_hidden.to(next(drafter.parameters()).dtype)
    table = DraftTable(drafter, target_hidden, ids, target.get_input_embeddings(), target.get_output_embeddings(),
                       topk=max(budgets) if budgets else 0, chunk=chunk)
    B = drafter.block_size
    out = {"acceptance_lengths": greedy_walk(table, ref, len(prompt_ids), B, max_blocks)}
    if budgets:
        out["ddtree"] = {str(n): {"acceptance_lengths": ddtree_walk(table, ref, len(prompt_ids), B, n, max_blocks)}
                         for n in budgets}
    if all_anchors:
        out["all_anchors"] = all_anchor_hits(table, ref, len(prompt_ids), B)
    out["blocks_drafted"] = table.blocks_drafted
    return out
