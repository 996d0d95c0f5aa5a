"""The target's KV cache during speculative decoding: make one, and roll it back after a partial accept.

At the top of every cycle the cache must hold exactly the committed positions ``< start``. A verify
forward over ``n`` tokens leaves every layer at ``start + n``:

* attention layers (``DynamicLayer``) hold K/V per position and are cropped with their public
  ``crop(-k)``;
* Gated DeltaNet ``linear_attention`` layers (Qwen3.5/3.6) hold one recurrent state and a short
  conv state for the whole prefix, plus bookkeeping (a token counter since transformers 5.25, which
  ``DynamicCache.get_seq_length`` reads when layer 0 is linear, and from it every position id).
  There is no per-position history to crop back to, so :func:`checkpoint` copies each linear layer's
  whole state before the verify and :func:`rewind` puts it back, crops the attention K/V to before
  the verify, and leaves the caller to re-forward the kept tokens.

The copy is generic on purpose: every instance attribute of a linear layer except attention K/V is
cloned and restored, whatever a release names or adds there, so a new counter cannot slip past it
as ``cumulative_length_linear`` slipped past a conv/recurrent-only copy. :func:`self_test` proves
the rollback against a fresh forward on a tiny model of the target's own config class with the
installed transformers; pre-flight runs it on every host, and ``TRANSFORMERS_SUPPORTED`` in
:mod:`remote.contract.versions` is the range the tests cover.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import lru_cache

import torch

ATTENTION_STATE = ("keys", "values")      # per-position K/V: cropped, never copied


@lru_cache(maxsize=None)
def _cache_kwarg(model_class) -> str:
    """The forward's name for the cache: ``cache`` from transformers 5.24 (``past_key_values`` is a
    deprecated alias there), ``past_key_values`` before. Read from the signature, not the version."""
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward(model, input_ids, cache, **kwargs):
    """``model(input_ids, <cache kwarg>=cache, use_cache=True, **kwargs)``: one forward that reads
    and extends ``cache``, under the name this transformers gives it (an unknown keyword would be
    swallowed by ``**kwargs`` and the forward would run without a cache)."""
    return model(input_ids=input_ids, use_cache=True, **{_cache_kwarg(type(model)): cache}, **kwargs)


def new_cache(target):
    """An empty ``DynamicCache`` laid out for the target (linear-attention layers where the config
    has them)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        raise NotImplementedError("sliding-window attention layers cannot be cropped once past the window")
    return cache


def is_linear(layer) -> bool:
    from transformers.cache_utils import LinearAttentionCacheLayerMixin
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def has_linear_layers(cache) -> bool:
    return any(is_linear(layer) for layer in cache.layers)


def crop_attention(cache, n: int) -> None:
    """Drop the last ``n`` positions from every attention (K/V) layer; linear state untouched."""
    from transformers.cache_utils import DynamicLayer

    if n <= 0:
        return
    for layer in cache.layers:
        if is_linear(layer):
            if isinstance(layer, DynamicLayer):   # a layer holding both kinds of state
                DynamicLayer.crop(layer, -n)
            continue
        layer.crop(-n)


def _copy(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_copy(v) for v in value)
    return value                                  # ints, bools, None, dtypes, devices


def _put(owner, key, saved, get, set_) -> None:
    """Restore one saved value: tensors in place where the shape allows (transformers keeps static
    addresses for its states), containers entry by entry, anything else by assignment."""
    current = get(owner, key)
    if isinstance(saved, torch.Tensor) and isinstance(current, torch.Tensor) and current.shape == saved.shape \
            and current.dtype == saved.dtype and current.device == saved.device:
        current.copy_(saved)
    elif isinstance(saved, dict) and isinstance(current, dict):
        for k in set(current) - set(saved):
            del current[k]
        for k, v in saved.items():
            if k in current:
                _put(current, k, v, dict.__getitem__, dict.__setitem__)
            else:
                current[k] = _copy(v)
    else:
        set_(owner, key, _copy(saved))


@dataclass
class CacheMark:
    """The linear layers' whole state at one point (before a verify)."""
    states: list            # (layer, {attribute: copy})


def checkpoint(cache) -> CacheMark:
    """Copies of every linear-attention layer's state (small: independent of the sequence length,
    except for a layer that also holds attention K/V, whose K/V are left to :func:`rewind`)."""
    return CacheMark([(layer, {name: _copy(v) for name, v in vars(layer).items() if name not in ATTENTION_STATE})
                      for layer in cache.layers if is_linear(layer)])


def rewind(cache, mark: CacheMark, forwarded: int) -> None:
    """Back to ``mark``: linear layers restored, attention K/V cropped by the ``forwarded`` tokens
    the verify added since. The caller re-forwards the tokens it keeps."""
    for layer, state in mark.states:
        for name, saved in state.items():
            _put(layer, name, saved, getattr, setattr)
        for name in set(vars(layer)) - set(state) - set(ATTENTION_STATE):
            delattr(layer, name)
    crop_attention(cache, forwarded)


