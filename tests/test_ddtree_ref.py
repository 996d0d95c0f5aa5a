"""DDTree against its official code: ``ddtree_generate`` (github liranringel/ddtree, MIT, kept
unchanged beside the repository: tests/references.py ``DDTREE``), run on CPU with its own drafter
class reading our z-lab-format drafter folder. Online tree decoding (remote/decode/tree.py) and the
offline DDTree-N walk equal it cycle for cycle under ``--semantics ddtree``; under z-lab's rules
online equals offline; tree decoding is lossless (greedy: the target's own output; sampled: the
target's distribution, by a chi-square test); what cannot be tree-decoded is refused in one line.

The pair is the tests' walk target (a tiny pure-attention Qwen3 taught a structured language) and
its trained drafter: real trees, with partial and deep accepts.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from golden import (chi_square_p, four_token_pair, prompts, reference_from, sampled_outputs,
                    tree_equals_greedy_and_offline)
from models import freeze, trained_drafter, walk_target
from references import DDTREE, ddtree_drafter, ddtree_generate
from remote.contract.settings import DDTREE as DDTREE_RULES, EvalSettings, SettingsError
from remote.decode.offline import SpecForgeRules, evaluate_offline
from remote.decode.online import target_decode
from remote.decode.tree import build_tree, slot_children, tree_generate, tree_problem
from remote.drafters.checkpoint import load_drafter
from remote.drafters.sampling import Sampling
from remote.drafters.tiny import tiny_target

pytestmark = [pytest.mark.skipif(not (DDTREE / "ddtree.py").is_file(), reason=f"DDTree's code is not in {DDTREE}"),
              pytest.mark.models]

BUDGETS = (4, 8, 16)
N = 40              # max_new_tokens: not a multiple of the block (8), so the last cycles differ by rules


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(target, ours, theirs, prompts, stops)``: the walk pair, our drafter and DDTree's class
    loaded from one z-lab folder; three prompts, the second with a stop token inside its output."""
    target, trained = walk_target("qwen3"), trained_drafter("qwen3")
    folder = tmp_path_factory.mktemp("ddtree-drafter")
    reference_from(trained, folder, target)
    ours, _ = load_drafter(folder)
    ps = prompts(target, 3)
    stops = [None, [target_decode(target, ps[1], N).output_ids[21]], None]
    return target, freeze(ours), ddtree_drafter(folder), ps, stops


def buffered_cycles(lengths: list[int], budget: int, block: int) -> int:
    """How many of ``ddtree_generate``'s cycles drafted a whole block: its output buffer ends
    ``N + 1 + budget`` positions past the prompt, and a block reaching past it is cut there (with a
    budget below ``block - 1``, in the last cycles), its drafts then read from the anchor's slot on
    (``draft_logits[:, -(block - 1):]`` of a shorter block): a difference of the reference, not a rule."""
    start, k = 0, 0
    while k < len(lengths) and start + block <= N + 1 + budget:
        start, k = start + lengths[k], k + 1
    return k


def test_online_and_offline_ddtree_equal_ddtree_generate(pair):
    """Under ``--semantics ddtree``: tokens and acceptance lengths of ``ddtree_generate`` for budgets
    4, 8 and 16, cycle for cycle, from online tree decoding and from the offline walk (its reference
    the target's greedy output and a block of greedy continuation past it); budget 4 on the cycles
    whose block fits the reference's buffer (:func:`buffered_cycles`), which differ after them."""
    target, ours, theirs, ps, stops = pair
    block, lengths, cut = ours.config.verify_block, [], 0
    for prompt, stop in zip(ps, stops):
        greedy = target_decode(target, prompt, N, stop, overshoot=block)
        offline = evaluate_offline(ours, target, prompt[0].tolist(), greedy.output_ids, budgets=BUDGETS,
                                   rules=SpecForgeRules(N, frozenset(stop or ())), continuation=greedy.continuation)
        for b in BUDGETS:
            want_tokens, want_lengths = ddtree_generate(theirs, target, prompt, N, b, stop)
            online = tree_generate(target, ours, prompt, N, b, stop, semantics=DDTREE_RULES)
            assert online.output_ids == want_tokens == greedy.output_ids, b
            assert online.acceptance_lengths == offline["ddtree"][str(b)]["acceptance_lengths"], b
            k = buffered_cycles(want_lengths, b, block)
            assert online.acceptance_lengths[:k] == want_lengths[:k], b
            assert k == len(want_lengths) or b < block - 1, b
            cut += k < len(want_lengths)
            lengths.append(want_lengths)
    assert cut                                                          # the reference's cut blocks were met
    flat = [a for ls in lengths for a in ls]
    assert any(1 < a < 5 for a in flat) and max(flat) >= 5, flat          # shallow and deep accepts
    assert sum(map(len, lengths[0::3])) > sum(map(len, lengths[2::3]))  # a budget of 16 takes fewer cycles than 4


