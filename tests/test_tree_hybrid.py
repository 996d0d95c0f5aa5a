"""DDTree online on a hybrid target (Gated DeltaNet + attention layers, Qwen3.5-style): the tree
rule of remote/target/tree_state.py gives every node of a one-forward tree verify the logits of a
sequential forward over its own path, and the cache after committing a path the state of a
sequential forward of that path; tree decoding is then lossless (T = 0: the target's greedy output,
every budget) and equals the offline DDTree-N walk cycle for cycle, under z-lab's rules and under
``--semantics ddtree``; at T > 0 its output is distributed as the target's (chi-square)."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from golden import chi_square_p, four_token_pair, prompts, sampled_outputs, tree_equals_greedy_and_offline
from models import freeze, trained_drafter, walk_target
from remote.contract.settings import DDTREE as DDTREE_RULES
from remote.decode.offline import SpecForgeRules, evaluate_offline
from remote.decode.online import target_decode
from remote.drafters.sampling import Sampling
from remote.decode.tree import Tree, tree_generate, tree_mask, tree_problem
from remote.drafters.tiny import tiny_target
from remote.target.cache import forward, is_linear, keep_attention_path, new_cache
from remote.target.tree_state import TreeLinearAttention, linear_attention_modules

pytestmark = pytest.mark.models

BUDGETS = (1, 4, 8, 16)
N = 40              # max_new_tokens: not a multiple of the block (8), so the last cycles are cut


def random_tree(n: int, vocab: int, seed: int) -> Tree:
    """A tree of ``n`` nodes besides the root, each under a random earlier node (bushy and deep)."""
    rng, tree = random.Random(seed), Tree()
    tree.tokens[0] = rng.randrange(vocab)
    while len(tree) <= n:
        parent, token = rng.randrange(len(tree)), rng.randrange(vocab)
        if token not in tree.children[parent]:
            tree.add(parent, token)
    return tree


def path_to(tree: Tree, node: int) -> list[int]:
    path = [node]
    while tree.parents[path[-1]] >= 0:
        path.append(tree.parents[path[-1]])
    return path[::-1]


def sequential(target, prompt, tokens: list[int]):
    """The prompt prefilled, then ``tokens`` one forward each: ``(cache, logits after each token)``."""
    cache = new_cache(target)
    forward(target, prompt, cache)
    rows = [forward(target, torch.tensor([[t]]), cache).logits[0, -1] for t in tokens]
    return cache, torch.stack(rows)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-4)])
@torch.inference_mode()
def test_tree_verify_equals_a_sequential_forward_of_every_path(dtype, tol):
    """A random tree of 24 nodes after a 6-token prompt, verified in one forward: every node's logits
    equal a sequential forward of prompt + its path (float64: to rounding, so the rule is exact;
    float32: within 2e-4 of logits of size ~6); without the rule they differ by whole units. Then,
    committing a path that is not the tree's first nodes leaves every layer (conv and recurrent
    state, token counter, attention K/V) as the sequential forward of that path does, and the next
    token's logits agree."""
    target = freeze(tiny_target("qwen3_5", init_std=0.2, seed=1)).to(dtype)
    vocab = target.config.vocab_size
    prompt = torch.randint(0, vocab, (1, 6), generator=torch.Generator().manual_seed(0))
    tree = random_tree(24, vocab, seed=0)
    start = prompt.shape[1]
    ids = torch.tensor([tree.tokens])
    positions = torch.tensor([tree.depths]) + start
    mask = tree_mask(tree, start, dtype, "cpu")

    plain = new_cache(target)
    forward(target, prompt, plain)
    unruled = forward(target, ids, plain, position_ids=positions, attention_mask=mask).logits[0]

    cache = new_cache(target)
    forward(target, prompt, cache)
    with TreeLinearAttention(target, tree.parents) as linear:
        logits = forward(target, ids, cache, position_ids=positions, attention_mask=mask).logits[0]
    assert all("forward" not in vars(m) for _, m in linear_attention_modules(target))    # removed on exit
    assert max(tree.depths) >= 4 and max(len(c) for c in tree.children) >= 3
    worst = unruled_worst = 0.0
    for node in range(len(tree)):
        _, want = sequential(target, prompt, [tree.tokens[i] for i in path_to(tree, node)])
        worst = max(worst, float((logits[node] - want[-1]).abs().max()))
        unruled_worst = max(unruled_worst, float((unruled[node] - want[-1]).abs().max()))
    assert worst <= tol, worst
    assert unruled_worst > 1.0, unruled_worst

    deepest = max(range(len(tree)), key=lambda i: (tree.depths[i], i))
    path = path_to(tree, deepest)
    assert path != list(range(len(path)))                   # the path's nodes are not the first ones
    keep_attention_path(cache, start, path)
    linear.commit(cache, path)
    want_cache, _ = sequential(target, prompt, [tree.tokens[i] for i in path])
    assert cache.get_seq_length() == want_cache.get_seq_length() == start + len(path)
    for got, want in zip(cache.layers, want_cache.layers):
        if is_linear(got):
            pairs = [(got.conv_states[0], want.conv_states[0]), (got.recurrent_states[0], want.recurrent_states[0])]
            assert int(got.cumulative_length_linear) == int(want.cumulative_length_linear)
        else:
            pairs = [(got.keys, want.keys), (got.values, want.values)]
        for a, b in pairs:
            assert a.shape == b.shape and float((a - b).abs().max()) <= tol
    nxt = torch.tensor([[5]])
    assert float((forward(target, nxt, cache).logits - forward(target, nxt, want_cache).logits).abs().max()) <= tol


