"""The DFlash drafter: a few Qwen3-style decoder layers that draft a block of tokens at once from
the target's hidden states ("KV injection"). Covers z-lab's DFlash and DFlash2 and the speculators
variants; built from transformers' Qwen3 parts (RMSNorm, MLP, rotary embedding: every RoPE type
transformers knows). One model, one file.

Conventions, stated once:

* **Target layer ids** are in the z-lab convention: id ``i`` is the *output* of target decoder
  layer ``i``, i.e. Hugging Face ``hidden_states[i + 1]`` (``hidden_states[0]`` is the embedding
  output). speculators' ``aux_hidden_state_layer_ids`` are these ids + 1 (converted on load).
  ``target_hidden`` is ``cat([hidden_states[i + 1] for i in target_layer_ids], -1)``: ``[b, T, K*H]``.
* **Anchor and block.** A block anchored at sequence position ``p`` holds
  ``[token_p, MASK, ..., MASK]`` (slot 0 is the last committed token, which the target has not
  processed yet). Normally slot ``k >= 1`` predicts token ``p + k`` (``B - 1`` drafts per block);
  with speculators' ``sample_from_anchor`` slot ``k >= 0`` predicts token ``p + k + 1`` (``B``
  drafts). ``noise_embedding`` = the target's embedding rows of the block tokens x
  ``input_embedding_scale``.
* **Positions.** Context positions ``0..p-1``, block positions ``p..p+n-1`` (RoPE over
  ``[context positions ; block positions]``); ``n = B`` except where z-lab drafts a shorter last
  block (``verify_size``, see :mod:`remote.decode.online`).
* **The mask rule** (:func:`visible`, the only place it is written). A slot at position ``q`` of
  the block anchored at ``p`` sees context position ``c`` iff ``c < p`` (strictly before the
  anchor; the context slice is ``[:p]``, empty at ``p = 0``) and its own block's slots, never
  another block. Then, per layer (:meth:`DrafterConfig.layer_rules`):

  - *causal* layers see only block slots at positions ``<= q``. z-lab: sliding layers are causal,
    full layers are not, and a config ``is_causal`` overrides every layer. speculators: sliding
    layers are causal unless ``sliding_window_non_causal``; full layers never.
  - *sliding* layers keep a window of ``W = sliding_window``. z-lab counts it from the query:
    ``|q - k| < W`` (context and block). speculators counts it from the anchor, for context keys
    only: ``c >= p - W``.

Two attention paths compute the same thing: :meth:`DFlashDrafter.draft` (one anchor, context
``[:p]``, incremental context K/V for online decoding) and :meth:`DFlashDrafter.forward_anchors`
(all anchors of a batch in one forward with the training-style anchor-block mask). Tests assert
both equal the references (z-lab's per-anchor forward, speculators' batched mask).

DFlash2 adds a grouped dynamic causal convolution along a block's slots around attention and
around the MLP in every layer (it never crosses blocks), and a candidate selector that picks each
draft token left to right among the top-k of its slot's logits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from remote.drafters.config import DFLASH2, DrafterConfig, LayerRule
from remote.drafters.sampling import Sampling, sample
from remote.target.model import module_device

# ----------------------------------------------------------------------------- mask rule

def visible(rule: LayerRule, q_pos, k_pos, anchor_pos, k_in_block):
    """The mask rule (module docstring), on broadcastable position tensors. Membership (own block,
    same document) is the caller's; this adds the anchor, causality and window conditions."""
    ok = k_in_block | (k_pos < anchor_pos)
    if rule.causal:
        ok = ok & (k_pos <= q_pos)
    if rule.window is not None:
        if rule.window_from == "query":
            ok = ok & ((q_pos - k_pos).abs() < rule.window)
        else:
            ok = ok & (k_in_block | (k_pos >= anchor_pos - rule.window))
    return ok


# ----------------------------------------------------------------------------- building blocks

