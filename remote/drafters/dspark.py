"""SpecForge's DSpark drafter: the DFlash backbone, then a low-rank previous-token ("Markov") logit
bias applied draft by draft, and a confidence head that predicts each draft's acceptance
(``specforge/modeling/draft/dspark.py``).

Draft ``k`` (0-based, slot ``k + 1``, hidden ``h_k``, base logits ``base_k`` from the target's
``lm_head``) with the previous token ``x_{k-1}`` (``x_{-1}`` the anchor) is drafted from
``base_k + bias_k``:

* ``vanilla``: ``bias_k = W2 · E[x_{k-1}]`` (``E = markov_w1``, ``[V, r]``; ``W2 = markov_w2``, ``[r → V]``);
* ``gated``: ``bias_k = W2 · (σ(gate_proj([h_k ; E[x_{k-1}]])) ⊙ E[x_{k-1}])``;
* ``rnn``: a state ``s`` (zero at the anchor) over the block, ``[g ; c ; o] = joint_proj([s ; E[x_{k-1}] ; h_k])``,
  ``s ← σ(g) ⊙ s + (1 − σ(g)) ⊙ tanh(c)``, ``bias_k = W2 · tanh(o)``;
* ``markov_rank`` 0: no bias (the drafts are plain DFlash drafts).

The confidence head is one linear layer on ``h_k`` (and ``E[x_{k-1}]`` with
``confidence_head_with_markov``); ``σ`` of its output is the predicted probability that draft ``k``
is accepted given the ones before it, and the product over ``0..k`` (the *survival*) that the cycle
accepts at least ``k + 1`` drafts. SGLang plans how many drafts to verify from the survival;
:mod:`remote.contract.confidence` judges it against the drafts actually accepted.
"""
from __future__ import annotations

import torch
from torch import nn

from remote.drafters.config import DrafterConfig
from remote.drafters.dflash import DFlashDrafter, NonFiniteOutput, Proposal, finite
from remote.drafters.sampling import Sampling, sample


MARKOV = "Markov head"


class MarkovHead(nn.Module):
    """The previous-token bias (module docstring); parameter names are SpecForge's."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.kind, r = cfg.markov_head_type, cfg.markov_rank
        self.markov_w1 = nn.Embedding(cfg.vocab_size, r)
        self.markov_w2 = nn.Linear(r, cfg.vocab_size, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(cfg.hidden_size + r, r)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + cfg.hidden_size, 3 * r)

    def step(self, prev: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None):
        """``(bias [b, V], next state)`` for the draft after ``prev [b]`` with hidden ``[b, H]``."""
        e = self.markov_w1(prev.long())
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, e], dim=-1))).to(e.dtype)
            return self.markov_w2(gate * e), None
        if self.kind == "rnn":
            state = torch.zeros_like(e) if state is None else state
            gate, candidate, output = self.joint_proj(torch.cat([state, e, hidden], dim=-1)).chunk(3, dim=-1)
            gate = torch.sigmoid(gate)
            return self.markov_w2(torch.tanh(output)), gate * state + (1.0 - gate) * torch.tanh(candidate)
        return self.markov_w2(e), None


class ConfidenceHead(nn.Module):
    """SpecForge's ``AcceptRatePredictor``: one linear layer to a logit per drafted position."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg)
        self.markov_head = MarkovHead(cfg) if cfg.markov_rank else None
        if cfg.confidence_head:
            self.confidence_head = ConfidenceHead(cfg.hidden_size + (cfg.markov_rank if cfg.confidence_head_with_markov
                                                                     else 0))

    def propose(self, hidden: torch.Tensor, anchor_tokens: torch.Tensor, target_head: nn.Module,
                sampling: Sampling | None = None, embed_weight: torch.Tensor | None = None) -> Proposal:
        if self.markov_head is None:     # the drafts are plain DFlash drafts
            proposal = super().propose(hidden, anchor_tokens, target_head, sampling)
            proposal.confidence = self.confidence(hidden, anchor_tokens, proposal.tokens)
            return proposal
        base = self.logits(hidden, target_head)
        greedy = sampling is None or sampling.greedy
        prev = anchor_tokens.to(hidden.device).long()
        picked, q_rows, state, finite_rows = [], [], None, []
        for k in range(hidden.shape[1]):
            bias, state = self.markov_head.step(prev, hidden[:, k], state)
            logits = base[:, k] + bias
            finite_rows.append(torch.isfinite(logits).all())     # checked once the block is drafted
            if greedy:
                prev = logits.argmax(-1)
            else:
                q = sampling.probs(finite(logits, MARKOV))
                prev = sample(q)
                q_rows.append(q)
            picked.append(prev)
        if not bool(torch.stack(finite_rows).all()):
            raise NonFiniteOutput(MARKOV)
        tokens = torch.stack(picked, 1)
        return Proposal(tokens, torch.stack(q_rows, 1) if q_rows else None,
                        confidence=self.confidence(hidden, anchor_tokens, tokens))

    def teacher_forced_logits(self, hidden: torch.Tensor, prev_tokens: torch.Tensor, target_head: nn.Module,
                              embed_weight: torch.Tensor | None = None) -> torch.Tensor:
        base = self.logits(hidden, target_head)
        if self.markov_head is None:
            return base
        rows, state = [], None
        for k in range(hidden.shape[1]):
            bias, state = self.markov_head.step(prev_tokens[:, k].to(hidden.device), hidden[:, k], state)
            rows.append(base[:, k] + bias)
        return finite(torch.stack(rows, 1), MARKOV)

    def confidence(self, hidden: torch.Tensor, anchor_tokens: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor | None:
        """Each draft's predicted acceptance ``σ(head) [b, n]`` (float32), or None without the head."""
        if not self.config.confidence_head:
            return None
        features = hidden
        if self.config.confidence_head_with_markov:
            prev = torch.cat([anchor_tokens.to(drafts.device)[:, None], drafts[:, :-1]], dim=1)
            features = torch.cat([hidden, self.markov_head.markov_w1(prev.long()).to(hidden.dtype)], dim=-1)
        return torch.sigmoid(finite(self.confidence_head(features).float(), "confidence head"))
