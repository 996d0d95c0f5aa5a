"""Online DFlash speculative decoding is lossless (== target greedy) on tiny Qwen3 and hybrid
Qwen3.5 targets, and the hybrid cache rollback is what makes it so."""
from functools import lru_cache

import pytest
import torch

from remote.decode import online
from remote.target import cache as target_cache
from remote.decode.online import speculative_generate, target_decode
from remote.target.cache import checkpoint, crop_attention, forward, new_cache, rewind
from remote.drafters.tiny import tiny_target, walk_batch
from models import PROMPT_LEN, freeze, random_drafter, trained_drafter, walk_target

pytestmark = [pytest.mark.exactness, pytest.mark.models]
KINDS = ["qwen3", "qwen3_5"]
NEW = 48


@lru_cache(maxsize=None)
def strong_target(kind: str):
    """A random tiny target with larger weights (init_std 0.2). The default ``random_target`` (0.02)
    repeats one token forever, a weak losslessness check; this one emits varied tokens, and its
    Gated DeltaNet layers matter to the argmax (a corrupted recurrent state changes the output)."""
    return freeze(tiny_target(kind, init_std=0.2, seed=1))


def walk_prompts(target, n: int, seed: int = 11) -> list[torch.Tensor]:
    """Held-out walk prompts (training used seed 1)."""
    ids = walk_batch(n, PROMPT_LEN, target.config.vocab_size - 1, torch.Generator().manual_seed(seed))
    return [row[None] for row in ids]


def random_prompts(target, n: int, seed: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, target.config.vocab_size - 1, (1, PROMPT_LEN), generator=gen) for _ in range(n)]


@pytest.fixture(scope="module", params=KINDS)
def trained(request):
    """(walk target, drafter trained on its greedy walks) per target kind, built once."""
    return request.param, walk_target(request.param), trained_drafter(request.param)


def check_counts(res, max_new_tokens, block_size):
    assert all(1 <= a <= block_size for a in res.acceptance_lengths)
    assert len(res.output_ids) == 1 + sum(res.acceptance_lengths) <= max_new_tokens
    assert res.wall_s > 0


def rollback_cycles(lengths, max_new_tokens, block_size):
    """Cycles that verified more tokens than they kept, the last cycle excepted (a hybrid target
    re-forwards the kept tokens after each)."""
    start, count = 0, 0
    for produced in lengths[:-1]:
        count += produced < min(block_size, max_new_tokens - start)
        start += produced
    return count


# ----------------------------------------------------------------------------- baseline

@pytest.mark.parametrize("kind", KINDS)
def test_target_decode_matches_hf_generate(kind):
    target = strong_target(kind)
    prompt = random_prompts(target, 1)[0]
    ref = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, do_sample=False,
                          pad_token_id=0)[0, PROMPT_LEN:].tolist()
    assert target_decode(target, prompt, 20).output_ids == ref
    stop = ref[7]
    assert target_decode(target, prompt, 20, [stop]).output_ids == ref[:ref.index(stop) + 1]


# ----------------------------------------------------------------------------- lossless

@pytest.mark.parametrize("kind", KINDS)
def test_lossless_with_random_drafter(kind):
    target = strong_target(kind)
    drafter = random_drafter(target)
    for prompt in random_prompts(target, 3):
        greedy = target_decode(target, prompt, NEW)
        spec = speculative_generate(target, drafter, prompt, NEW)
        assert spec.output_ids == greedy.output_ids
        assert len(spec.output_ids) == NEW and len(set(greedy.output_ids)) > 10
        check_counts(spec, NEW, drafter.block_size)
        if kind == "qwen3":  # attention only: crop, never re-forward
            assert spec.target_forwards == 1 + len(spec.acceptance_lengths)


def test_lossless_with_trained_drafter_and_partial_accepts(trained):
    kind, target, drafter = trained
    B = drafter.block_size
    all_lengths = []
    for prompt in walk_prompts(target, 4):
        greedy = target_decode(target, prompt, NEW)
        spec = speculative_generate(target, drafter, prompt, NEW)
        assert spec.output_ids == greedy.output_ids
        check_counts(spec, NEW, B)
        all_lengths += spec.acceptance_lengths
        rollbacks = rollback_cycles(spec.acceptance_lengths, NEW, B) if kind == "qwen3_5" else 0
        assert spec.target_forwards == 1 + len(spec.acceptance_lengths) + rollbacks
    tau = sum(all_lengths) / len(all_lengths)
    partial = sum(1 < a < B for a in all_lengths)
    assert tau > 2.0, all_lengths
    assert partial >= 4, all_lengths                  # accepted some drafts, rejected the rest: rollback
    assert max(all_lengths) == B                      # and full accepts


