"""DDTree: a best-first draft tree from one draft pass, and online tree decoding that verifies the
whole tree in one target forward (DDTree, arXiv 2604.12989; liranringel/ddtree ``ddtree_generate``).

**The tree** (:func:`build_tree`). The root is the token at ``start`` (the last committed token,
not yet processed by the target); a node at depth ``d`` is a candidate for the token at
``start + d``. ``children(prefix) -> (log-probs sorted descending, tokens)`` gives a node's
candidate children: for DFlash the draft slot ``d``'s top-k log-probabilities, the same under every
node (:func:`slot_children`); for DFlash2 the selector's candidates scored with the node's token as
the predecessor (:func:`selector_children`). Nodes are added best-first by the summed log-prob of
their path, up to ``budget`` nodes (the root not counted) and ``depth_max`` levels: popping a node
offers its next sibling and its first child, so the tree is prefix-closed and the nodes come in an
order where a parent precedes its children. Equal scores are ordered by the path's ranks, as the
reference orders them.

**One cycle online** (:func:`tree_generate`), batch 1, a pure-attention or hybrid target:

1. draft the block anchored at ``start`` (context: the target features of positions ``< start``)
   and grow the tree from its draft slots;
2. verify: one target forward over ``[root, nodes...]`` (tree order) at positions ``start + depth``,
   with an additive 4D mask ``[1, 1, n, start + n]`` that lets a node see the whole cache (positions
   ``< start``) and, in the tree, only itself and its ancestors; Gated DeltaNet layers (a hybrid
   target's ``linear_attention``, which take no mask) run the tree rule of
   :mod:`remote.target.tree_state` for that forward: each node's conv window and recurrent state
   are its own path's, stepped from the cache's state. So every node's logits are the target's for
   the sequence "committed tokens + the node's path", exactly as a linear verify of that path
   would give them;
3. walk: from the root, the target's choice at the current node (greedy: its argmax; T > 0: its
   own sample, all nodes drawn in one ``multinomial``) is looked up among the node's children;
   while one equals it the walk moves there. The accepted path is the root and the nodes walked;
   the target's choice at the last one is the bonus token. Every committed token is the target's
   own choice given the tokens before it, so the output is the target's greedy output (T = 0) or
   a sample of its distribution (T > 0);
4. commit the path's tokens and the bonus; the target cache keeps the K/V of the root and the
   accepted nodes only, moved to positions ``start, start + 1, ...``
   (:func:`remote.target.cache.keep_attention`), and its Gated DeltaNet layers advance over those
   nodes only (:meth:`remote.target.tree_state.TreeLinearAttention.commit`: the state after the
   last kept node, as a sequential forward of the path leaves it); the drafter's next context is
   the captured features of the same nodes (causal: a node's features depend only on its
   ancestors).

Each cycle's time is split as ``ddtree_generate`` splits it (:data:`remote.contract.metrics.TREE_STAGES`):
``draft`` (the drafter's forward and its logits), ``tree_build`` (top-k and the best-first tree),
``tree_compile`` (the verify's ids, positions, mask and Gated DeltaNet levels), ``verify`` (the
target's forward), ``commit`` (the walk, the cache, the drafter's next context).

The cycle rules are :func:`remote.decode.online.speculative_generate`'s: under z-lab's the tree is
at most ``min(verify_block, max_length - start) - 1`` deep (the block is cut as z-lab cuts its
last one) and a cycle commits ``min(accepted + 1, max_length - start - 1)`` tokens, fewer at a
stop token; under the full-block rules (``specforge``, ``ddtree``: ``ddtree_generate``'s loop)
every cycle drafts a full block ``while start < max_length``, counts its whole accepted run and
looks for a stop token after the cycle, and the output is cut afterwards.

Not done: linear-attention layers other than Qwen3.5's Gated DeltaNet (no tree rule for them) and
families whose drafts depend on the token drafted before (Domino, DSpark's Markov head):
:func:`tree_problem` names them.
"""
from __future__ import annotations

import heapq
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch

