"""Offline walk: batched drafts equal per-anchor drafts, the walk rule, DDTree, metrics."""
import pytest
import torch

from remote.contract.metrics import per_position_acceptance, summarize, tau_summary
from remote.decode.offline import DraftTable, ddtree_depth, evaluate_offline, greedy_walk, slot_children
from remote.target.model import target_features
from models import held_out_drafter, walk_sequences, walk_target


@pytest.fixture(scope="module")
def trained():
    return walk_target("qwen3"), held_out_drafter("qwen3", steps=400)[0]


def test_walk_rule_on_hand_made_drafts():
    # prompt of 2, completion of 10 tokens: positions 2..11; B = 4
    ref = [9, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    drafts = {2: [2, 3, 0], 5: [5, 6, 7], 9: [9, 10, 11], 11: [0, 0, 0]}
    # start=2: drafts 2,3 match ref[3],ref[4] -> a=2, produced 3 -> start 5
    # start=5: 5,6,7 == ref[6..8]  -> a=3 (full block), produced 4 -> start 9
    # start=9: verify_size=min(4, 12-9)=3 -> at most 2 accepted; 9,10 match -> produced min(3, 12-9-1=2) = 2
    assert greedy_walk(drafts, ref, 2, 4) == [3, 4, 2]
    assert greedy_walk(drafts, ref, 2, 4, max_blocks=2) == [3, 4]
    assert sum(greedy_walk(drafts, ref, 2, 4)) == len(ref) - 2 - 1   # every token after the first


def test_ddtree_best_first_tree():
    logp = torch.log(torch.tensor([[0.9, 0.05], [0.9, 0.05], [0.9, 0.05]]))
    idx = torch.tensor([[10, 11], [20, 21], [30, 31]])
    kids = slot_children(logp, idx)
    assert ddtree_depth(kids, 3, [10, 20, 30], budget=3) == 3        # the top-1 chain
    assert ddtree_depth(kids, 3, [11, 20, 30], budget=3) == 0        # rank-1 root child not grown yet
    assert ddtree_depth(kids, 3, [11, 20, 30], budget=4) == 1        # 4th node: sibling 11 (score log .05)
    assert ddtree_depth(kids, 3, [10, 21, 30], budget=4) == 1
    assert ddtree_depth(kids, 3, [10, 21, 30], budget=5) == 2
    assert ddtree_depth(kids, 2, [10, 20, 30], budget=5) == 2        # a cut last block: depth <= its drafts


def test_ddtree_children_may_depend_on_the_path():
    """DFlash2's tree: a node's children follow from its own token (here: the child ids are the
    parent's id + 1 or + 2, with the first more likely), so the tree grows a chain per token."""
    def kids(prefix):
        last = prefix[-1] if prefix else 0
        return [-0.1, -2.5], [last + 1, last + 2]
    assert ddtree_depth(kids, 3, [1, 2, 3], budget=3) == 3
    assert ddtree_depth(kids, 3, [2, 3, 4], budget=3) == 0
    assert ddtree_depth(kids, 3, [2, 3, 4], budget=6) == 2       # 2 (-2.5), then 2-3 (-2.6)


@pytest.mark.models
@torch.no_grad()
def test_batched_drafts_equal_per_anchor_drafts_along_a_reference(trained):
    target, drafter = trained
    seq = walk_sequences(target, 1, new_tokens=30, seed=7)[0]
    ids = seq[0]
    _, th = target_features(target, seq[:, :-1], drafter.config.target_layer_ids)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    table = DraftTable(drafter, th, ids, embed.weight, head, chunk=7)
    from remote.drafters.dflash import block_input_ids
    for p in range(6, ids.numel() - 1):
        n = min(drafter.block_size, ids.numel() - p)      # the last blocks are cut to what is verified
        noise = embed(block_input_ids(ids[p:p + 1], n, drafter.config.mask_token_id))[None]
        single = head(drafter.draft(noise, p, th[:, :p])[0][:, 1:]).argmax(-1)[0].tolist()
        assert table[p] == single, p


@pytest.mark.models
def test_offline_eval_of_trained_drafter(trained):
    target, drafter = trained
    seq = walk_sequences(target, 1, new_tokens=40, seed=5)[0][0].tolist()
    out = evaluate_offline(drafter, target, seq[:6], seq[6:], budgets=(8, 32), all_anchors=True)
    lengths = out["acceptance_lengths"]
    assert sum(lengths) == 40 - 1 and max(lengths) <= drafter.block_size
    assert sum(lengths) / len(lengths) > 2.0
    for b in ("8", "32"):
        assert sum(out["ddtree"][b]["acceptance_lengths"]) == 39
    hits = out["all_anchors"]
    assert hits["count"][0] == 39 and 0 < hits["correct"][0] <= 39
    capped = evaluate_offline(drafter, target, seq[:6], seq[6:], budgets=(), max_blocks=2)
    assert capped["acceptance_lengths"] == lengths[:2] and "ddtree" not in capped


def test_metrics_definitions():
    rows = [{"id": "a", "acceptance_lengths": [1, 3], "output_ids": [0] * 5},
            {"id": "b", "acceptance_lengths": [4, 4, 4, 1], "output_ids": [0] * 14}]
    t = tau_summary([r["acceptance_lengths"] for r in rows])
    assert t["tau_macro"] == pytest.approx((2.0 + 3.25) / 2) and t["tau_pooled"] == pytest.approx(17 / 6)
    acc = per_position_acceptance([r["acceptance_lengths"] for r in rows], 4)
    assert acc == pytest.approx([4 / 6, 4 / 6, 3 / 6])
    assert 1 + sum(acc) == pytest.approx(t["tau_pooled"])
    s = summarize(rows, 4, "offline")
    assert s["acceptance_histogram"] == {"1": 2, "2": 0, "3": 1, "4": 3}
