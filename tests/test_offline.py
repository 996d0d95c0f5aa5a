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


# ----------------------------------------------------------------------------- families at T > 0

FAMILY_HEADS = {"domino": dict(family="domino", emb_dim=16, gru_hidden_dim=16, pure_draft_prefix_len=1),
                "dspark-rnn": dict(family="dspark", markov_rank=8, markov_head_type="rnn", confidence_head=True),
                "dspark-gated": dict(family="dspark", markov_rank=8, markov_head_type="gated")}


def family_of(trained, name: str):
    """The trained DFlash drafter's backbone with a family's heads at random (std 0.5: they change drafts)."""
    from dataclasses import replace

    from remote.drafters.dflash import init_weights
    from remote.drafters.tiny import tiny_drafter

    _, base = trained
    drafter = tiny_drafter(replace(base.config, **FAMILY_HEADS[name]), seed=3)
    drafter.load_state_dict(base.state_dict(), strict=False)
    for head in ("markov_head", "embed_proj", "prefix_gru"):
        if hasattr(drafter, head):
            init_weights(getattr(drafter, head), 0.5, torch.Generator().manual_seed(4))
    return drafter.eval()


@pytest.mark.models
@pytest.mark.parametrize("name", FAMILY_HEADS)
@torch.no_grad()
def test_teacher_forced_logits_are_the_ones_drafted_from(trained, name):
    """A family's drafts, greedy and sampled, are drawn from ``teacher_forced_logits`` given the
    drafts before them: the argmax of each row, and ``q`` rows equal to its tempered softmax."""
    from remote.drafters.dflash import block_input_ids
    from remote.drafters.sampling import Sampling

    target, _ = trained
    drafter = family_of(trained, name)
    seq = walk_sequences(target, 1, new_tokens=20, seed=3)[0]
    _, th = target_features(target, seq[:, :-1], drafter.config.target_layer_ids)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    table = DraftTable(drafter, th, seq[0], embed.weight, head)
    table.compute(range(6, 12))
    blocks = [block_input_ids(seq[0, p:p + 1], drafter.block_size, drafter.config.mask_token_id)[None]
              for p in range(6, 12)]
    hidden = torch.cat([drafter.draft_slots(drafter.draft(drafter.embed(b, embed.weight), p, th[:, :p])[0])
                        for p, b in zip(range(6, 12), blocks)])
    anchors = seq[0, 6:12]
    greedy = drafter.propose(hidden, anchors, head, embed_weight=embed.weight)
    assert greedy.tokens.tolist() == [table[p] for p in range(6, 12)]
    prev = torch.cat([anchors[:, None], greedy.tokens[:, :-1]], 1)
    assert torch.equal(drafter.teacher_forced_logits(hidden, prev, head, embed.weight).argmax(-1), greedy.tokens)
    sampling = Sampling(0.8)
    torch.manual_seed(0)
    sampled = drafter.propose(hidden, anchors, head, sampling, embed.weight)
    prev = torch.cat([anchors[:, None], sampled.tokens[:, :-1]], 1)
    q = sampling.probs(drafter.teacher_forced_logits(hidden, prev, head, embed.weight))
    torch.testing.assert_close(sampled.probs, q, atol=1e-6, rtol=0)
    assert not torch.equal(drafter.teacher_forced_logits(hidden, prev.roll(1, 0), head, embed.weight),
                           drafter.teacher_forced_logits(hidden, prev, head, embed.weight))   # the heads read them


@pytest.mark.models
@pytest.mark.parametrize("name", ["domino", "dspark-rnn"])
@torch.no_grad()
def test_expected_acceptance_of_a_family_under_both_rules(trained, name):
    """At T > 0 offline, z-lab's rules: α_k = Σ min(p_k, q_k) with the family's q_k given the
    reference's tokens before draft k; SpecForge's: α_k = p_k(d_k) of the greedy draft. Computed
    here anchor by anchor, one block at a time, from the target's own forward."""
    from remote.decode.offline import SpecForgeRules
    from remote.drafters.dflash import block_input_ids
    from remote.drafters.sampling import Sampling

    target, _ = trained
    drafter = family_of(trained, name)
    seq = walk_sequences(target, 1, new_tokens=24, seed=8)[0][0].tolist()
    prompt, output = seq[:6], seq[6:]
    sampling = Sampling(0.9)
    zlab = evaluate_offline(drafter, target, prompt, output, budgets=(), sampling=sampling)["expected"]
    specforge = evaluate_offline(drafter, target, prompt, output, budgets=(), sampling=sampling,
                                 rules=SpecForgeRules(len(output)))["expected"]
    ids = torch.tensor(seq)
    out, th = target_features(target, ids[None, :-1], drafter.config.target_layer_ids)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    want = {"zlab": [0.0] * drafter.config.num_drafts, "specforge": [0.0] * drafter.config.num_drafts}
    for p in range(len(prompt), len(seq) - 1):
        n = min(drafter.config.num_drafts, len(seq) - 1 - p)
        block = block_input_ids(ids[p:p + 1], n + 1, drafter.config.mask_token_id)[None]
        hidden = drafter.draft_slots(drafter.draft(drafter.embed(block, embed.weight), p, th[:, :p])[0])
        pk = sampling.probs(out.logits[0, p:p + n])
        q = sampling.probs(drafter.teacher_forced_logits(hidden, ids[p:p + n][None], head, embed.weight))[0]
        drafts = drafter.propose(hidden, ids[p:p + 1], head, embed_weight=embed.weight).tokens[0]
        for k in range(n):
            want["zlab"][k] += float(torch.minimum(pk[k], q[k]).sum())
            want["specforge"][k] += float(pk[k, drafts[k]])
    assert zlab["alpha_sum"] == pytest.approx(want["zlab"], abs=1e-5)
    assert specforge["alpha_sum"] == pytest.approx(want["specforge"], abs=1e-5)
    assert zlab["alpha_sum"] != pytest.approx(specforge["alpha_sum"], abs=1e-3)
    assert zlab["anchors"] == specforge["anchors"] == len(output) - 1