from remote.contract.families import tree_refusal
from remote.contract.metrics import TREE_STAGES
from remote.contract.settings import FULL_BLOCK_RULES
from remote.drafters.config import DFLASH2
from remote.drafters.dflash import block_input_ids
from remote.decode.online import StageClock, committed, full_block_output
from remote.drafters.sampling import GREEDY, Sampling, sample
from remote.target.cache import forward, has_linear_layers, keep_attention, keep_attention_path, new_cache
from remote.target.model import capture, features
from remote.target.tree_state import TreeLinearAttention, tree_rule_problem

# attention implementations that take a custom 4D mask (flash attention would ignore it)
MASKED_ATTENTION = ("sdpa", "eager")


# ----------------------------------------------------------------------------- the tree

@dataclass
class Tree:
    """Node 0 is the root; nodes ``1..`` in the order they were added (a parent before its children)."""
    tokens: list[int] = field(default_factory=lambda: [-1])     # the root's token is the caller's
    parents: list[int] = field(default_factory=lambda: [-1])
    depths: list[int] = field(default_factory=lambda: [0])
    children: list[dict] = field(default_factory=lambda: [{}])  # node -> {token: child node}

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int) -> int:
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.children.append({})
        self.children[parent][token] = node
        return node

    def descend(self, choice: Callable[[int], int | None]) -> tuple[list[int], int | None]:
        """From the root, follow the child equal to ``choice(node)`` while there is one. Returns the
        path (node ids, the root first) and the choice at its last node (the bonus token)."""
        path = [0]
        token = choice(0)
        while token in self.children[path[-1]]:
            path.append(self.children[path[-1]][token])
            token = choice(path[-1])
        return path, token

    def visibility(self) -> torch.Tensor:
        """``[n, n]`` bool: node ``i`` sees node ``j`` iff ``j`` is ``i`` or one of its ancestors."""
        n = len(self)
        seen = torch.zeros(n, n, dtype=torch.bool)
        for node in range(n):
            if node:
                seen[node] = seen[self.parents[node]]
            seen[node, node] = True
        return seen


def build_tree(children: Callable, depth_max: int, budget: int) -> Tree:
    """The best-first tree of at most ``budget`` nodes and ``depth_max`` levels (module docstring)."""
    tree = Tree()
    if depth_max < 1 or budget < 1:
        return tree
    paths = [()]                                    # node -> its tokens from the root (children's input)
    first = children(())
    # (-path log-prob, ranks of the path, parent node, rank among the parent's children, those children)
    heap = [(-first[0][0], (0,), 0, 0, first)]
    while heap and len(tree) - 1 < budget:
        neg, ranks, parent, rank, (logp, tokens) = heapq.heappop(heap)
        node = tree.add(parent, tokens[rank])
        paths.append(paths[parent] + (tokens[rank],))
        if rank + 1 < len(logp):                                   # the next sibling
            heapq.heappush(heap, (neg + logp[rank] - logp[rank + 1], ranks[:-1] + (rank + 1,), parent, rank + 1,
                                  (logp, tokens)))
        if tree.depths[node] < depth_max:                          # the first child
            grand = children(paths[node])
            heapq.heappush(heap, (neg - grand[0][0], ranks + (0,), node, 0, grand))
    return tree


def slot_children(logp: torch.Tensor, idx: torch.Tensor) -> Callable:
    """DFlash's children: slot ``len(prefix)``'s top-k (``logp/idx [drafts, k]``, sorted), whatever
    the prefix."""
    lp, ix = logp.tolist(), idx.tolist()
    return lambda prefix: (lp[len(prefix)], ix[len(prefix)])


def selector_children(selector, unary, candidates, projected, anchor_token: int) -> Callable:
    """DFlash2's children: slot ``len(prefix)``'s candidates scored by the selector with the node's
    token (the anchor's for the root) as the predecessor, sorted (one block: ``unary [drafts, k]``,
    ``candidates [drafts, k]``, ``projected [drafts, r]``)."""
    def children(prefix: tuple) -> tuple[list, list]:
        depth = len(prefix)
        prev = torch.tensor([prefix[-1] if prefix else anchor_token], device=candidates.device)
        with torch.no_grad():
            logp = selector.scores(unary[None, depth], candidates[None, depth], projected[None, depth],
                                   prev)[0].float().log_softmax(-1)
        logp, order = logp.sort(descending=True)
        return logp.tolist(), candidates[depth][order].tolist()
    return children


