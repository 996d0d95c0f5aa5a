"""The DFlash drafter: a few Qwen3-style decoder layers that draft a block of B tokens at once
from the target's hidden states ("KV injection"). One model, one file.

Conventions, stated once:

* **Target layer ids** are in the z-lab convention: id ``i`` is the *output* of target decoder
  layer ``i``, i.e. Hugging Face ``hidden_states[i + 1]`` (``hidden_states[0]`` is the embedding
  output). speculators' ``aux_hidden_state_layer_ids`` are these ids + 1 (converted on load).
  ``target_hidden`` is ``cat([hidden_states[i + 1] for i in target_layer_ids], -1)``: ``[b, T, K*H]``.
* **Anchor.** A block anchored at sequence position ``p`` holds ``[token_p, MASK, ..., MASK]``
  (slot 0 is the last committed token, which the target has not processed yet; slots 1..B-1 are
  ``mask_token_id``). Its logits at slot ``k`` (k >= 1) predict token ``p + k``.
* **Context rule.** The block attends to target features at positions **strictly before** the
  anchor (``kv_pos < p``; context slice ``[:p]``, empty at ``p == 0``) and to its own B slots,
  bidirectionally; never to other blocks.
* **Positions.** Context positions ``0..p-1``, block positions ``p..p+B-1`` (RoPE over
  ``[context positions ; block positions]``).

Two attention paths compute the same thing: :meth:`DFlashDrafter.draft` (one anchor, a context
slice, no mask) and :meth:`DFlashDrafter.forward_anchors` (all anchors of a batch in one forward
with the training-style anchor-block mask). Tests assert they agree.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_layer_ids: list[int]          # z-lab convention (see module docstring)
    mask_token_id: int
    vocab_size: int                      # rows of the target's embedding / lm_head
    block_size: int = 16
    num_target_layers: int | None = None  # decoder layers of the target it was trained for
    target_hidden_size: int | None = None  # defaults to hidden_size
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False
    layer_types: list[str] = field(default_factory=list)  # FULL / SLIDING per layer
    sliding_window: int | None = None

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = [FULL] * self.num_hidden_layers
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]

    @property
    def num_target_features(self) -> int:
        return len(self.target_layer_ids)

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------- building blocks

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope(positions: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[b, 1, n, head_dim]`` for integer ``positions [b, n]`` (Qwen3 default RoPE)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class KVInjectionAttention(nn.Module):
    """Q from the block; K/V from ``[context ; block]`` through the same k/v projections."""

    def __init__(self, cfg: DrafterConfig, layer_idx: int):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

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
        k = torch.cat([ctx_kv[0], k_blk], dim=2)
        v = torch.cat([ctx_kv[1], v_blk], dim=2)
        out = attend(q, k, v, mask)  # non-causal; visibility is entirely in `mask`
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


def sdpa_attend(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_idx: int):
        super().__init__()
        self.layer_type = cfg.layer_types[layer_idx]
        self.self_attn = KVInjectionAttention(cfg, layer_idx)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, block_rope, ctx_kv, mask, attend):
        x = x + self.self_attn(self.input_layernorm(x), block_rope, ctx_kv, mask, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


# ----------------------------------------------------------------------------- masks

@dataclass
class AnchorLayout:
    """Index tensors describing the keys ``[context (T) ; blocks (n*B)]`` of a batch of rows.

    ``anchor_idx [b, n]`` indexes the T axis; padded anchors may use 0 (they see only their block).
    """
    query_pos: torch.Tensor     # [b, n*B] RoPE position of each block slot
    query_anchor: torch.Tensor  # [b, n*B] anchor index (T axis) of the slot's block
    query_doc: torch.Tensor     # [b, n*B]
    key_pos: torch.Tensor       # [b, T+n*B]
    key_doc: torch.Tensor       # [b, T+n*B]
    ctx_len: int
    block_size: int

    def mask_mod(self, sliding_window: int | None = None):
        """The anchor-block rule, written once. Called with scalar indices by flex_attention and
        with broadcast index grids for the dense SDPA mask:

        context key ``kv`` is visible to a slot iff ``kv < anchor`` (strictly before) and both
        belong to the same document; a block key is visible iff it is in the slot's own block
        (bidirectional); sliding layers further require ``|q_pos - kv_pos| < window``."""
        L = self

        def mask_mod(b, h, q_idx, kv_idx):
            kv_is_ctx = kv_idx < L.ctx_len
            in_context = kv_is_ctx & (kv_idx < L.query_anchor[b, q_idx]) & (L.key_doc[b, kv_idx] == L.query_doc[b, q_idx])
            same_block = ~kv_is_ctx & ((kv_idx - L.ctx_len) // L.block_size == q_idx // L.block_size)
            ok = in_context | same_block
            if sliding_window is not None:
                ok = ok & ((L.query_pos[b, q_idx] - L.key_pos[b, kv_idx]).abs() < sliding_window)
            return ok

        return mask_mod


def anchor_layout(position_ids, doc_ids, anchor_idx, block_size) -> AnchorLayout:
    b, T = position_ids.shape
    slot = torch.arange(block_size, device=position_ids.device)
    anchor_pos = position_ids.gather(1, anchor_idx)                       # [b, n]
    block_pos = (anchor_pos[..., None] + slot).flatten(1)                 # [b, n*B]
    query_anchor = anchor_idx.repeat_interleave(block_size, dim=1)
    query_doc = doc_ids.gather(1, query_anchor)
    return AnchorLayout(
        query_pos=block_pos, query_anchor=query_anchor, query_doc=query_doc,
        key_pos=torch.cat([position_ids, block_pos], 1), key_doc=torch.cat([doc_ids, query_doc], 1),
        ctx_len=T, block_size=block_size)


def dense_anchor_mask(layout: AnchorLayout, sliding_window: int | None = None) -> torch.Tensor:
    """Boolean ``[b, 1, n*B, T+n*B]`` (True = may attend) for SDPA."""
    (nb, nq), nk = layout.query_pos.shape, layout.key_pos.shape[1]
    dev = layout.query_pos.device
    b = torch.arange(nb, device=dev)[:, None, None]
    q_idx = torch.arange(nq, device=dev)[None, :, None]
    kv_idx = torch.arange(nk, device=dev)[None, None, :]
    return layout.mask_mod(sliding_window)(b, None, q_idx, kv_idx)[:, None]


def flex_anchor_mask(layout: AnchorLayout, sliding_window: int | None = None):
    """The same rule as a flex_attention BlockMask (CUDA)."""
    from torch.nn.attention.flex_attention import create_block_mask

    nb, nq = layout.query_pos.shape
    return create_block_mask(layout.mask_mod(sliding_window), nb, None, nq, layout.key_pos.shape[1],
                             device=layout.query_pos.device)


@dataclass
class SplitAnchorMask:
    """The anchor-block mask in two parts, for :func:`split_attend`: ``context [b, 1, n*B, T]``
    (dense, strictly-before-anchor rule) and ``block [b, 1, n, B, B]`` (each block with itself).
    Same visibility as :func:`dense_anchor_mask`, without materialising the (n*B)^2 block-to-block
    part that is zero outside the diagonal blocks."""
    context: torch.Tensor
    block: torch.Tensor


def split_anchor_mask(layout: AnchorLayout, sliding_window: int | None = None) -> SplitAnchorMask:
    (nb, nq), T, B = layout.query_pos.shape, layout.ctx_len, layout.block_size
    dev = layout.query_pos.device
    rule = layout.mask_mod(sliding_window)
    b = torch.arange(nb, device=dev)
    q_idx = torch.arange(nq, device=dev)
    context = rule(b[:, None, None], None, q_idx[None, :, None], torch.arange(T, device=dev)[None, None, :])
    q_blk = q_idx.view(nq // B, B)                                   # [n, B] slots of each block
    kv_blk = T + q_blk                                               # the same block's keys
    block = rule(b[:, None, None, None], None, q_blk[None, :, :, None], kv_blk[None, :, None, :])
    return SplitAnchorMask(context=context[:, None], block=block[:, None])


def split_attend(q, k, v, mask: SplitAnchorMask):
    """Exact softmax attention over ``[context ; own block]`` from the two mask parts (merged with a
    shared max, so it equals SDPA with the dense mask up to summation order)."""
    b, h, nq, d = q.shape
    T = mask.context.shape[-1]
    B = mask.block.shape[-1]
    if k.shape[1] != h:
        k, v = k.repeat_interleave(h // k.shape[1], 1), v.repeat_interleave(h // v.shape[1], 1)
    scale = d ** -0.5
    s_ctx = (q @ k[:, :, :T].transpose(-1, -2) * scale).masked_fill(~mask.context, float("-inf"))
    qb = q.view(b, h, nq // B, B, d)
    kb, vb = k[:, :, T:].reshape(b, h, nq // B, B, d), v[:, :, T:].reshape(b, h, nq // B, B, d)
    s_blk = (qb @ kb.transpose(-1, -2) * scale).masked_fill(~mask.block, float("-inf"))
    s_blk = s_blk.reshape(b, h, nq, B)
    m = torch.maximum(s_ctx.amax(-1, keepdim=True), s_blk.amax(-1, keepdim=True))
    p_ctx, p_blk = (s_ctx - m).exp(), (s_blk - m).exp()
    out = p_ctx @ v[:, :, :T] + (p_blk.view(b, h, nq // B, B, B) @ vb).view(b, h, nq, d)
    return out / (p_ctx.sum(-1, keepdim=True) + p_blk.sum(-1, keepdim=True))


_flex_compiled = None


def flex_attend(q, k, v, block_mask):
    global _flex_compiled
    from torch.nn.attention.flex_attention import flex_attention
    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    return _flex_compiled(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


def flex_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
        return True
    except ImportError:
        return False


# ----------------------------------------------------------------------------- the model

class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.num_target_features * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def _rope(self, positions, dtype):
        return rope(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def context_kv(self, target_hidden: torch.Tensor, ctx_pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context K/V from ``target_hidden [b, c, K*H]`` at positions ``ctx_pos [b, c]``.

        The fused context (``hidden_norm(fc(target_hidden))``) is the same input to every layer,
        and K/V of a context position do not depend on the block: they can be computed once per
        sequence and sliced (``[:, :, :p]``) or appended to, which is exactly KV injection.
        """
        ctx = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self._rope(ctx_pos, ctx.dtype)
        return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]

    def forward(self, noise_embedding, block_pos, ctx_kv, masks: dict | None = None,
                attend: Callable = sdpa_attend) -> torch.Tensor:
        """``noise_embedding [b, q, H]`` at ``block_pos [b, q]`` -> final-normed hidden ``[b, q, H]``.

        ``masks`` maps a layer type to a mask (None = everything visible)."""
        masks = masks or {}
        x = noise_embedding
        block_rope = self._rope(block_pos, x.dtype)
        for layer, kv in zip(self.layers, ctx_kv):
            x = layer(x, block_rope, kv, masks.get(layer.layer_type), attend)
        return self.norm(x)

    # -- path 1: one anchor, context slice [:anchor_pos]
    def draft(self, target_hidden: torch.Tensor, anchor_pos: int, noise_embedding: torch.Tensor,
              ctx_kv: list | None = None) -> torch.Tensor:
        """Hidden states of one block anchored at ``anchor_pos`` (``target_hidden [1, >=p, K*H]``,
        ``noise_embedding [1, B, H]``). Pass ``ctx_kv`` (from :meth:`context_kv` over the whole
        sequence) to reuse context K/V; it is sliced to ``[:anchor_pos]`` here either way."""
        B = noise_embedding.shape[1]
        dev = noise_embedding.device
        if ctx_kv is None:
            ctx = target_hidden[:, :anchor_pos]
            ctx_kv = self.context_kv(ctx, torch.arange(anchor_pos, device=dev)[None])
        else:
            ctx_kv = [(k[:, :, :anchor_pos], v[:, :, :anchor_pos]) for k, v in ctx_kv]
        block_pos = torch.arange(anchor_pos, anchor_pos + B, device=dev)[None]
        masks = {}
        if SLIDING in self.config.layer_types:
            key_pos = torch.arange(anchor_pos + B, device=dev)
            masks[SLIDING] = ((block_pos[0, :, None] - key_pos[None]).abs() < self.config.sliding_window)[None, None]
        return self(noise_embedding, block_pos, ctx_kv, masks)

    # -- path 2: all anchors at once, training-style mask
    def forward_anchors(self, target_hidden, noise_embedding, anchor_idx, position_ids=None, doc_ids=None,
                        attention: str = "auto") -> torch.Tensor:
        """All blocks of a batch in one forward.

        ``target_hidden [b, T, K*H]``; ``noise_embedding [b, n*B, H]`` (block j occupies slots
        ``j*B .. j*B+B-1``); ``anchor_idx [b, n]`` indexes the T axis; ``position_ids [b, T]``
        (default ``arange``; restart at 0 per document in a packed row); ``doc_ids [b, T]``
        (documents in a packed row never see each other). Returns ``[b, n*B, H]``.

        ``attention``: ``dense`` (boolean mask + SDPA, the reference), ``split`` (the same mask
        in context and own-block parts, CPU default: no (n*B)^2 block-to-block scores), ``flex``
        (flex_attention BlockMask, CUDA default), ``auto``."""
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
        masks = {FULL: build(layout)}
        if SLIDING in self.config.layer_types:
            masks[SLIDING] = build(layout, self.config.sliding_window)
        ctx_kv = self.context_kv(target_hidden, position_ids)
        return self(noise_embedding, layout.query_pos, ctx_kv, masks, attend)


def block_input_ids(anchor_tokens: torch.Tensor, block_size: int, mask_token_id: int) -> torch.Tensor:
    """``[..., n]`` anchor tokens -> ``[..., n*B]`` block inputs ``[tok, MASK, ..., MASK]`` per block."""
    blocks = torch.full((*anchor_tokens.shape, block_size), mask_token_id, dtype=torch.long, device=anchor_tokens.device)
    blocks[..., 0] = anchor_tokens
    return blocks.flatten(-2)


def init_weights(model: nn.Module, std: float = 0.02, generator: torch.Generator | None = None) -> None:
    for m in model.modules():
        if isinstance(m, nn.Linear):
            with torch.no_grad():
                m.weight.normal_(0.0, std, generator=generator)
                if m.bias is not None:
                    m.bias.zero_()


if __name__ == "__main__":  # python -m remote.drafter inspect DIR [--target DIR]
    from remote.inspect_cli import main
    raise SystemExit(main())
