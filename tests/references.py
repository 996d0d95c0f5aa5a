"""Tiny drafters built with the references' own classes (z-lab ``dflash`` 0.1.0, ``speculators``
0.9.0) and saved with their own ``save_pretrained``, plus the references' own forward passes, for
the golden tests (tests/test_conformance.py). Nothing here is product code.

Every drafter gets random weights with a large spread (N(0, 0.2); norms 1 + N(0, 0.1); DFlash2
kernels and codebooks too), so that a wrong mask, position, window or head changes the logits by
far more than the stated tolerance.
"""
from __future__ import annotations

import json
import os
import time
from functools import lru_cache
from pathlib import Path

import torch
from transformers import Qwen3Config

from remote.target.model import guard_cpu_kernels

guard_cpu_kernels("cpu")

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16


def randomize(model: torch.nn.Module, seed: int = 0, std: float = 0.2, keep=("embed_tokens", "verifier")) -> None:
    """Random weights, except parameters whose name contains one of ``keep`` (the verifier's)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in keep):
                continue
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


def layer_config(target, layer_types, window=None, rope=None, **extra) -> Qwen3Config:
    return Qwen3Config(vocab_size=target.config.vocab_size, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                       num_hidden_layers=len(layer_types), num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                       head_dim=HEAD_DIM, layer_types=list(layer_types), use_sliding_window=window is not None,
                       sliding_window=window, max_position_embeddings=256,
                       rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0}, **extra)


def zlab_drafter(folder: Path, target, *, dflash2: bool = False, layer_types=("full_attention", "full_attention"),
                 window: int | None = None, rope: dict | None = None, block_size: int = 8, knobs: dict | None = None,
                 is_causal: bool | None = None, layer_ids=(0, 1, 2), seed: int = 0):
    """A z-lab ``DFlashDraftModel`` / ``DFlash2DraftModel`` saved in ``folder``; returns the model."""
    from dflash.model import DFlash2DraftModel, DFlashDraftModel

    dflash = {"mask_token_id": target.config.vocab_size - 1, "target_layer_ids": list(layer_ids), **(knobs or {})}
    extra = {"is_causal": is_causal} if is_causal is not None else {}
    if dflash2:
        dflash.update(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    cfg = layer_config(target, layer_types, window, rope, num_target_layers=target.config.num_hidden_layers,
                       block_size=block_size, dflash_config=dflash, **extra)
    cfg.architectures = ["DFlash2DraftModel" if dflash2 else "DFlashDraftModel"]
    torch.manual_seed(seed)
    model = (DFlash2DraftModel if dflash2 else DFlashDraftModel)(cfg)
    randomize(model, seed)
    model.save_pretrained(folder)
    return model.eval()


def speculators_drafter(folder: Path, target, *, dflash2: bool = False, layer_types=("full_attention", "full_attention"),
                        window: int | None = None, rope: dict | None = None, block_size: int = 8,
                        draft_vocab: int | None = None, sample_from_anchor: bool = False,
                        non_causal: bool | None = None, layer_ids=(0, 1, 2), seed: int = 0):
    """A speculators ``DFlashDraftModel`` / ``DFlash2DraftModel`` saved in ``folder`` (full or reduced
    draft vocabulary; verifier weights from ``target``); returns the model."""
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig

    V = target.config.vocab_size
    lc = layer_config(target, layer_types, window, rope)
    lc._attn_implementation = "sdpa"        # dense masks on CPU (flex_attention needs a GPU to be fast)
    kwargs = dict(transformer_layer_config=lc, draft_vocab_size=draft_vocab or V, block_size=block_size,
                  aux_hidden_state_layer_ids=[i + 1 for i in layer_ids], mask_token_id=V - 1,
                  sample_from_anchor=sample_from_anchor)
    if non_causal is not None:
        kwargs["sliding_window_non_causal"] = non_causal
    if dflash2:
        cfg = DFlash2SpeculatorConfig(**kwargs, conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
        model = DFlash2DraftModel(cfg)
    else:
        model = DFlashDraftModel(DFlashSpeculatorConfig(**kwargs))
    head = target.get_output_embeddings().weight.detach()
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        if draft_vocab:
            picked = torch.randperm(V, generator=torch.Generator().manual_seed(seed + 1))[:draft_vocab].sort().values
            t2d = torch.zeros(V, dtype=torch.bool)
            t2d[picked] = True
            model.load_vocab_mappings(t2d, picked - torch.arange(draft_vocab))
            model.verifier_lm_head.weight.copy_(head[picked])
        else:
            model.lm_head.weight.copy_(head)
            model.verifier_lm_head.weight.copy_(head)
    randomize(model, seed, keep=("embed_tokens", "verifier") + (() if draft_vocab else ("lm_head",)))
    model.save_pretrained(folder)
    return model.eval()


def train_speculators(model, target, sequences, prompt_len: int, steps: int = 300, lr: float = 3e-3,
                      max_anchors: int = 16) -> float:
    """Train a speculators drafter briefly with speculators' own training step (its ``forward``:
    anchor-block mask, KL to the verifier's logits, its position decay; DFlash2 adds its selector
    loss), eager losses on CPU. The verifier is ``target``'s own final norm and head, so the drafter
    learns the target's next-token distribution. Returns the last loss."""
    from speculators.losses.eager import kl_div_loss, tv_loss

    from remote.target.model import target_features

    layer_ids = [i - 1 for i in model.config.aux_hidden_state_layer_ids]      # z-lab convention
    data = []
    for ids in sequences:
        store = {}
        hook = target.model.norm.register_forward_hook(lambda m, i, o: store.__setitem__("last", i[0]))
        with torch.no_grad():
            _, features = target_features(target, ids, layer_ids)
        hook.remove()
        loss_mask = torch.zeros_like(ids)
        loss_mask[:, prompt_len:] = 1
        data.append((ids, features, store["last"], loss_mask))
    with torch.no_grad():
        model.verifier_norm.weight.copy_(target.model.norm.weight)
    params = [p for n, p in model.named_parameters() if "verifier" not in n and "embed_tokens" not in n]
    opt = torch.optim.AdamW(params, lr=lr)
    dflash2 = "candidate_selector" in dict(model.named_children())
    model.train()
    torch.manual_seed(0)
    for step in range(steps):
        ids, features, last, loss_mask = data[step % len(data)]
        _, loss, _ = model(hidden_states=features, input_ids=ids, loss_mask=loss_mask,
                           verifier_last_hidden_states=last, document_ids=torch.zeros_like(ids),
                           max_anchors=max_anchors, loss_config={"kl_div": (kl_div_loss, 1.0)},
                           **({"tv_loss_fn": tv_loss} if dflash2 else {}))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())


