"""Sampling settings and lossless speculative sampling, as z-lab's ``dflash_generate`` does them.

* :meth:`Sampling.probs`: logits / T, then top-k (keep the k best), then top-p (keep the smallest
  prefix of the sorted distribution whose mass reaches p, the token crossing p included), renormalised.
  T = 0 means greedy (argmax) everywhere.
* :func:`rejection_sample`: draft ``x_k ~ q_k`` is accepted while ``u_k * q_k(x_k) < p_k(x_k)``
  (``u_k`` uniform); at the first rejection the next token is drawn from the residual
  ``max(p_k - q_k, 0)`` (renormalised; ``p_k`` when it is all zero), after a full accept from the
  target's distribution at the bonus position. The output is distributed as the target's own
  sampling (lossless).

Random numbers come from torch's global generator in the reference's order and shapes (one
``multinomial`` over all drafts of a block, one ``rand`` of the drafts' length, one ``multinomial``
for the bonus / residual token), so a run seeded like z-lab's draws the same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from remote.contract.settings import sampling_problem


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        problem = sampling_problem(self.temperature, self.top_p, self.top_k)
        if problem:
            raise ValueError(problem)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The tempered, top-k / top-p filtered distribution over the last axis (float32)."""
        scores = logits.float() / self.temperature
        V = scores.shape[-1]
        kept = None
        if 0 < self.top_k < V:
            scores, kept = torch.topk(scores, self.top_k, dim=-1)
        probs = torch.softmax(scores, dim=-1)
        if self.top_p < 1.0:
            ordered, order = probs.sort(dim=-1, descending=True)
            mass_before = ordered.cumsum(dim=-1) - ordered
            ordered = ordered * (mass_before < self.top_p)
            probs = torch.zeros_like(probs).scatter(-1, order, ordered)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        if kept is not None:
            probs = torch.zeros(*logits.shape, dtype=probs.dtype, device=probs.device).scatter(-1, kept, probs)
        return probs

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """One token per row: argmax when greedy, else a sample from :meth:`probs`."""
        return logits.argmax(-1) if self.greedy else sample(self.probs(logits))

    def describe(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}


GREEDY = Sampling()


def sample(probs: torch.Tensor) -> torch.Tensor:
    """One draw per row of ``probs [..., V]`` (a single ``multinomial`` call)."""
    return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1).view(probs.shape[:-1])


def rejection_sample(drafts: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor,
                     candidates: torch.Tensor | None = None) -> tuple[int, int]:
    """Speculative sampling of one block (batch 1).

    ``drafts [1, g]`` (target ids), ``target_probs [1, g + 1, V]`` (the target's distribution at
    the anchor and every draft position), ``draft_probs [1, g, V]`` over the target vocabulary, or
    ``[1, g, k]`` over ``candidates [1, g, k]`` (DFlash2). Returns ``(accepted drafts, next token)``.
    """
    g = drafts.shape[1]
    p = target_probs[:, :g].gather(-1, drafts[..., None])[..., 0]                  # [1, g]
    if candidates is None:
        q = draft_probs.gather(-1, drafts[..., None])[..., 0]
    else:
        q = (draft_probs * (candidates == drafts[..., None])).sum(-1)
    u = torch.rand_like(q)
    accepted = int((u * q < p).to(torch.int32).cumprod(-1).sum())
    if accepted == g:
        return accepted, int(sample(target_probs[:, g]))
    residual = target_probs[0, accepted].clone()
    if candidates is None:
        residual -= draft_probs[0, accepted]
    else:
        residual.scatter_add_(0, candidates[0, accepted], -draft_probs[0, accepted])
    residual.clamp_min_(0)
    total = residual.sum()
    residual = residual / total if total > 0 else target_probs[0, accepted]
    return accepted, int(sample(residual[None]))
