"""Online (real) greedy DFlash speculative decoding against a Hugging Face target, and the plain
greedy baseline it must reproduce token for token.

Batch size 1, greedy, ``torch.inference_mode``; device and dtype are the target's. Both functions
time themselves (prefill included) with ``time.perf_counter`` after a CUDA synchronize.

Target cache (transformers 5.x ``DynamicCache``; the forward kwarg is ``cache=``, ``past_key_values``
is a deprecated alias). Attention layers hold per-position K/V and are cropped
(``layer.crop(-n)`` removes the last ``n`` positions). Gated DeltaNet ``linear_attention`` layers
(Qwen3.5/3.6) hold one recurrent state and a short conv state *for the whole prefix*: a verify
forward over ``B`` tokens leaves them at position ``start + B`` and there is no per-position
history to crop back to (``is_croppable`` is False). The scheme used here:

* before every verify, :func:`snapshot_linear_states` clones each linear layer's conv and
  recurrent state (small: independent of the sequence length);
* after a partial accept (fewer tokens kept than verified), :func:`restore_linear_states` puts the
  snapshot back, the attention K/V are cropped to the same point (before the verify), and the
  kept tokens are re-forwarded once, which advances both kinds of layer exactly over the committed
  tokens. Full accepts need no rollback. Pure-attention targets only crop, never re-forward.

So a hybrid target costs one extra target forward per partial-accept cycle (counted in
``target_forwards``). The cycle that ends generation skips the rollback: nothing runs after it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from remote.drafter import block_input_ids
from remote.target import capture, features


@dataclass
class GreedyResult:
    output_ids: list[int]      # completion only (the stop token included when one was produced)
    wall_s: float


@dataclass
class SpecResult:
    output_ids: list[int]          # completion only; equals the target's greedy completion
    acceptance_lengths: list[int]  # tokens committed per cycle, bonus included (1..B)
    wall_s: float
    target_forwards: int           # prefill + verifies + hybrid rollback re-forwards


# ----------------------------------------------------------------------------- target cache

def new_cache(target):
    """An empty ``DynamicCache`` laid out for the target (linear-attention layers where the config
    has them)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        raise NotImplementedError("sliding-window attention layers cannot be cropped once past the window")
    return cache


def _is_linear(layer) -> bool:
    from transformers.cache_utils import LinearAttentionCacheLayerMixin
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def has_linear_layers(cache) -> bool:
    return any(_is_linear(layer) for layer in cache.layers)


def crop_attention(cache, n: int) -> None:
    """Drop the last ``n`` positions from every attention (K/V) layer; linear layers untouched."""
    from transformers.cache_utils import DynamicLayer

    if n <= 0:
        return
    for layer in cache.layers:
        if _is_linear(layer):
            if isinstance(layer, DynamicLayer):   # a layer holding both kinds of state
                DynamicLayer.crop(layer, -n)
            continue
        layer.crop(-n)


def snapshot_linear_states(cache) -> list:
    """Clones of every linear-attention layer's conv and recurrent states. transformers updates
    them in place (``copy_``, to keep static addresses), so references would not do."""
    snap = []
    for layer in cache.layers:
        if _is_linear(layer):
            conv = {i: s.clone() for i, s in layer.conv_states.items() if s is not None}
            rec = {i: s.clone() for i, s in layer.recurrent_states.items() if s is not None}
            snap.append((layer, conv, rec))
    return snap


def restore_linear_states(snapshot: list) -> None:
    for layer, conv, rec in snapshot:
        for i, s in conv.items():
            layer.conv_states[i].copy_(s)
        for i, s in rec.items():
            layer.recurrent_states[i].copy_(s)


# ----------------------------------------------------------------------------- decoding