# ----------------------------------------------------------------------------- reference forwards

def zlab_class(folder: Path):
    """A z-lab checkpoint folder in z-lab's own class (``from_pretrained``)."""
    from dflash.model import DFlash2DraftModel, DFlashDraftModel

    dflash2 = "DFlash2DraftModel" in json.loads((folder / "config.json").read_text())["architectures"]
    return (DFlash2DraftModel if dflash2 else DFlashDraftModel).from_pretrained(folder).eval()


@torch.no_grad()
def zlab_logits(model, target, target_hidden, ids, anchor: int, n_slots: int) -> torch.Tensor:
    """z-lab's per-anchor forward (no cache, its own mask) and ``compute_logits``: ``[1, n, V]``."""
    from dflash.model import _draft_value, _raw_input_embeddings

    block = torch.full((1, n_slots), model.mask_token_id, dtype=torch.long)
    block[0, 0] = ids[anchor]
    noise = _raw_input_embeddings(target, block, float(_draft_value(model.config, "input_embedding_scale", 1.0)))
    hidden = model(target_hidden=target_hidden[:, :anchor], noise_embedding=noise,
                   position_ids=torch.arange(anchor + n_slots)[None])
    return model.compute_logits(hidden, target.lm_head)


@torch.no_grad()
def speculators_logits(model, target_hidden, ids, n_anchors: int, seed: int = 0):
    """speculators' training forward (its anchor-block mask, its own anchor choice) up to the
    logits: ``(logits [1, n*B, V_draft], hidden [1, n*B, H], anchors [n])``."""
    T = ids.shape[0]
    torch.manual_seed(seed)
    hidden, logits, _, _, block_idx = model._backbone_forward(
        hidden_states=target_hidden, input_ids=ids[None], loss_mask=torch.ones(1, T, dtype=torch.long),
        verifier_last_hidden_states=torch.zeros(1, T, HIDDEN), document_ids=torch.zeros(1, T, dtype=torch.long),
        max_anchors=n_anchors)
    return logits, hidden, block_idx[::model.block_size]


def zlab_generate(model, target, prompt, max_new_tokens: int, stop=None, temperature=0.0, top_p=1.0, top_k=0):
    """z-lab's ``dflash_generate`` on CPU (its timer calls ``torch.cuda.synchronize``): the
    completion and the acceptance lengths."""
    import dflash.model as zlab

    timer = zlab._cuda_time
    zlab._cuda_time = time.perf_counter
    try:
        out = zlab.dflash_generate(model, target, prompt, max_new_tokens, stop, temperature, top_p, top_k,
                                   return_stats=True)
    finally:
        zlab._cuda_time = timer
    return out.output_ids[0, prompt.shape[1]:].tolist(), list(out.acceptance_lengths)


