"""SpecForge's Domino drafter: the DFlash backbone, then a head that drafts the block's tokens one
after another, each corrected by the tokens drafted before it (``specforge/modeling/draft/domino.py``).

Draft ``k`` (0-based; token ``p + k + 1`` of the block anchored at ``p``) is drafted from

    logits_k = base_k + embed_proj(cat(h_k, g_k))        (k >= pure_draft_prefix_len; else base_k)

* ``h_k``: the backbone's hidden state of the draft's slot, ``k + 1`` (or ``k`` with ``shift_label``:
  slot ``k`` then predicts token ``p + k + 1``, as speculators' ``sample_from_anchor`` slots do),
  and ``base_k`` the logits of that slot (the target's ``lm_head``);
* ``g_k``: a one-layer GRU (no bias) run over the target's embeddings of the block's tokens so far,
  ``[token_p, d_0, ..., d_{k-1}]``: its output after ``k + 1`` steps;
* ``embed_proj``: ``Linear(H + G, E) -> SiLU -> Linear(E, V)`` (no biases).

The drafts are therefore chosen in order: greedy, each is the argmax of its corrected logits;
sampled, each is drawn from their tempered distribution (which is the draft's ``q`` for lossless
speculative sampling). As SpecForge computes them, every step runs the GRU over the block's
embeddings with the not-yet-drafted slots holding the mask token (a GRU is causal: those later
inputs never reach step ``k``'s output) and the head over every draft slot, then keeps row ``k``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from remote.drafters.config import DrafterConfig
from remote.drafters.dflash import DFlashDrafter, Proposal, finite
from remote.drafters.sampling import Sampling, sample


class DominoDrafter(DFlashDrafter):
    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg)
        self.prefix_gru = nn.GRU(cfg.hidden_size, cfg.gru_hidden_dim, num_layers=1, batch_first=True, bias=False)
        self.embed_proj = nn.Sequential(nn.Linear(cfg.hidden_size + cfg.gru_hidden_dim, cfg.emb_dim, bias=False),
                                        nn.SiLU(), nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False))

    def draft_slots(self, hidden: torch.Tensor) -> torch.Tensor:
        """Slots ``1..`` (slot ``k + 1`` drafts token ``p + k + 1``), or ``0..B-2`` with ``shift_label``."""
        return hidden[..., :-1, :] if self.config.shift_label else hidden[..., 1:, :]

    def teacher_forced_logits(self, hidden: torch.Tensor, prev_tokens: torch.Tensor, target_head: nn.Module,
                              embed_weight: torch.Tensor | None = None, base: torch.Tensor | None = None) -> torch.Tensor:
        """Every draft's corrected logits ``[b, n, V]`` given the block's tokens ``prev_tokens [b, n]``
        (the anchor and the tokens before each draft): the GRU over their embeddings (state ``k`` has
        seen ``prev_tokens[:, :k + 1]``) and the head over every draft slot. ``base``: the slots'
        logits when already computed."""
        if embed_weight is None:
            raise ValueError("a Domino drafter drafts from the target's embeddings of the block's tokens")
        base = self.logits(hidden, target_head) if base is None else base
        start = self.config.pure_draft_prefix_len
        emb = F.embedding(prev_tokens.to(embed_weight.device), embed_weight).to(hidden.device, hidden.dtype)
        states = self.prefix_gru(emb)[0]                                             # [b, n, G]
        correction = finite(self.embed_proj(torch.cat([hidden[:, start:], states[:, start:]], dim=-1)), "Domino head")
        return torch.cat([base[:, :start], base[:, start:] + correction], dim=1)

    def propose(self, hidden: torch.Tensor, anchor_tokens: torch.Tensor, target_head: nn.Module,
                sampling: Sampling | None = None, embed_weight: torch.Tensor | None = None) -> Proposal:
        if embed_weight is None:
            raise ValueError("a Domino drafter drafts from the target's embeddings of the block's tokens")
        base = self.logits(hidden, target_head)
        greedy = sampling is None or sampling.greedy
        n = hidden.shape[1]
        block_ids = torch.full((hidden.shape[0], n + 1), self.config.mask_token_id, dtype=torch.long,
                               device=hidden.device)
        block_ids[:, 0] = anchor_tokens.to(hidden.device)
        q_rows = []
        for k in range(n):       # as SpecForge: the whole block with mask tokens after k, row k kept
            logits = base[:, k] if k < self.config.pure_draft_prefix_len else \
                self.teacher_forced_logits(hidden, block_ids[:, :n], target_head, embed_weight, base)[:, k]
            if greedy:
                block_ids[:, k + 1] = logits.argmax(-1)
            else:
                q = sampling.probs(logits)
                block_ids[:, k + 1] = sample(q)
                q_rows.append(q)
        return Proposal(block_ids[:, 1:], torch.stack(q_rows, 1) if q_rows else None)
