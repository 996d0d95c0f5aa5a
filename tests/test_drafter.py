"""The drafter's two attention paths mean the same thing, and the off-by-one guards can fail.

Tolerance: fp32 on CPU, |batched - per-anchor| <= 1e-5 (observed ~1e-6: only the summation order
of the masked softmax differs). A one-position mistake changes logits by >= 1e-2.
"""
import pytest
import torch

from remote.drafters.dflash import DFlashDrafter, anchor_layout, block_input_ids, dense_anchor_mask, init_weights
from remote.drafters.config import FULL, SLIDING, SPECULATORS, DrafterConfig, LayerRule

TOL = 1e-5


def make(layer_types=(FULL, FULL), window=None, B=4, seed=0, **rules):
    cfg = DrafterConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=len(layer_types),
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, target_layer_ids=[0, 2, 3],
                        mask_token_id=99, vocab_size=100, block_size=B, layer_types=list(layer_types),
                        sliding_window=window, **rules)
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg)
    init_weights(model, std=0.1, generator=torch.Generator().manual_seed(seed))
    embed = torch.nn.Embedding(100, 64)
    lm_head = torch.nn.Linear(64, 100, bias=False)
    return model.eval(), embed, lm_head


def sequence(T, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, T, 3 * 64, generator=g), torch.randint(0, 99, (1, T), generator=g)


def blocks_for(model, embed, ids, anchors):
    return embed(block_input_ids(ids[0, anchors], model.block_size, model.config.mask_token_id))[None]


def one_anchor(model, target_hidden, p, noise):
    return model.draft(noise, p, target_hidden[:, :p])[0]


@pytest.mark.models
@pytest.mark.parametrize("layer_types,window,rules", [
    ((FULL, FULL), None, {}), ((SLIDING, FULL), 5, {}), ((SLIDING, SLIDING), 3, {"is_causal": False}),
    ((SLIDING, FULL), 3, {"is_causal": True}), ((SLIDING, FULL), 3, {"mask_rule": SPECULATORS}),
    ((SLIDING, SLIDING), 2, {"mask_rule": SPECULATORS, "sliding_window_non_causal": True})])
@torch.no_grad()
def test_batched_mask_equals_per_anchor_for_every_anchor(layer_types, window, rules):
    model, embed, lm_head = make(layer_types, window, **rules)
    T, B = 13, model.block_size
    target_hidden, ids = sequence(T)
    anchors = torch.arange(T)                       # includes anchor 0 (empty context) and the last anchors
    batched = lm_head(model.forward_anchors(target_hidden, blocks_for(model, embed, ids, anchors), anchors[None]))
    for p in range(T):
        single = lm_head(one_anchor(model, target_hidden, p, blocks_for(model, embed, ids, torch.tensor([p]))))
        torch.testing.assert_close(batched[:, p * B:(p + 1) * B], single, atol=TOL, rtol=0)


@pytest.mark.models
@torch.no_grad()
def test_batched_mask_equals_per_anchor_in_a_packed_batch():
    """Two documents packed in one row (positions restart, doc ids differ) and a second row padded
    with anchor-0 blocks: every block equals the per-document per-anchor result."""
    model, embed, lm_head = make((SLIDING, FULL), 6)
    B = model.block_size
    (h1, i1), (h2, i2) = sequence(7, seed=2), sequence(9, seed=3)
    packed_h, packed_ids = torch.cat([h1, h2], 1), torch.cat([i1, i2], 1)
    pos = torch.cat([torch.arange(7), torch.arange(9)])[None]
    doc = torch.cat([torch.zeros(7), torch.ones(9)]).long()[None]
    anchors = torch.tensor([0, 3, 6, 7, 8, 12, 15])          # doc 0: 0,3,6   doc 1: 0,1,5,8 (local)
    out = lm_head(model.forward_anchors(packed_h, blocks_for(model, embed, packed_ids, anchors), anchors[None],
                                        position_ids=pos, doc_ids=doc))
    for j, a in enumerate(anchors.tolist()):
        h, ids, local = (h1, i1, a) if a < 7 else (h2, i2, a - 7)
        single = lm_head(one_anchor(model, h, local, blocks_for(model, embed, ids, torch.tensor([local]))))
        torch.testing.assert_close(out[:, j * B:(j + 1) * B], single, atol=TOL, rtol=0)

    # batch of two rows: row 1 carries the second document alone, padded with anchor-0 blocks
    rows_h = torch.cat([h1[:, :7], torch.zeros(1, 0, 192)], 1)
    row2_h = h2[:, :7]
    two_rows = model.forward_anchors(
        torch.cat([rows_h, row2_h]), torch.cat([blocks_for(model, embed, i1, torch.tensor([2, 6])),
                                                 blocks_for(model, embed, i2, torch.tensor([5, 0]))]),
        torch.tensor([[2, 6], [5, 0]]))
    single = one_anchor(model, h2, 5, blocks_for(model, embed, i2, torch.tensor([5])))
    torch.testing.assert_close(two_rows[1:, :B], single, atol=TOL, rtol=0)