# ----------------------------------------------------------------------------- self-test

def tiny_config_like(config):
    """A small config of the target's own class and layer pattern: two of each layer type, small
    widths, everything else (RoPE, linear-attention kernel sizes) as the target has it."""
    text = getattr(config, "text_config", None) or config
    small = type(text).from_dict(text.to_dict())
    kinds = list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)
    pattern = []
    for kind in dict.fromkeys(kinds):
        pattern += [kind, kind]
    pattern.sort(key=kinds.index)
    small.num_hidden_layers = len(pattern)
    if getattr(text, "layer_types", None) is not None:
        small.layer_types = pattern
    # head dims stay the target's (RoPE sections and kernel shapes depend on them); counts shrink
    for name, value in (("hidden_size", 64), ("intermediate_size", 128), ("num_attention_heads", 2),
                        ("num_key_value_heads", 1), ("vocab_size", 256), ("linear_num_key_heads", 1),
                        ("linear_num_value_heads", 2), ("num_experts", 4), ("num_experts_per_tok", 2),
                        ("moe_intermediate_size", 32), ("shared_expert_intermediate_size", 32)):
        if hasattr(small, name):
            setattr(small, name, value)
    small.tie_word_embeddings = False
    return small


@torch.inference_mode()
def self_test(config, device="cpu", prompt_len: int = 12, verify: int = 8, keep: int = 3,
              seed: int = 0) -> str | None:
    """Roll back a partial accept on a tiny random model of ``config``'s class (on ``device``, with
    the kernels the run will use there) and compare the next token's logits with a fresh forward
    over the kept prefix. ``None`` when they agree, else what differs. Seconds on a CPU."""
    from transformers import AutoModelForCausalLM

    small = tiny_config_like(config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(small).float().eval().to(device)
    for p in model.parameters():          # weights large enough that a stale state changes the logits
        p.normal_(0.0, 0.2)
    gen = torch.Generator().manual_seed(seed)
    prompt, block, nxt = (torch.randint(0, small.vocab_size, (1, n), generator=gen).to(device)
                          for n in (prompt_len, verify, 1))

    fresh = new_cache(model)
    forward(model, torch.cat([prompt, block[:, :keep]], 1), fresh)
    want = forward(model, nxt, fresh).logits[0, -1]

    cache = new_cache(model)
    forward(model, prompt, cache)
    mark = checkpoint(cache)
    forward(model, block, cache)
    rewind(cache, mark, verify)
    forward(model, block[:, :keep], cache)
    if cache.get_seq_length() != prompt_len + keep:
        return f"after the rollback the cache holds {cache.get_seq_length()} positions, not {prompt_len + keep}"
    got = forward(model, nxt, cache).logits[0, -1]
    diff = float((got - want).abs().max())
    if not diff <= 1e-3 * max(1.0, float(want.abs().max())):
        return f"next-token logits after the rollback differ from a fresh forward by {diff:.3g}"
    return None


def keep_attention(cache, past: int, keep: list[int]) -> None:
    """Of the positions every attention layer appended after its first ``past`` (the nodes of a tree
    verify), keep only those at offsets ``keep`` (ascending), moved to positions ``past, past + 1,
    ...``: the accepted path of a tree, in order. Attention K/V only: a linear-attention layer's state
    is not kept per position, so a cache with one is refused."""
    if has_linear_layers(cache):
        raise NotImplementedError("linear-attention state cannot be compacted per position")
    appended = cache.get_seq_length() - past
    if keep != list(range(len(keep))):          # a path that is not the tree's first nodes: move it up
        for layer in cache.layers:
            index = torch.tensor(keep, dtype=torch.long, device=layer.keys.device) + past
            for name in ATTENTION_STATE:
                states = getattr(layer, name)
                states[..., past:past + len(keep), :] = states.index_select(-2, index)
    crop_attention(cache, appended - len(keep))


def keep_attention_path(cache, past: int, keep: list[int]) -> None:
    """:func:`keep_attention` for a cache that may also hold linear-attention layers: every attention
    layer keeps, of the positions it appended after its first ``past``, those at offsets ``keep``
    (ascending), moved to ``past, past + 1, ...``; linear-attention layers are left as they are (a
    tree verify's linear state is committed by :mod:`remote.target.tree_state`). Each layer's
    appended count is its own length, not ``cache.get_seq_length()`` (which reads layer 0, possibly
    a linear layer's token counter)."""
    moved = keep != list(range(len(keep)))
    for layer in cache.layers:
        if is_linear(layer):
            continue
        appended = layer.get_seq_length() - past
        if moved:
            index = torch.tensor(keep, dtype=torch.long, device=layer.keys.device) + past
            for name in ATTENTION_STATE:
                states = getattr(layer, name)
                states[..., past:past + len(keep), :] = states.index_select(-2, index)
        if appended > len(keep):
            layer.crop(-(appended - len(keep)))