# the walk target as trained, and a twin whose Gated DeltaNet outputs are scaled up 12x: the walk
# language barely needs the linear layers (decoding the walk target with a linear state that is
# never advanced past the prompt still gives its greedy output), the twin's argmax depends on them
# (a stale linear state leaves its greedy output on every prompt here) and its drafts are still
# accepted (tau 2.2 to 2.6 at a budget of 8)
GDN_SCALES = (1.0, 12.0)


@pytest.fixture(scope="module", params=GDN_SCALES, ids=lambda s: f"gdn-x{s:g}")
def pair(request):
    """A hybrid walk target (Gated DeltaNet ``out_proj`` scaled by the param), the drafter trained
    on the walk target, three held-out prompts (the second with a stop token inside its output) and
    their stop tokens."""
    target, drafter = copy.deepcopy(walk_target("qwen3_5")), trained_drafter("qwen3_5")
    with torch.no_grad():
        for _, mixer in linear_attention_modules(target):
            mixer.out_proj.weight.mul_(request.param)
    ps = prompts(target, 3)
    stops = [None, [target_decode(target, ps[1], N).output_ids[21]], None]
    return target, drafter, ps, stops


def test_tree_decoding_is_lossless_and_equals_offline_ddtree(pair):
    """T = 0, z-lab's rules: for budgets 1, 4, 8 and 16, the output is the target's greedy output token
    for token and the acceptance lengths are the offline DDTree-N walk's, cycle for cycle; the trees
    are real (partial, deep and branch accepts: a bigger budget takes fewer cycles)."""
    target, drafter, ps, stops = pair
    cycles = tree_equals_greedy_and_offline(target, drafter, ps, stops, N, BUDGETS)
    assert cycles[1] > cycles[4] > cycles[16], cycles              # a bigger tree takes fewer cycles


def test_tree_decoding_equals_offline_ddtree_under_ddtree_rules(pair):
    """``--semantics ddtree`` (full blocks, whole runs counted, the output cut afterwards): the same
    output as the target's greedy decoding and the offline walk's acceptance lengths."""
    target, drafter, ps, stops = pair
    block = drafter.config.verify_block
    for prompt, stop in zip(ps, stops):
        greedy = target_decode(target, prompt, N, stop, overshoot=block)
        offline = evaluate_offline(drafter, target, prompt[0].tolist(), greedy.output_ids, budgets=BUDGETS[1:],
                                   rules=SpecForgeRules(N, frozenset(stop or ())), continuation=greedy.continuation)
        for b in BUDGETS[1:]:
            online = tree_generate(target, drafter, prompt, N, b, stop, semantics=DDTREE_RULES)
            assert online.output_ids == greedy.output_ids, b
            assert online.acceptance_lengths == offline["ddtree"][str(b)]["acceptance_lengths"], b


def test_a_linear_layer_without_a_tree_rule_is_refused():
    """Qwen3.5's Gated DeltaNet is tree-decoded; a linear-attention layer of another class is
    refused in one line, before anything is decoded."""
    target, drafter = walk_target("qwen3_5"), trained_drafter("qwen3_5")
    ps = prompts(target, 1)
    assert tree_problem(target, drafter.config) is None
    other = freeze(tiny_target("qwen3_5"))
    _, mixer = linear_attention_modules(other)[0]
    mixer.__class__ = type("OtherGatedDeltaNet", (type(mixer),), {})
    problem = tree_problem(other, drafter.config)
    assert problem and "OtherGatedDeltaNet" in problem and "no exact tree rule" in problem and "\n" not in problem
    with pytest.raises(NotImplementedError, match="no exact tree rule"):
        tree_generate(other, drafter, ps[0], 8, 4)


def test_sampled_tree_decoding_on_a_hybrid_target_is_distributed_as_the_target(tmp_path, monkeypatch):
    """Lossless at T > 0 on a hybrid target: on a 4-token vocabulary the joint law of the first three
    tokens (the prefill's, then one tree cycle of a random drafter: 4 nodes over 2 levels, verified
    with the Gated DeltaNet tree rule) equals the target's own (exact, by enumeration); chi-square
    p > 0.001 over 500 seeded runs. The same test rejects the tree verified without the rule (the
    linear layers run through the flattened tree, each node after its neighbours; p < 1e-6)."""
    from remote.decode import tree as tree_module

    target, ours, prompt, exact = four_token_pair(tmp_path, "qwen3_5")
    assert linear_attention_modules(target)

    def draw(n):
        return sampled_outputs(lambda: tree_generate(target, ours, prompt, 3, 4, None, Sampling(1.0)).output_ids, n)

    assert chi_square_p(draw(500), exact, 500) > 1e-3

    class Flattened(TreeLinearAttention):
        def __enter__(self):
            return self

        def commit(self, cache, path):
            pass

    monkeypatch.setattr(tree_module, "TreeLinearAttention", Flattened)
    assert chi_square_p(draw(100), exact, 100) < 1e-6