def test_mask_rule_strictly_before_anchor_and_own_block_only():
    pos = torch.arange(6)[None]
    layout = anchor_layout(pos, torch.zeros(1, 6, dtype=torch.long), torch.tensor([[0, 3]]), 2)
    mask = dense_anchor_mask(layout, LayerRule(False, None, "query"))[0, 0].int()
    # keys: ctx 0..5, block0 (slots 6,7), block1 (slots 8,9)
    assert mask[0].tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 0, 0]   # anchor 0: empty context, own block
    assert mask[2].tolist() == [1, 1, 1, 0, 0, 0, 0, 0, 1, 1]   # anchor 3: ctx 0..2 (not 3), own block
    assert mask[3].tolist() == mask[2].tolist()                 # bidirectional inside the block


@pytest.mark.models
@torch.no_grad()
def test_off_by_one_context_or_positions_change_the_logits():
    """The seed harness's bugs, reproduced: context [:p+1] and block positions shifted by one.
    Both must visibly change the logits, and only the correct form matches the batched path."""
    model, embed, lm_head = make()
    T, p = 12, 6
    target_hidden, ids = sequence(T)
    noise = blocks_for(model, embed, ids, torch.tensor([p]))
    batched = lm_head(model.forward_anchors(target_hidden, blocks_for(model, embed, ids, torch.arange(T)),
                                            torch.arange(T)[None]))[:, p * 4:(p + 1) * 4]

    def run(ctx_len, first_block_pos):
        kv = model.context_kv(target_hidden[:, :ctx_len], model.rope(torch.arange(ctx_len)[None], noise.dtype))
        block_rope = model.rope(torch.arange(first_block_pos, first_block_pos + 4)[None], noise.dtype)
        return lm_head(model(noise, block_rope, kv, [None, None]))

    correct, extra_ctx, shifted = run(p, p), run(p + 1, p), run(p, p + 1)
    torch.testing.assert_close(correct, batched, atol=TOL, rtol=0)
    assert (extra_ctx - batched).abs().max() > 1e-2, "feeding [:p+1] must be detectable"
    assert (shifted - batched).abs().max() > 1e-2, "shifting block positions must be detectable"


@pytest.mark.models
@torch.no_grad()
def test_empty_context_at_anchor_zero_is_the_block_alone():
    model, embed, lm_head = make()
    target_hidden, ids = sequence(5)
    noise = blocks_for(model, embed, ids, torch.tensor([0]))
    out = one_anchor(model, target_hidden, 0, noise)
    assert out.shape == (1, 4, 64) and torch.isfinite(out).all()
    # the context cannot matter at anchor 0
    torch.testing.assert_close(out, one_anchor(model, torch.randn_like(target_hidden), 0, noise), atol=0, rtol=0)


@pytest.mark.models
@pytest.mark.gpu
@torch.no_grad()
def test_flex_attention_equals_dense_mask_on_cuda():
    model, embed, lm_head = make((SLIDING, FULL), 5)
    model, embed = model.cuda(), embed.cuda()
    target_hidden, ids = sequence(40)
    target_hidden, ids = target_hidden.cuda(), ids.cuda()
    anchors = torch.arange(40, device="cuda")
    noise = blocks_for(model, embed, ids, anchors)
    dense = model.forward_anchors(target_hidden, noise, anchors[None], attention="dense")
    flex = model.forward_anchors(target_hidden, noise, anchors[None], attention="flex")
    torch.testing.assert_close(flex, dense, atol=1e-4, rtol=0)