def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [b, h, n, d]``, ``cos/sin [b, n, d]`` (from ``Qwen3RotaryEmbedding``)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class DFlashAttention(nn.Module):
    """Q from the block; K/V from ``[context ; block]`` through the same k/v projections."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=cfg.attention_bias)
        self.q_norm = Qwen3RMSNorm(d, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(d, eps=cfg.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [b, n, H]`` -> k, v ``[b, n_kv, n, d]`` (k normed and rotated)."""
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, block_rope, ctx_kv, mask, attend):
        b, q_len, _ = x.shape
        cos, sin = block_rope
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.n_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k_blk, v_blk = self.keys_values(x, cos, sin)
        if isinstance(ctx_kv, ContextKV):
            k, v = ctx_kv.with_block(k_blk, v_blk)
        else:
            k, v = torch.cat([ctx_kv[0], k_blk], dim=2), torch.cat([ctx_kv[1], v_blk], dim=2)
        out = attend(q, k, v, mask)  # visibility is entirely in `mask` (None: everything)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class ContextKV:
    """One layer's context K/V (``[b, n_kv, length, d]``) in buffers with room after the context, for
    online decoding: :meth:`append` copies only the new positions (capacity doubles when full), and
    :meth:`with_block` writes a block's K/V right after the context and returns views of
    ``[context ; block]``, so no cycle copies the whole context (a concatenation would, twice per
    layer). The block's K/V are scratch: the next append overwrites them."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v, self.length = k[:, :, :0], v[:, :, :0], 0
        self.append(k, v)

    def _reserve(self, n: int) -> None:
        if self.length + n <= self.k.shape[2]:
            return
        cap = max(64, 2 * (self.length + n))
        k, v = (x.new_empty(*x.shape[:2], cap, x.shape[3]) for x in (self.k, self.v))
        k[:, :, :self.length], v[:, :, :self.length] = self.k[:, :, :self.length], self.v[:, :, :self.length]
        self.k, self.v = k, v

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[2]
        self._reserve(n)
        self.k[:, :, self.length:self.length + n] = k
        self.v[:, :, self.length:self.length + n] = v
        self.length += n

    def with_block(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2]
        self._reserve(k.shape[2])
        self.k[:, :, self.length:end], self.v[:, :, self.length:end] = k, v
        return self.k[:, :, :end], self.v[:, :, :end]


def sdpa_attend(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


class GroupedDynamicCausalConv(nn.Module):
    """DFlash2's local convolution along a block's slots: output slot ``i`` = Σ_t (base[t] +
    dynamic[i, t]) * x[i - t] for taps ``t < kernel_size`` inside the block (earlier slots only;
    zero before slot 0, so blocks never mix). The dynamic kernel is one value per channel group,
    projected from the slot's own input; ``prepare`` (before the sublayer) also returns the kernel
    that ``finish`` (after it) uses."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def _convolve(self, x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """``x [b, n, L, H]`` (n blocks of L slots), ``dynamic [b, n, L, K, G]``, ``base [K, H]``."""
        b, n, L, H = x.shape
        groups = x.view(b, n, L, self.groups, self.group_size)
        out = torch.zeros_like(groups)
        for tap in range(self.kernel_size):
            shifted = groups if tap == 0 else F.pad(groups[:, :, :L - tap], (0, 0, 0, 0, tap, 0))
            coeff = base[tap].view(self.groups, self.group_size).to(x.dtype) + dynamic[:, :, :, tap, :, None]
            out = out + coeff * shifted
        return out.view_as(x)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return self._convolve(x, dynamic[..., 0, :, :], self.base_kernel[0]), dynamic[..., 1, :, :]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return self._convolve(x, dynamic, self.base_kernel[1])


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, hf_config: Qwen3Config):
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = Qwen3MLP(hf_config)
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        if cfg.architecture == DFLASH2:
            self.attention_conv = GroupedDynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.mlp_conv = GroupedDynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        else:
            self.attention_conv = self.mlp_conv = None

    @staticmethod
    def _wrapped(sublayer, conv, x, block_len):
        """DFlash2: ``sublayer`` between the convolution's two halves."""
        b, q, H = x.shape
        x, kernel = conv.prepare(x.view(b, q // block_len, block_len, H))
        y = sublayer(x.view(b, q, H)).view(b, q // block_len, block_len, H)
        return conv.finish(y, kernel).view(b, q, H)

    def forward(self, x, block_rope, ctx_kv, mask, attend, block_len):
        if self.attention_conv is None:
            x = x + self.self_attn(self.input_layernorm(x), block_rope, ctx_kv, mask, attend)
            return x + self.mlp(self.post_attention_layernorm(x))
        attn = lambda h: self.self_attn(h, block_rope, ctx_kv, mask, attend)  # noqa: E731
        x = x + self._wrapped(attn, self.attention_conv, self.input_layernorm(x), block_len)
        return x + self._wrapped(self.mlp, self.mlp_conv, self.post_attention_layernorm(x), block_len)


class CandidateSelector(nn.Module):
    """DFlash2: the draft token of each slot is one of the top-k of its logits, picked left to
    right by ``unary logit + <predecessor_codebook[prev] * hidden_projection(h), successor_codebook[cand]>``,
    where ``prev`` is the token picked for the slot before (the anchor token for the first draft).
    Greedy: argmax; T > 0: sampled from ``softmax(scores / T)`` over the k candidates."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(cfg.vocab_size, cfg.selector_rank))
        self.successor_codebook = nn.Parameter(torch.empty(cfg.vocab_size, cfg.selector_rank))
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    def candidates(self, logits: torch.Tensor):
        """Unary scores and ids of the top-k of every slot (z-lab's order: ``sorted=False``)."""
        return torch.topk(logits, self.top_k, dim=-1, sorted=False)

    def scores(self, unary, candidates, projected, predecessor):
        """Scores of one slot's ``candidates [b, k]`` given the ``predecessor [b]`` token."""
        context = self.predecessor_codebook[predecessor] * projected          # [b, r]
        return unary + torch.einsum("br,bkr->bk", context, self.successor_codebook[candidates])


# ----------------------------------------------------------------------------- masks (batched path)

@dataclass
class AnchorLayout:
    """Index tensors describing the keys ``[context (T) ; blocks (n*B)]`` of a batch of rows.

    ``anchor_idx [b, n]`` indexes the T axis; padded anchors may use 0 (they see only their block).
    """
    query_pos: torch.Tensor     # [b, n*B] RoPE position of each block slot
    query_anchor: torch.Tensor  # [b, n*B] anchor index (T axis) of the slot's block
    anchor_pos: torch.Tensor    # [b, n*B] anchor position of the slot's block
    query_doc: torch.Tensor     # [b, n*B]
    key_pos: torch.Tensor       # [b, T+n*B]
    key_doc: torch.Tensor       # [b, T+n*B]
    ctx_len: int
    block_size: int

    def mask_mod(self, rule: LayerRule):
        """Membership (context of the same document strictly before the anchor index, or the own
        block) and :func:`visible`. Called with scalar indices by flex_attention and with broadcast
        index grids for the dense and split masks."""
        L = self

        def mask_mod(b, h, q_idx, kv_idx):
            kv_is_ctx = kv_idx < L.ctx_len
            in_context = kv_is_ctx & (kv_idx < L.query_anchor[b, q_idx]) & (L.key_doc[b, kv_idx] == L.query_doc[b, q_idx])
            same_block = ~kv_is_ctx & ((kv_idx - L.ctx_len) // L.block_size == q_idx // L.block_size)
            return (in_context | same_block) & visible(rule, L.query_pos[b, q_idx], L.key_pos[b, kv_idx],
                                                       L.anchor_pos[b, q_idx], ~kv_is_ctx)

        return mask_mod


def anchor_layout(position_ids, doc_ids, anchor_idx, block_size) -> AnchorLayout:
    slot = torch.arange(block_size, device=position_ids.device)
    anchor_pos = position_ids.gather(1, anchor_idx)                       # [b, n]
    block_pos = (anchor_pos[..., None] + slot).flatten(1)                 # [b, n*B]
    query_anchor = anchor_idx.repeat_interleave(block_size, dim=1)
    query_doc = doc_ids.gather(1, query_anchor)
    return AnchorLayout(
        query_pos=block_pos, query_anchor=query_anchor, anchor_pos=anchor_pos.repeat_interleave(block_size, dim=1),
        query_doc=query_doc, key_pos=torch.cat([position_ids, block_pos], 1), key_doc=torch.cat([doc_ids, query_doc], 1),
        ctx_len=position_ids.shape[1], block_size=block_size)


def dense_anchor_mask(layout: AnchorLayout, rule: LayerRule) -> torch.Tensor:
    """Boolean ``[b, 1, n*B, T+n*B]`` (True = may attend) for SDPA."""
    (nb, nq), nk = layout.query_pos.shape, layout.key_pos.shape[1]
    dev = layout.query_pos.device
    b = torch.arange(nb, device=dev)[:, None, None]
    q_idx = torch.arange(nq, device=dev)[None, :, None]
    kv_idx = torch.arange(nk, device=dev)[None, None, :]
    return layout.mask_mod(rule)(b, None, q_idx, kv_idx)[:, None]


def flex_anchor_mask(layout: AnchorLayout, rule: LayerRule):
    """The same rule as a flex_attention BlockMask (CUDA)."""
    from torch.nn.attention.flex_attention import create_block_mask

    nb, nq = layout.query_pos.shape
    return create_block_mask(layout.mask_mod(rule), nb, None, nq, layout.key_pos.shape[1],
                             device=layout.query_pos.device)


@dataclass
class SplitAnchorMask:
    """The anchor-block mask block by block, for :func:`split_attend`: ``blocks [b*n, 1, B, T+B]``,
    each block's slots over the keys ``[context (T) ; its own block (B)]``. Same visibility as
    :func:`dense_anchor_mask`, without materialising the (n*B)^2 block-to-block part that is zero
    outside the diagonal blocks."""
    blocks: torch.Tensor


def split_anchor_mask(layout: AnchorLayout, rule: LayerRule) -> SplitAnchorMask:
    (nb, nq), T, B = layout.query_pos.shape, layout.ctx_len, layout.block_size
    dev = layout.query_pos.device
    mod = layout.mask_mod(rule)
    b = torch.arange(nb, device=dev)
    q_idx = torch.arange(nq, device=dev)
    context = mod(b[:, None, None], None, q_idx[None, :, None], torch.arange(T, device=dev)[None, None, :])
    q_blk = q_idx.view(nq // B, B)                                   # [n, B] slots of each block
    kv_blk = T + q_blk                                               # the same block's keys
    block = mod(b[:, None, None, None], None, q_blk[None, :, :, None], kv_blk[None, :, None, :])
    n = nq // B
    blocks = torch.cat([context.view(nb * n, B, T), block.reshape(nb * n, B, B)], -1)
    return SplitAnchorMask(blocks=blocks[:, None])


def split_attend(q, k, v, mask: SplitAnchorMask, group: int = 64):
    """Attention of each block over ``[context ; own block]``: one fused SDPA per group of up to
    ``group`` blocks, the shared context K/V broadcast to every block of the group (bounded
    memory; no (n*B)^2 or [h, n*B, T] score tensors in Python). Equals SDPA with the dense mask
    up to summation order."""
    b, h, nq, d = q.shape
    n_kv, B = k.shape[1], mask.blocks.shape[-2]
    n, T = nq // B, k.shape[2] - nq
    qb = q.view(b, h, n, B, d).transpose(1, 2)                      # [b, n, h, B, d]

    def own(x, lo, hi):                     # [b, kv, T+nq, d] -> blocks lo..hi-1: [b*(hi-lo), kv, T+B, d]
        ctx = x[:, None, :, :T].expand(b, hi - lo, n_kv, T, d)
        blk = x[:, :, T + lo * B:T + hi * B].reshape(b, n_kv, hi - lo, B, d).transpose(1, 2)
        return torch.cat([ctx, blk], 3).reshape(b * (hi - lo), n_kv, T + B, d)

    masks = mask.blocks.view(b, n, 1, B, T + B)
    outs = []
    for lo in range(0, n, group):
        hi = min(n, lo + group)
        out = F.scaled_dot_product_attention(qb[:, lo:hi].reshape(b * (hi - lo), h, B, d), own(k, lo, hi),
                                             own(v, lo, hi), attn_mask=masks[:, lo:hi].reshape(-1, 1, B, T + B),
                                             enable_gqa=h != n_kv)
        outs.append(out.view(b, hi - lo, h, B, d))
    return torch.cat(outs, 1).transpose(1, 2).reshape(b, h, nq, d)


_flex_compiled = None


def flex_attend(q, k, v, block_mask):
    """flex_attention, compiled once for any sequence length (a static compile per length hits
    dynamo's recompile limit after 8 lengths and then runs the unfused kernel)."""
    global _flex_compiled
    from torch.nn.attention.flex_attention import flex_attention
    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention, dynamic=True)
    return _flex_compiled(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


def flex_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
        return True
    except ImportError:
        return False


def anchor_mask(rule: LayerRule, anchor_pos: int, n_slots: int, device) -> torch.Tensor | None:
    """The rule for one block at ``anchor_pos`` over keys ``[context 0..p-1 ; block]``:
    ``[1, 1, n_slots, p + n_slots]`` (None when every key is visible)."""
    if not rule.causal and rule.window is None:          # the context [:p] and the whole block
        return None
    q_pos = anchor_pos + torch.arange(n_slots, device=device)[:, None]
    k_pos = torch.cat([torch.arange(anchor_pos, device=device), anchor_pos + torch.arange(n_slots, device=device)])
    k_in_block = torch.arange(anchor_pos + n_slots, device=device) >= anchor_pos
    mask = visible(rule, q_pos, k_pos[None], anchor_pos, k_in_block[None])
    return None if bool(mask.all()) else mask[None, None]


# ----------------------------------------------------------------------------- the model

class NonFiniteOutput(ValueError):
    """A drafter output that is NaN or infinite (an overflow in the forward, or weights no check
    saw): ``head`` names the part that gave it. No draft made from it is a result."""

    def __init__(self, head: str):
        super().__init__(f"the drafter's {head} gave NaN or infinite outputs")
        self.head = head


BACKBONE = "DFlash backbone (fc and layers)"


def finite(t: torch.Tensor, head: str) -> torch.Tensor:
    """``t``, or :class:`NonFiniteOutput` naming ``head`` when an element of it is NaN or infinite."""
    if not bool(torch.isfinite(t).all()):
        raise NonFiniteOutput(head)
    return t


@dataclass
class Proposal:
    """Draft tokens of one block (target ids) and, when sampling, the distribution they came from:
    ``probs [b, n, V]`` over the target vocabulary, or ``[b, n, k]`` over ``candidates [b, n, k]``
    (DFlash2's selector); ``confidence [b, n]``: each draft's predicted acceptance, where the drafter
    has a confidence head (DSpark)."""
    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    candidates: torch.Tensor | None = None
    confidence: torch.Tensor | None = None

    def on(self, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(probs, candidates)`` on ``device`` (a split target's logits may be on another GPU)."""
        return tuple(t if t is None else t.to(device) for t in (self.probs, self.candidates))


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        hf_config = cfg.transformers_config()
        self.fc = nn.Linear(cfg.num_target_features * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg, hf_config) for _ in range(cfg.num_hidden_layers))
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        with torch.device("cpu"):           # real inverse frequencies even under a meta-device build
            self.rotary_emb = Qwen3RotaryEmbedding(hf_config)
        self.rules = cfg.layer_rules()
        if cfg.reduced_vocab:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        if cfg.architecture == DFLASH2:
            self.candidate_selector = CandidateSelector(cfg)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    # -- inputs
    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def embed(self, block_ids: torch.Tensor, embed_weight: torch.Tensor) -> torch.Tensor:
        """``noise_embedding``: the target's embedding rows x ``input_embedding_scale``, on the
        drafter's device (a target split over GPUs may keep its embedding on another one)."""
        noise = F.embedding(block_ids.to(embed_weight.device), embed_weight).to(self.device)
        scale = self.config.input_embedding_scale
        return noise * scale if scale != 1.0 else noise

    def rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.empty(0, dtype=dtype, device=positions.device)
        return self.rotary_emb(probe, positions)

    def context_kv(self, target_hidden, ctx_rope) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer K/V of the fused context ``hidden_norm(fc(target_hidden))`` (the same input to
        every layer). K/V of a context position do not depend on the block, so they are computed
        once and appended to: KV injection."""
        ctx = self.hidden_norm(self.fc(target_hidden))
        return [layer.self_attn.keys_values(ctx, *ctx_rope) for layer in self.layers]

    def forward(self, noise_embedding, block_rope, ctx_kv, masks: list, attend: Callable = sdpa_attend,
                block_len: int | None = None) -> torch.Tensor:
        """``noise_embedding [b, q, H]`` (blocks of ``block_len`` slots) -> final-normed hidden
        ``[b, q, H]``; ``masks[i]`` is layer i's mask (None: everything visible)."""
        x = noise_embedding
        block_len = block_len or x.shape[1]
        for layer, kv, mask in zip(self.layers, ctx_kv, masks):
            x = layer(x, block_rope, kv, mask, attend, block_len)
        return self.norm(x)

    # -- path 1: one anchor, context [:p] (incremental for online decoding)
    def draft(self, noise_embedding: torch.Tensor, anchor_pos: int, new_target_hidden: torch.Tensor,
              past_kv: list | None = None) -> tuple[torch.Tensor, list]:
        """Hidden states of one block anchored at ``anchor_pos`` (``noise_embedding [1, n, H]``).

        ``new_target_hidden [1, c, K*H]`` are the features of positions ``p - c .. p - 1``;
        ``past_kv`` the context K/V of the positions before them (None: ``c == p``). Returns the
        block's hidden states and the context K/V of positions ``0 .. p - 1`` as :class:`ContextKV`
        per layer (the block's own K/V are not kept: the next anchor's context ends where this block
        begins). ``past_kv`` may also be ``(k, v)`` pairs (copied once into :class:`ContextKV`)."""
        n, c, dev = noise_embedding.shape[1], new_target_hidden.shape[1], noise_embedding.device
        positions = torch.arange(anchor_pos - c, anchor_pos + n, device=dev)[None]
        cos, sin = self.rope(positions, noise_embedding.dtype)
        new_kv = self.context_kv(new_target_hidden, (cos[:, :c], sin[:, :c]))
        if past_kv is None:
            kv = [ContextKV(k, v) for k, v in new_kv]
        else:
            kv = [past if isinstance(past, ContextKV) else ContextKV(*past) for past in past_kv]
            for layer_kv, (k, v) in zip(kv, new_kv):
                layer_kv.append(k, v)
        masks = [anchor_mask(rule, anchor_pos, n, dev) for rule in self.rules]
        hidden = self(noise_embedding, (cos[:, c:], sin[:, c:]), kv, masks)
        return hidden, kv

    # -- path 2: all anchors at once, training-style mask
    def forward_anchors(self, target_hidden, noise_embedding, anchor_idx, position_ids=None, doc_ids=None,
                        attention: str = "auto", ctx_kv: list | None = None) -> torch.Tensor:
        """All blocks of a batch in one forward.

        ``target_hidden [b, T, K*H]``; ``noise_embedding [b, n*B, H]`` (block j occupies slots
        ``j*B .. j*B+B-1``); ``anchor_idx [b, n]`` indexes the T axis; ``position_ids [b, T]``
        (default ``arange``; restart at 0 per document in a packed row); ``doc_ids [b, T]``
        (documents in a packed row never see each other). Returns ``[b, n*B, H]``.

        ``attention``: ``dense`` (boolean mask + SDPA, the reference), ``split`` (the same mask
        in context and own-block parts, CPU default: no (n*B)^2 block-to-block scores), ``flex``
        (flex_attention BlockMask, CUDA default), ``auto``.

        ``ctx_kv``: the context K/V of ``target_hidden``'s positions (:meth:`context_kv`), when the
        caller computed them once for many calls (offline eval: every chunk of anchors of a
        sequence shares one context); ``target_hidden`` then only gives the shapes."""
        b, T, _ = target_hidden.shape
        dev = target_hidden.device
        if position_ids is None:
            position_ids = torch.arange(T, device=dev).expand(b, T)
        if doc_ids is None:
            doc_ids = torch.zeros(b, T, dtype=torch.long, device=dev)
        layout = anchor_layout(position_ids, doc_ids, anchor_idx, self.block_size)
        if attention == "auto":
            attention = "flex" if flex_available(dev) else "split"
        build, attend = {"flex": (flex_anchor_mask, flex_attend), "dense": (dense_anchor_mask, sdpa_attend),
                         "split": (split_anchor_mask, split_attend)}[attention]
        built = {rule: build(layout, rule) for rule in set(self.rules)}
        dtype = noise_embedding.dtype
        if ctx_kv is None:
            ctx_kv = self.context_kv(target_hidden, self.rope(position_ids, dtype))
        return self(noise_embedding, self.rope(layout.query_pos, dtype), ctx_kv, [built[r] for r in self.rules],
                    attend, self.block_size)

    # -- outputs
    def draft_slots(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden states that hold drafts: slots 1.. (slot 0 too with sample_from_anchor)."""
        return hidden if self.config.sample_from_anchor else hidden[..., 1:, :]

    def logits(self, hidden: torch.Tensor, target_head: nn.Module) -> torch.Tensor:
        """z-lab's ``compute_logits``: the head (the target's, or the reduced-vocabulary
        ``lm_head``) x ``output_multiplier``, then ``tanh`` soft-capping when configured."""
        cfg = self.config
        if cfg.reduced_vocab:
            logits = self.lm_head(hidden)
        else:  # the target's head may sit on another device of a split target: logits come back here
            logits = target_head(hidden.to(module_device(target_head))).to(hidden.device)
        if cfg.output_multiplier != 1.0:
            logits = logits * cfg.output_multiplier
        cap = cfg.final_logit_softcapping
        if cap is not None and cap > 0:
            logits = torch.tanh(logits / cap) * cap
        return finite(logits, BACKBONE)

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (``id + d2t[id]``); identity for a full vocabulary."""
        return ids + self.d2t[ids] if self.config.reduced_vocab else ids

    def to_target_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """A distribution over the draft vocabulary as one over the target vocabulary."""
        if not self.config.reduced_vocab:
            return probs
        full = probs.new_zeros(*probs.shape[:-1], self.config.vocab_size)
        return full.index_copy_(-1, self.to_target_ids(torch.arange(probs.shape[-1], device=probs.device)), probs)

    def teacher_forced_logits(self, hidden: torch.Tensor, prev_tokens: torch.Tensor, target_head: nn.Module,
                              embed_weight: torch.Tensor | None = None) -> torch.Tensor:
        """Each draft's logits ``[b, n, V]`` given the tokens before it (``prev_tokens [b, n]``: the
        block's anchor, then the tokens taken to be drafted before each draft, e.g. a reference's).
        DFlash's drafts do not read them; a family whose head does (Domino, DSpark's Markov head)
        conditions draft ``k`` on ``prev_tokens[:, :k + 1]``, and :meth:`propose` drafts from these
        logits with its own drafts as ``prev_tokens``. (DFlash2's selector scores candidates
        instead: :class:`CandidateSelector`.)"""
        return self.logits(hidden, target_head)

    def propose(self, hidden: torch.Tensor, anchor_tokens: torch.Tensor, target_head: nn.Module,
                sampling: Sampling | None = None, embed_weight: torch.Tensor | None = None) -> Proposal:
        """Draft tokens from the draft slots' ``hidden [b, n, H]``: argmax (greedy), or sampled from
        the drafter's tempered / top-k / top-p distribution; DFlash2 through its selector.
        ``anchor_tokens [b]`` are the blocks' slot-0 tokens (the selector's first predecessor);
        ``embed_weight``: the target's embedding (a family whose head reads the drafted tokens')."""
        logits = self.logits(hidden, target_head)
        anchor_tokens = anchor_tokens.to(hidden.device)
        greedy = sampling is None or sampling.greedy
        if self.config.architecture == DFLASH2:
            return self._select(hidden, logits, anchor_tokens, None if greedy else sampling.temperature)
        if greedy:
            return Proposal(self.to_target_ids(logits.argmax(-1)))
        probs = sampling.probs(logits)
        return Proposal(self.to_target_ids(sample(probs)), self.to_target_probs(probs))

    def _select(self, hidden, logits, anchor_tokens, temperature: float | None) -> Proposal:
        sel = self.candidate_selector
        unary, candidates = sel.candidates(logits)
        projected = sel.hidden_projection(hidden)
        predecessor, picked, q_rows = anchor_tokens, [], []
        for slot in range(hidden.shape[1]):
            scores = finite(sel.scores(unary[:, slot], candidates[:, slot], projected[:, slot], predecessor),
                            "candidate selector")
            if temperature is None:
                index = scores.argmax(-1)
            else:
                q = Sampling(temperature).probs(scores)
                index = sample(q)
                q_rows.append(q)
            predecessor = candidates[:, slot].gather(-1, index[:, None])[:, 0]
            picked.append(predecessor)
        return Proposal(torch.stack(picked, 1), torch.stack(q_rows, 1) if q_rows else None,
                        candidates if q_rows else None)


def block_input_ids(anchor_tokens: torch.Tensor, block_size: int, mask_token_id: int) -> torch.Tensor:
    """``[..., n]`` anchor tokens -> ``[..., n*B]`` block inputs ``[tok, MASK, ..., MASK]`` per block."""
    blocks = torch.full((*anchor_tokens.shape, block_size), mask_token_id, dtype=torch.long, device=anchor_tokens.device)
    blocks[..., 0] = anchor_tokens
    return blocks.flatten(-2)


def init_weights(model: nn.Module, std: float = 0.02, generator: torch.Generator | None = None) -> None:
    """Random weights for tests and the demo: linear layers, DFlash2 kernels and codebooks ~ N(0, std)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, std, generator=generator)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, GroupedDynamicCausalConv):
                m.base_kernel.normal_(0.0, std, generator=generator)
                m.base_kernel[:, 0] += 1.0                  # near identity, as both references initialise
            elif isinstance(m, CandidateSelector):
                m.predecessor_codebook.normal_(0.0, std, generator=generator)
                m.successor_codebook.normal_(0.0, std, generator=generator)