def test_online_ddtree_equals_offline_under_zlab_rules(pair):
    """Under z-lab's rules (cut last blocks, a stop ends its cycle): online tree decoding equals the
    offline DDTree-N walk cycle for cycle, and its output is the target's greedy output."""
    target, ours, _, ps, stops = pair
    tree_equals_greedy_and_offline(target, ours, ps, stops, N, BUDGETS)


def test_sampled_tree_decoding_equals_ddtree_generate_seed_for_seed(pair):
    """At T = 0.7 the same seed draws the same numbers in the same order: the same tokens and
    acceptance lengths as ``ddtree_generate``."""
    target, ours, theirs, ps, _ = pair
    for seed, prompt in enumerate(ps[:2]):
        torch.manual_seed(seed)
        want = ddtree_generate(theirs, target, prompt, 24, 8, None, 0.7)
        torch.manual_seed(seed)
        got = tree_generate(target, ours, prompt, 24, 8, None, Sampling(0.7), DDTREE_RULES)
        assert (got.output_ids, got.acceptance_lengths) == want, seed


@torch.no_grad()
def test_sampled_tree_decoding_is_distributed_as_the_target(tmp_path, monkeypatch):
    """Lossless at T > 0: on a 4-token vocabulary the joint law of the first three tokens (the
    prefill's, then one tree cycle of a random drafter: 4 nodes over 2 levels) equals the target's
    own (exact, by enumeration); chi-square p > 0.001 over 600 seeded runs. The same test rejects a
    walk that follows the target's greedy choice instead of its sample (p < 1e-6)."""
    from remote.decode import tree as tree_module

    target, ours, prompt, exact = four_token_pair(tmp_path)

    def draw(n):
        return sampled_outputs(lambda: tree_generate(target, ours, prompt, 3, 4, None, Sampling(1.0)).output_ids, n)

    assert chi_square_p(draw(600), exact, 600) > 1e-3
    monkeypatch.setattr(tree_module, "sample", lambda probs: probs.argmax(-1))
    assert chi_square_p(draw(200), exact, 200) < 1e-6


def test_tree_is_best_first_with_the_references_order():
    """Nodes by summed log-prob, a parent before its children, equal scores in the order of their
    ranks; the visibility is each node's ancestors and itself."""
    logp = torch.tensor([[-0.1, -1.0, -3.0], [-0.2, -0.5, -4.0]])
    idx = torch.tensor([[10, 11, 12], [20, 21, 22]])
    tree = build_tree(slot_children(logp, idx), 2, 4)
    assert tree.tokens[1:] == [10, 20, 21, 11] and tree.parents == [-1, 0, 1, 1, 0] and tree.depths == [0, 1, 2, 2, 1]
    assert tree.visibility().int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 0, 1, 0],
                                                [1, 0, 0, 0, 1]]
    assert tree.descend({0: 10, 1: 21, 3: 7}.get) == ([0, 1, 3], 7)


def test_what_cannot_be_tree_decoded_is_refused_in_one_line(pair):
    target, ours, *_ = pair
    hybrid = freeze(tiny_target("qwen3_5", init_std=0.2, seed=1))
    assert tree_problem(hybrid, ours.config) is None      # Gated DeltaNet: tests/test_tree_hybrid.py
    domino = replace(ours.config, family="domino")
    assert "DDTree on a domino drafter: its drafts depend on the token drafted before" in tree_problem(target, domino)
    for bad in ("0", "8,2048"):
        with pytest.raises(SettingsError, match=r"--ddtree: each budget must be 1\.\.1024"):
            EvalSettings(mode="online", ddtree=bad)
    with pytest.raises(SettingsError, match="--semantics ddtree samples as DDTree's ddtree_generate does"):
        EvalSettings(mode="online", ddtree="8", semantics="ddtree", temperature=0.7, top_p=0.9)
    assert EvalSettings(mode="online", ddtree="4,8", temperature=0.7).budgets() == [4, 8]