def _device(model) -> torch.device:
    return next(model.parameters()).device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def target_greedy(target, prompt_ids: torch.Tensor, max_new_tokens: int,
                  stop_token_ids: list[int] | None = None) -> GreedyResult:
    """Plain greedy decoding: prefill, then one token per forward with a KV cache (lm_head on the
    last position only). The losslessness reference and the speedup baseline."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    stop = set(stop_token_ids or ())
    device = _device(target)
    prompt_ids = prompt_ids.to(device)
    _sync(device)
    t0 = time.perf_counter()
    cache = new_cache(target)
    logits = target(input_ids=prompt_ids, cache=cache, use_cache=True, logits_to_keep=1).logits
    token = logits[:, -1].argmax(-1, keepdim=True)                     # [1, 1]
    output_ids = [int(token)]
    while len(output_ids) < max_new_tokens and output_ids[-1] not in stop:
        logits = target(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        output_ids.append(int(token))
    _sync(device)
    return GreedyResult(output_ids=output_ids, wall_s=time.perf_counter() - t0)


@torch.inference_mode()
def speculative_generate(target, drafter, prompt_ids: torch.Tensor, max_new_tokens: int,
                         stop_token_ids: list[int] | None = None) -> SpecResult:
    """Greedy DFlash speculative decoding (lossless: ``output_ids == target_greedy(...).output_ids``).

    ``start`` is the position of the last committed token, which the target has not processed
    yet; at the top of every cycle the target cache holds exactly positions ``< start`` and the
    drafter context K/V holds the target features of the same positions. Each cycle drafts a full
    block of ``B`` slots ``[token_at_start, MASK x (B-1)]`` anchored at ``start``, verifies
    ``verify_size = min(B, max_length - start)`` of them in one target forward, accepts the longest
    matching prefix and commits it plus the bonus token (``produced`` tokens, capped at
    ``max_length`` and at a stop token). See the module docstring for the cache rollback.
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    stop = set(stop_token_ids or ())
    device = _device(target)
    prompt_ids = prompt_ids.to(device)
    cfg = drafter.config
    B, mask_id, layer_ids = drafter.block_size, cfg.mask_token_id, cfg.target_layer_ids
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    drafter_dtype = next(drafter.parameters()).dtype
    prompt_len = prompt_ids.shape[1]
    max_length = prompt_len + max_new_tokens

    def positions(lo: int, hi: int) -> torch.Tensor:
        return torch.arange(lo, hi, device=device)[None]

    with capture(target, layer_ids) as store:
        _sync(device)
        t0 = time.perf_counter()
        cache = new_cache(target)
        hybrid = has_linear_layers(cache)

        # prefill: the prompt -> first token and the drafter's context for positions 0..P-1
        logits = target(input_ids=prompt_ids, cache=cache, use_cache=True, logits_to_keep=1).logits
        target_forwards = 1
        token = logits[:, -1].argmax(-1, keepdim=True)                   # [1, 1], at position `start`
        ctx_kv = drafter.context_kv(features(store, layer_ids).to(drafter_dtype), positions(0, prompt_len))
        output_ids = [int(token)]
        acceptance_lengths: list[int] = []
        start = prompt_len

        while start + 1 < max_length and output_ids[-1] not in stop:
            # draft: a full block anchored at `start`, context strictly before it
            block = block_input_ids(token, B, mask_id)                   # [1, B]
            hidden = drafter.draft(None, start, embed(block).to(drafter_dtype), ctx_kv=ctx_kv)
            block[:, 1:] = lm_head(hidden[:, 1:].to(lm_head.weight.dtype)).argmax(-1)

            # verify: the real token at `start` and the drafts, positions start..start+verify_size-1
            verify_size = min(B, max_length - start)
            snapshot = snapshot_linear_states(cache) if hybrid else None
            logits = target(input_ids=block[:, :verify_size], cache=cache, use_cache=True).logits
            target_forwards += 1
            posterior = logits[0].argmax(-1)                             # [verify_size]
            matches = block[0, 1:verify_size] == posterior[:verify_size - 1]
            acceptance_length = int(matches.cumprod(0).sum())

            # commit the accepted drafts and the bonus token
            produced = min(acceptance_length + 1, max_length - start - 1)
            new_tokens = torch.cat([block[0, 1:acceptance_length + 1],
                                    posterior[acceptance_length:acceptance_length + 1]])[:produced].tolist()
            stopped_at = next((i for i, t in enumerate(new_tokens) if t in stop), None)
            if stopped_at is not None:
                produced = stopped_at + 1
                new_tokens = new_tokens[:produced]
            output_ids += new_tokens
            acceptance_lengths.append(produced)
            # features of the kept positions start..start+produced-1, from this verify (causal: the
            # rejected drafts after them do not affect them; a re-forward would recompute the same)
            new_feats = features(store, layer_ids)[:, :produced]
            start_old, start = start, start + produced
            token = posterior.new_tensor([[new_tokens[-1]]])
            if start + 1 >= max_length or stopped_at is not None:
                break                                                    # nothing runs after this cycle

            # cache: keep exactly positions < start (block[:produced] of this verify)
            if hybrid and produced < verify_size:
                restore_linear_states(snapshot)                          # rewind to start_old ...
                crop_attention(cache, verify_size)
                target(input_ids=block[:, :produced], cache=cache, use_cache=True, logits_to_keep=1)
                target_forwards += 1                                     # ... and re-forward the kept tokens
            else:
                crop_attention(cache, verify_size - produced)
            new_kv = drafter.context_kv(new_feats.to(drafter_dtype), positions(start_old, start))
            ctx_kv = [(torch.cat([k, nk], 2), torch.cat([v, nv], 2)) for (k, v), (nk, nv) in zip(ctx_kv, new_kv)]

        _sync(device)
        wall_s = time.perf_counter() - t0
    return SpecResult(output_ids=output_ids, acceptance_lengths=acceptance_lengths, wall_s=wall_s,
                      target_forwards=target_forwards)