class RollbackTarget:
    """A hybrid (Gated DeltaNet) target for z-lab's ``dflash_generate`` that rolls back correctly.

    transformers' ``crop`` rewinds only the conv state of a linear-attention layer, not its
    recurrent state, so ``dflash_generate`` is not lossless on hybrid targets (and from 5.25 its
    ``activate_past_recording()`` without a count of recurrent states to keep fails in Qwen3.5's
    forward). This shim keeps the reference's loop as it is and makes its crop exact: every forward
    first takes a :func:`remote.target.cache.checkpoint`; a crop that removes tokens rewinds to it
    and re-forwards the kept tokens. (The rollback itself is proven against a fresh forward in
    tests/test_online.py.)"""

    def __init__(self, target):
        self.target, self.last = target, None

    def __getattr__(self, name):
        return getattr(self.target, name)

    def __call__(self, input_ids, position_ids=None, past_key_values=None, **kw):
        from remote.target.cache import checkpoint

        cache = past_key_values
        for layer in cache.layers:
            if getattr(layer, "record_past", False) and getattr(layer, "recurrent_states_to_keep", 0) is None:
                layer.recurrent_states_to_keep = 0      # the conv history is what crop(0) trims
        self.last = (cache, checkpoint(cache), input_ids, position_ids)
        return self.target(input_ids, position_ids=position_ids, past_key_values=cache, **kw)

    def crop_to(self, cache, length: int) -> None:
        """z-lab's ``_crop_to``, with the rollback described above when tokens are removed."""
        from remote.target.cache import has_linear_layers, rewind

        remove = cache.get_seq_length() - length
        if remove <= 0 or self.last is None or self.last[0] is not cache or not has_linear_layers(cache):
            cache.crop(-remove)
            return
        _, mark, ids, pos = self.last
        rewind(cache, mark, ids.shape[1])
        keep = ids.shape[1] - remove
        self.target(ids[:, :keep], position_ids=pos[:, :keep], past_key_values=cache, use_cache=True)
        self.last = None
        cache.crop(0)


# ----------------------------------------------------------------------------- DDTree's official code

# DDTree's code (github liranringel/ddtree, MIT), unchanged, beside the repository; it is not a package
DDTREE = Path(os.environ.get("DFLASH_OPS_DDTREE_REF", Path(__file__).resolve().parents[2] / "shared/references/ddtree"))


@lru_cache(maxsize=None)
def ddtree_reference():
    """DDTree's ``ddtree.py`` as a module. Its imports name top-level ``model`` and ``dflash``
    (its own files, not z-lab's ``dflash`` package), so they are imported from its folder with
    those names set aside, and put back afterwards. Its CUDA timer is replaced by
    ``time.perf_counter`` (CPU), and its caches crop as transformers did when it was written:
    ``crop(n)`` with ``n >= 0`` keeps the first ``n`` positions (5.25 refuses a positive count)."""
    from transformers import DynamicCache
    import importlib.util
    import sys

    def ours(name: str) -> bool:
        return name in ("model", "dflash") or name.startswith(("model.", "dflash."))

    saved = {name: sys.modules.pop(name) for name in [n for n in sys.modules if ours(n)]}
    sys.path.insert(0, str(DDTREE))
    try:
        spec = importlib.util.spec_from_file_location("ddtree_reference", DDTREE / "ddtree.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(DDTREE))
        for name in [n for n in sys.modules if ours(n)]:
            del sys.modules[name]
        sys.modules.update(saved)
    class KeepFirstCrop(DynamicCache):
        def crop(self, max_length: int) -> None:
            remove = self.get_seq_length() - max_length if max_length >= 0 else -max_length
            if remove > 0:
                super().crop(-remove)

    module.cuda_time = time.perf_counter
    module.DynamicCache = KeepFirstCrop
    return module


def ddtree_drafter(folder: Path):
    """A z-lab checkpoint folder in DDTree's own drafter class (its ``model/dflash.py``)."""
    return ddtree_reference().DFlashDraftModel.from_pretrained(folder).eval()


def ddtree_generate(model, target, prompt, max_new_tokens: int, budget: int, stop=None, temperature: float = 0.0):
    """DDTree's ``ddtree_generate`` on CPU: the completion and the acceptance lengths."""
    out = ddtree_reference().ddtree_generate(model, target, prompt, model.mask_token_id, max_new_tokens,
                                             model.block_size, stop, temperature, budget)
    return out.output_ids[0, prompt.shape[1]:].tolist(), list(out.acceptance_lengths)