def test_stop_token_mid_output(trained):
    _, target, drafter = trained
    for prompt in walk_prompts(target, 2, seed=21):
        full = target_decode(target, prompt, NEW).output_ids
        for stop in (full[17], full[0]):              # mid-output, and the very first token
            expected = full[:full.index(stop) + 1]
            assert target_decode(target, prompt, NEW, [stop]).output_ids == expected
            spec = speculative_generate(target, drafter, prompt, NEW, [stop, 10**9])
            assert spec.output_ids == expected
            assert len(spec.output_ids) == 1 + sum(spec.acceptance_lengths)
        assert speculative_generate(target, drafter, prompt, NEW, [full[0]]).acceptance_lengths == []


def test_budget_smaller_than_block(trained):
    _, target, drafter = trained
    B = drafter.block_size
    prompt = walk_prompts(target, 1, seed=5)[0]
    full = target_decode(target, prompt, 2 * B).output_ids
    for n in (1, 2, B - 1, B, B + 1, 2 * B):
        spec = speculative_generate(target, drafter, prompt, n)
        assert spec.output_ids == full[:n], n
        assert len(spec.output_ids) == 1 + sum(spec.acceptance_lengths)
    assert speculative_generate(target, drafter, prompt, 1).target_forwards == 1   # c0 only: no cycle


# ----------------------------------------------------------------------------- hybrid rollback

def linear_states(cache):
    return [torch.cat([layer.conv_states[0].flatten(), layer.recurrent_states[0].flatten()])
            for layer in cache.layers if target_cache.is_linear(layer)]


def attention_kv(cache):
    return [torch.cat([layer.keys.flatten(), layer.values.flatten()])
            for layer in cache.layers if not target_cache.is_linear(layer)]


@torch.inference_mode()
def test_hybrid_rollback_equals_fresh_forward_and_naive_crop_does_not():
    """After a verify over 8 tokens of which 3 are kept, restore + re-forward leaves every layer
    (Gated DeltaNet conv/recurrent state and attention K/V) as a fresh forward over the kept
    prefix would; cropping only the attention K/V leaves the linear states wrong, and the next
    token's logits with them."""
    target = strong_target("qwen3_5")
    prompt = random_prompts(target, 1)[0]
    block = torch.randint(0, 200, (1, 8), generator=torch.Generator().manual_seed(0))
    keep = 3

    fresh = new_cache(target)
    forward(target, torch.cat([prompt, block[:, :keep]], 1), fresh)

    def after_verify():
        cache = new_cache(target)
        forward(target, prompt, cache)
        mark = checkpoint(cache)
        forward(target, block, cache)
        return cache, mark

    ours, mark = after_verify()
    rewind(ours, mark, block.shape[1])
    forward(target, block[:, :keep], ours)

    naive, _ = after_verify()
    crop_attention(naive, block.shape[1] - keep)

    for a, b in zip(linear_states(ours), linear_states(fresh)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    for a, b in zip(attention_kv(ours), attention_kv(fresh)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert [t.shape for t in attention_kv(naive)] == [t.shape for t in attention_kv(fresh)]
    assert all((a - b).abs().max() > 1e-2 for a, b in zip(linear_states(naive), linear_states(fresh)))

    nxt = block[:, keep:keep + 1]
    logits = {name: forward(target, nxt, c).logits[0, -1]
              for name, c in (("fresh", fresh), ("ours", ours), ("naive", naive))}
    torch.testing.assert_close(logits["ours"], logits["fresh"], atol=1e-4, rtol=1e-4)
    assert (logits["naive"] - logits["fresh"]).abs().max() > 1e-2


def test_naive_cropping_breaks_losslessness_on_hybrid(monkeypatch):
    """Counterfactual: treat the hybrid cache as attention-only (crop K/V, leave the Gated DeltaNet
    state advanced over the rejected drafts). The output then diverges from greedy, early.

    (On the walk target the same counterfactual happens to stay lossless: its greedy next token
    is a function of the last token alone, so a corrupted recurrent state never flips the argmax.
    A lossless test on such a target alone would not catch a missing rollback.)"""
    target = strong_target("qwen3_5")
    drafter = random_drafter(target)
    prompts = random_prompts(target, 2)
    greedy = [target_decode(target, p, 24).output_ids for p in prompts]
    assert [speculative_generate(target, drafter, p, 24).output_ids for p in prompts] == greedy
    monkeypatch.setattr(online, "has_linear_layers", lambda cache: False)
    naive = [speculative_generate(target, drafter, p, 24).output_ids for p in prompts]
    assert all(n[:10] != g[:10] for n, g in zip(naive, greedy))
