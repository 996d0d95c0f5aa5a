"""Offline evaluation: walk a reference completion the way speculative decoding would.

**Greedy (T = 0).** The target's verify step accepts exactly the drafted tokens that match its own
greedy output, so given the reference completion (the target's greedy output) no verify forwards
are needed: one target forward over ``prompt + completion`` gives every context feature, and the
drafts of every anchor come from the batched training-style mask. The walk is
:func:`remote.decode.online.speculative_generate`'s, cycle by cycle: ``max_length = P + N``; the first
anchor is the first completion token (position ``P``); while ``start + 1 < max_length``:
``verify_size = min(verify_block, max_length - start)``, draft the ``verify_size - 1`` tokens of
the block anchored at ``start`` (context ``[:start]``; the last blocks are cut as z-lab cuts them,
so they are drafted one anchor at a time), accept the longest prefix matching the reference, commit
it plus the bonus token: ``produced = min(a + 1, max_length - start - 1)``, ``start += produced``.

**Sampled (T > 0)** there is no single walk: the reference completion is one sample, and what a
cycle accepts is random. Reported instead, labelled an estimate: for every anchor ``p`` of the
completion and draft ``k``, ``α_k(p) = Σ_x min(p_k(x), q_k(x))`` with ``p_k`` the teacher-forced
target's sampling distribution for that token (the reference prefix before it) and ``q_k`` the
drafter's (a family whose drafts read the drafts before them: given the reference's tokens,
``teacher_forced_logits``); ``E[τ](p) = 1 + Σ_k Π_{j≤k} α_j(p)``. It is exact for a cycle whose
accepted drafts equal the reference; along other prefixes the target may assign other
probabilities. Under SpecForge's rules the drafter drafts greedily and a draft is accepted when the
target's sample equals it, so ``α_k(p) = p_k(d_k)`` for the greedy draft ``d_k`` (drafted from the
drafts before it), exact for a cycle whose drafts equal the reference as far as they are accepted.

**SpecForge's rules** (``semantics="specforge"``, and ``"ddtree"``: DDTree's ``ddtree_generate``
counts alike; :mod:`remote.decode.online`): full blocks everywhere, ``while start < P + max_new_tokens``, the whole accepted run counted, a stop token
looked for after each cycle. The last cycles then compare drafts with the target's greedy tokens
past ``max_new_tokens`` or past the stop token: the reference is the target's greedy decoding run
that much further (``continuation``), and the walk is again the online decoding's, cycle for cycle.

**Families whose drafts depend on the token drafted before** (DFlash2's selector, Domino, DSpark's
Markov head) draft each block's tokens in order in the batched walk too, from their own drafts.

**DDTree-N** (greedy): the best-first tree of N nodes that online tree decoding verifies, grown
from the same draft pass (:mod:`remote.decode.tree`); accepted depth = the longest prefix of the
reference that is a node. DFlash: per-slot top-k of the draft logits (the same children under
every node). DFlash2: a node's children are the next slot's candidates scored by the selector
with the node's token as the predecessor, so the tree follows the selector's chain distribution.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from remote.drafters.dflash import DFLASH2, DFlashDrafter, block_input_ids
from remote.contract.families import tree_refusal
from remote.contract.settings import DEFAULT_BUDGETS
from remote.decode.online import labelled_confidences
from remote.decode.tree import block_children, ddtree_depth, slot_children  # noqa: F401  (the walk's trees)
from remote.drafters.sampling import Sampling



@dataclass
class DraftTable:
    """Drafts of anchors along one sequence, computed on demand in chunks of anchors and cached.
    ``ids [T]`` are prompt + reference completion (``max_length = T``)."""
    drafter: DFlashDrafter
    target_hidden: torch.Tensor        # [1, T, K*H] (positions 0..T-2 are used)
    ids: torch.Tensor                  # [T]
    embed_weight: torch.Tensor
    head: torch.nn.Module
    topk: int = 0                      # keep what DDTree needs (per-slot top-k, or the selector's inputs)
    chunk: int = 64
    sampling: Sampling | None = None   # T > 0: the expected acceptance along the reference
    target_logits: torch.Tensor | None = None   # [T-1, V] teacher-forced target logits (T > 0)
    matched: bool = False              # T > 0 under SpecForge's rules: α_k = p_k(greedy draft)
    cut_last_blocks: bool = True       # False: full blocks everywhere (the training view, remote.parity)
    tokens: dict = field(default_factory=dict)   # anchor -> draft target ids
    top: dict = field(default_factory=dict)      # anchor -> DDTree children (remote.decode.tree)
    alpha: dict = field(default_factory=dict)    # anchor -> [α_k] (T > 0)
    confidence: dict = field(default_factory=dict)   # anchor -> each draft's predicted acceptance (DSpark)
    blocks_drafted: int = 0
    ctx_kv: list | None = None         # context K/V of every position, computed once (first chunk)

    def num_drafts(self, anchor: int) -> int:
        """Drafts the cycle at ``anchor`` verifies (fewer near the end, as z-lab's last block)."""
        n = self.drafter.config.num_drafts
        return min(n, self.ids.numel() - anchor - 1) if self.cut_last_blocks else n

    def __getitem__(self, anchor: int) -> list[int]:
        if anchor not in self.tokens:
            self.compute(range(anchor, min(anchor + self.chunk, self.ids.numel() - 1)))
        return self.tokens[anchor]

    @torch.no_grad()
    def compute(self, anchors) -> None:
        todo = [a for a in anchors if a not in self.tokens]
        full = [a for a in todo if self.num_drafts(a) == self.drafter.config.num_drafts]
        for i in range(0, len(full), self.chunk):
            self._batched(full[i:i + self.chunk])
        for a in todo:
            if a not in full:
                self._single(a)

    def _noise(self, anchor_tokens: torch.Tensor, n_slots: int) -> torch.Tensor:
        blocks = block_input_ids(anchor_tokens, n_slots, self.drafter.config.mask_token_id)
        return self.drafter.embed(blocks, self.embed_weight).to(self.target_hidden.dtype)

    def _batched(self, anchors: list[int]) -> None:
        """Full blocks, all anchors in one forward through the anchor-block mask."""
        idx = torch.tensor(anchors, dtype=torch.long, device=self.ids.device)
        d, B, T = self.drafter, self.drafter.block_size, max(anchors) + 1
        hidden = d.forward_anchors(self.target_hidden[:, :T], self._noise(self.ids[idx], B)[None], idx[None],
                                   ctx_kv=[(k[:, :, :T], v[:, :, :T]) for k, v in self._context_kv()])
        self._store(anchors, self.drafter.draft_slots(hidden.view(len(anchors), B, -1)))

    def _context_kv(self) -> list:
        """K/V of the fused context at every position: they do not depend on the anchor, so one
        projection serves every chunk (rather than re-projecting ``[:p]`` for every anchor)."""
        if self.ctx_kv is None:
            d, th = self.drafter, self.target_hidden
            positions = torch.arange(th.shape[1], device=th.device)[None]
            self.ctx_kv = d.context_kv(th, d.rope(positions, th.dtype))
        return self.ctx_kv

    def _single(self, anchor: int) -> None:
        """A cut last block: one anchor, context ``[:anchor]``."""
        n = self.num_drafts(anchor)
        slots = n + (0 if self.drafter.config.sample_from_anchor else 1)
        past = [(k[:, :, :anchor], v[:, :, :anchor]) for k, v in self._context_kv()]
        hidden, _ = self.drafter.draft(self._noise(self.ids[anchor:anchor + 1], slots)[None], anchor,
                                       self.target_hidden[:, anchor:anchor], past)
        self._store([anchor], self.drafter.draft_slots(hidden))

    def _store(self, anchors: list[int], hidden: torch.Tensor) -> None:
        """``hidden [n, drafts, H]`` of the anchors' draft slots -> tokens, DDTree data, α."""
        d = self.drafter
        anchor_tokens = self.ids[torch.tensor(anchors, device=self.ids.device)]
        proposal = d.propose(hidden, anchor_tokens, self.head, embed_weight=self.embed_weight)
        drafts = proposal.tokens.tolist()
        if proposal.confidence is not None:
            self.confidence.update(zip(anchors, proposal.confidence.tolist()))
        if self.sampling is not None or self.topk:
            logits = d.logits(hidden, self.head).float()
        self.tokens.update(zip(anchors, drafts))
        if self.topk:
            self.top.update(zip(anchors, block_children(d, hidden, logits, anchor_tokens, self.topk)))
        if self.sampling is not None:
            for j, a in enumerate(anchors):
                self.alpha[a] = self._alpha(a, hidden[j:j + 1], logits[j:j + 1])
        self.blocks_drafted += len(anchors)

    def _alpha(self, anchor: int, hidden, logits) -> list[float]:
        """α_k for the anchor's drafts: Σ_x min(p_k(x), q_k(x)), or p_k(d_k) with ``matched`` (module
        docstring)."""
        d, n = self.drafter, hidden.shape[1]
        p = self.sampling.probs(self.target_logits[anchor:anchor + n])                 # [n, V]
        if self.matched:
            drafts = torch.tensor(self.tokens[anchor], device=p.device)
            return p.gather(-1, drafts[:, None])[:, 0].tolist()
        if d.config.architecture == DFLASH2:    # teacher-forced predecessors: the reference tokens
            sel = d.candidate_selector
            unary, cand = sel.candidates(logits)
            proj = sel.hidden_projection(hidden)
            alphas = []
            for k in range(n):
                scores = sel.scores(unary[:, k], cand[:, k], proj[:, k], self.ids[anchor + k][None])
                q = Sampling(self.sampling.temperature).probs(scores)[0]
                alphas.append(float(torch.minimum(p[k, cand[0, k]], q).sum()))
            return alphas
        if d.config.sequential:        # the reference's tokens before each draft
            prev = self.ids[anchor:anchor + n][None]
            logits = d.teacher_forced_logits(hidden, prev, self.head, self.embed_weight).float()
        q = d.to_target_probs(self.sampling.probs(logits))[0]
        return torch.minimum(p, q).sum(-1).tolist()

    def children(self, anchor: int) -> Callable:
        """DDTree children of a node at ``anchor``: ``children(prefix) -> (log-probs desc, tokens)``."""
        self[anchor]
        return self.top[anchor]


def greedy_walk(drafts, ref: list[int], prompt_len: int, verify_block: int, max_blocks: int | None = None,
                accept=None, rules: "SpecForgeRules | None" = None) -> list[int]:
    """Acceptance lengths of the walk over ``ref`` (prompt + completion). ``accept(start, n)``
    returns the accepted draft count at ``start`` (at most ``n``); default: longest matching prefix
    of ``drafts[start]``. ``rules``: SpecForge's (module docstring), ``ref`` then runs on past the
    output by the continuation."""
    if accept is None:
        def accept(start, n):
            d, a = drafts[start], 0
            while a < n and d[a] == ref[start + 1 + a]:
                a += 1
            return a
    if rules is not None:
        return rules.walk(ref, prompt_len, verify_block, accept, max_blocks)
    max_length, start = len(ref), prompt_len
    lengths: list[int] = []
    while start + 1 < max_length and (max_blocks is None or len(lengths) < max_blocks):
        verify_size = min(verify_block, max_length - start)
        a = accept(start, verify_size - 1)
        produced = min(a + 1, max_length - start - 1)
        lengths.append(produced)
        start += produced
    return lengths


@dataclass(frozen=True)
class SpecForgeRules:
    """SpecForge's cycle rules for a walk: ``max_length = prompt + max_new_tokens``; ``stop`` tokens."""
    max_new_tokens: int
    stop: frozenset = frozenset()

    def walk(self, ref: list[int], prompt_len: int, verify_block: int, accept, max_blocks: int | None) -> list[int]:
        max_length, start, lengths = prompt_len + self.max_new_tokens, prompt_len, []
        while start < max_length and (max_blocks is None or len(lengths) < max_blocks):
            if start + verify_block > len(ref):
                raise ValueError(f"SpecForge's rules need the reference {start + verify_block - len(ref)} token(s) "
                                 f"further (a continuation past the output)")
            a = accept(start, verify_block - 1)
            lengths.append(a + 1)
            start += a + 1
            if any(t in self.stop for t in ref[prompt_len:start + 1]):
                break
        return lengths


def ddtree_walk(table: DraftTable, ref: list[int], prompt_len: int, verify_block: int, budget: int,
                max_blocks: int | None = None, rules: SpecForgeRules | None = None) -> list[int]:
    def accept(start, n):
        return min(n, ddtree_depth(table.children(start), n, ref[start + 1:start + 1 + n], budget))
    return greedy_walk(None, ref, prompt_len, verify_block, max_blocks, accept, rules)


def walk_confidences(table: "DraftTable", ref: list[int], prompt_len: int, lengths: list[int]) -> list[list[float]]:
    """Each cycle's drafts' predicted acceptance (a confidence head), the cycles as the walk took them,
    as a run records them (:func:`remote.decode.online.labelled_confidences`)."""
    out, start = [], prompt_len
    for n in lengths:
        drafts = table[start]
        accepted = next((k for k, t in enumerate(drafts) if start + 1 + k >= len(ref) or t != ref[start + 1 + k]),
                        len(drafts))
        out.append(labelled_confidences(table.confidence[start], n, accepted))
        start += n
    return out


def all_anchor_hits(table: DraftTable, ref: list[int], prompt_len: int) -> dict:
    """Teacher-forced per-draft hits with every completion position an anchor."""
    n = table.drafter.config.num_drafts
    correct, count = [0] * n, [0] * n
    table.compute(range(prompt_len, len(ref) - 1))
    for p in range(prompt_len, len(ref) - 1):
        for k, token in enumerate(table[p]):
            count[k] += 1
            correct[k] += int(token == ref[p + 1 + k])
    return {"correct": correct, "count": count}


def expected_acceptance(table: DraftTable, ref: list[int], prompt_len: int) -> dict:
    """T > 0: Σ α_k and counts per draft slot, Σ Π_{j≤k} α_j per draft slot (``reach_sum``: an
    anchor whose cut block has no draft k adds nothing) and Σ E[τ] over the completion's anchors (an
    estimate, module docstring; remote/contract/metrics.py ``expected_summary``)."""
    n = table.drafter.config.num_drafts
    alpha_sum, reach_sum, count, tau_sum = [0.0] * n, [0.0] * n, [0] * n, 0.0
    table.compute(range(prompt_len, len(ref) - 1))
    for p in range(prompt_len, len(ref) - 1):
        run, tau = 1.0, 1.0
        for k, a in enumerate(table.alpha[p]):
            alpha_sum[k] += a
            count[k] += 1
            run *= a
            reach_sum[k] += run
            tau += run
        tau_sum += tau
    anchors = max(0, len(ref) - 1 - prompt_len)
    return {"alpha_sum": alpha_sum, "reach_sum": reach_sum, "count": count, "tau_sum": tau_sum, "anchors": anchors,
            "expected_tau": tau_sum / anchors if anchors else None}


def evaluate_offline(drafter, target, prompt_ids: list[int], output_ids: list[int], *, max_blocks=None,
                     budgets=DEFAULT_BUDGETS, all_anchors: bool = False, chunk: int = 64,
                     sampling: Sampling | None = None, rules: SpecForgeRules | None = None,
                     continuation: list[int] = ()) -> dict:
    """One target forward over prompt + reference, then the greedy walk, DDTree walks and
    optionally the all-anchors hits; at T > 0 the expected acceptance instead. Returns the
    per-turn fields of a results row. ``rules``: SpecForge's, with the reference's ``continuation``
    (the target's greedy tokens after ``output_ids``, module docstring)."""
    from remote.target.model import target_features

    sampled = sampling is not None and not sampling.greedy
    if sampled and budgets:
        raise ValueError("DDTree budgets at T > 0: a sampled tree is verified by the target's own sampling "
                         "at every node, which needs online decoding; offline at T > 0 reports the expected "
                         "acceptance only")
    refusal = tree_refusal(drafter.config.family, drafter.config.sequential)
    if budgets and refusal:
        raise ValueError(refusal)
    device = next(target.parameters()).device
    ref = list(prompt_ids) + list(output_ids) + list(continuation)
    ids = torch.tensor(ref, dtype=torch.long, device=device)
    out, target_hidden = target_features(target, ids[None, :-1] if len(ref) > 1 else ids[None],
                                         drafter.config.target_layer_ids)
    here = drafter.device  # a target split over GPUs: the captured features' device (worker.py)
    table = DraftTable(drafter, target_hidden.to(device=here, dtype=next(drafter.parameters()).dtype), ids.to(here),
                       target.get_input_embeddings().weight, target.get_output_embeddings(),
                       topk=max(budgets) if budgets else 0, chunk=chunk, sampling=sampling if sampled else None,
                       target_logits=out.logits[0].to(here) if sampled else None, cut_last_blocks=rules is None or sampled,
                       matched=sampled and rules is not None)
    P, verify_block = len(prompt_ids), drafter.config.verify_block
    if sampled:
        res = {"acceptance_lengths": [], "expected": expected_acceptance(table, ref, P)}
    else:
        res = {"acceptance_lengths": greedy_walk(table, ref, P, verify_block, max_blocks, rules=rules)}
        if budgets:
            res["ddtree"] = {str(n): {"acceptance_lengths": ddtree_walk(table, ref, P, verify_block, n, max_blocks,
                                                                        rules)}
                             for n in budgets}
        if table.confidence:
            res["confidences"] = walk_confidences(table, ref, P, res["acceptance_lengths"])
    if all_anchors:
        res["all_anchors"] = all_anchor_hits(table, ref, P)
    res["blocks_drafted"] = table.blocks_drafted
    return res