def block_children(drafter, hidden: torch.Tensor, logits: torch.Tensor, anchor_tokens: torch.Tensor,
                   topk: int) -> list[Callable]:
    """Each block's children from its draft slots' ``hidden [n, drafts, H]`` and their
    ``drafter.logits`` (``anchor_tokens [n]``)."""
    logits = logits.float()
    if drafter.config.architecture == DFLASH2:
        sel = drafter.candidate_selector
        unary, cand = sel.candidates(logits)
        proj = sel.hidden_projection(hidden)
        return [selector_children(sel, unary[j], cand[j], proj[j], int(anchor_tokens[j])) for j in range(len(hidden))]
    logp, idx = logits.log_softmax(-1).topk(min(topk, logits.shape[-1]), dim=-1)
    idx = drafter.to_target_ids(idx)
    return [slot_children(logp[j].cpu(), idx[j].cpu()) for j in range(len(hidden))]


def ddtree_depth(children: Callable, depth_max: int, truth: list[int], budget: int) -> int:
    """Depth accepted by the tree of ``budget`` nodes against the target's tokens ``truth``: the
    longest prefix of ``truth`` that is a node (the tree is prefix-closed)."""
    tree = build_tree(children, depth_max, budget)
    path, _ = tree.descend(lambda node: truth[tree.depths[node]] if tree.depths[node] < len(truth) else None)
    return len(path) - 1


# ----------------------------------------------------------------------------- online

def tree_problem(target, drafter_config) -> str | None:
    """Why this pair cannot be tree-decoded here (one line), else None."""
    cache = new_cache(target)
    if has_linear_layers(cache):
        problem = tree_rule_problem(target, cache)
        if problem:
            return problem + "; offline DDTree-N works on it"
    refusal = tree_refusal(drafter_config.family, drafter_config.sequential)
    if refusal:
        return refusal
    attention = getattr(target.config, "_attn_implementation", None) or "eager"
    if attention not in MASKED_ATTENTION:
        return (f"DDTree online: the target's attention implementation {attention!r} does not take the tree's 4D "
                f"mask (load it with {' or '.join(MASKED_ATTENTION)})")
    return None


def tree_mask(tree: Tree, past: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The verify's additive mask ``[1, 1, n, past + n]``: 0 where a node may look (the ``past``
    cached positions, itself, its ancestors), the dtype's minimum elsewhere."""
    n = len(tree)
    mask = torch.zeros(1, 1, n, past + n, dtype=dtype)
    mask[0, 0, :, past:].masked_fill_(~tree.visibility(), torch.finfo(dtype).min)
    return mask.to(device)


@dataclass
class TreeResult:
    output_ids: list[int]          # completion only; greedy: equals the target's greedy completion
    acceptance_lengths: list[int]  # tokens committed per cycle, bonus included
    wall_s: float
    tree_nodes: list[int]          # nodes verified per cycle, the root included
    cycles_s: float = 0.0          # the cycles' time (wall_s less the prefill)
    stage_s: dict[str, float] = field(default_factory=dict)    # the cycles' time per stage (TREE_STAGES), summed


@torch.inference_mode()
def tree_generate(target, drafter, prompt_ids: torch.Tensor, max_new_tokens: int, budget: int,
                  stop_token_ids: list[int] | None = None, sampling: Sampling = GREEDY,
                  semantics: str = "zlab") -> TreeResult:
    """DDTree-``budget`` speculative decoding of one prompt (module docstring). Greedy output equals
    ``target_decode(...)``; sampled output is distributed as it."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    cfg = drafter.config
    problem = tree_problem(target, cfg)
    if problem:
        raise NotImplementedError(problem)
    stop = set(stop_token_ids or ())
    device = next(target.parameters()).device
    prompt_ids = prompt_ids.to(device)
    layer_ids, mask_id = cfg.target_layer_ids, cfg.mask_token_id
    embed_weight, head = target.get_input_embeddings().weight, target.get_output_embeddings()
    dtype, mask_dtype = next(drafter.parameters()).dtype, next(target.parameters()).dtype
    slot0 = 0 if cfg.sample_from_anchor else 1
    max_length = prompt_ids.shape[1] + max_new_tokens
    full = semantics in FULL_BLOCK_RULES

    with capture(target, layer_ids) as store:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        cache = new_cache(target)
        hybrid = has_linear_layers(cache)
        logits = forward(target, prompt_ids, cache, logits_to_keep=1).logits
        token = sampling.choose(logits[:, -1])                           # [1], the token at `start`
        new_context, ctx_kv = features(store, layer_ids), None
        output_ids, acceptance_lengths, tree_nodes = [int(token)], [], []
        start = prompt_ids.shape[1]
        stopped = output_ids[-1] in stop and not full
        going = (lambda: start < max_length) if full else (lambda: start + 1 < max_length)
        clock = StageClock(device, TREE_STAGES)

        while going() and not stopped:
            # draft the block anchored at `start`
            depth_max = cfg.verify_block - 1 if full else min(cfg.verify_block, max_length - start) - 1
            block = block_input_ids(token, slot0 + depth_max, mask_id)[None]
            hidden, ctx_kv = drafter.draft(drafter.embed(block, embed_weight).to(dtype), start,
                                           new_context.to(dtype), ctx_kv)
            slots = drafter.draft_slots(hidden)
            draft_logits = drafter.logits(slots, head)
            clock.lap("draft")

            # grow the tree from the draft slots
            tree = build_tree(block_children(drafter, slots, draft_logits, token, budget)[0], depth_max, budget)
            tree.tokens[0] = int(token)
            clock.lap("tree_build")

            # the verify's inputs: every node at position start + depth, seeing its ancestors only
            # (attention: the mask; Gated DeltaNet: each node's conv window and state from its own path)
            ids = torch.tensor([tree.tokens], dtype=torch.long, device=device)
            positions = torch.tensor([tree.depths], dtype=torch.long, device=device) + start
            mask = tree_mask(tree, start, mask_dtype, device)
            linear = TreeLinearAttention(target, tree.parents) if hybrid else nullcontext()
            clock.lap("tree_compile")

            # verify every node in one forward
            with linear:
                logits = forward(target, ids, cache, position_ids=positions, attention_mask=mask).logits[0]
            tree_nodes.append(len(tree))
            clock.lap("verify")

            # commit: walk the target's choices down the tree; the path and the bonus token
            choices = (logits.argmax(-1) if sampling.greedy else sample(sampling.probs(logits))).tolist()
            path, bonus = tree.descend(choices.__getitem__)
            new_tokens, stopped = committed([tree.tokens[i] for i in path[1:]], bonus, full, max_length - start - 1,
                                            stop, output_ids[0])
            produced = len(new_tokens)
            output_ids += new_tokens
            acceptance_lengths.append(produced)
            kept = path[:produced]                      # the nodes now at positions start..start+produced-1
            new_context = features(store, layer_ids)[:, kept]
            if hybrid:                                  # attention K/V of the path; linear state over it
                keep_attention_path(cache, start, kept)
                linear.commit(cache, kept)
            else:
                keep_attention(cache, start, kept)
            start += produced
            token = ids.new_tensor([new_tokens[-1]])
            clock.lap("commit")

        cycles_s = clock.elapsed()
        wall_s = time.perf_counter() - t0
    if full:        # the whole runs were counted; the output is cut as ddtree_generate cuts it
        output_ids = full_block_output(output_ids, max_new_tokens, stop)
    return TreeResult(output_ids=output_ids, acceptance_lengths=acceptance_lengths, wall_s=wall_s,
                      tree_nodes=tree_nodes, cycles_s=cycles_s, stage_s=clock.seconds)
