"""A drafter checkpoint written in another format (the command line is :mod:`remote.export`).

Writes a drafter checkpoint SRC (a folder in any format :mod:`remote.drafters.checkpoint` reads: z-lab,
speculators, SpecForge, a bare state dict) as a new checkpoint folder in the z-lab, the speculators or
SpecForge's format, beside SRC by default (``SRC.zlab``, ``SRC.speculators``, ``SRC.specforge``). The new folder holds ``config.json``,
``model.safetensors`` (tensors bit for bit as read, same dtypes) and ``dflash-export.json``: the
source (path, format, sha256 of every file read), what was mapped and how, what was not carried
and why, and the sha256 of every file written.

What maps to what (z-lab ↔ speculators):

* target layer ids: ``dflash_config.target_layer_ids`` = ``aux_hidden_state_layer_ids`` − 1 (z-lab's
  id ``i`` is HF ``hidden_states[i + 1]``, speculators index ``hidden_states`` directly);
* ``mask_token_id``, ``block_size``, the layer config (sizes, RoPE, ``layer_types``,
  ``sliding_window``): the same values; z-lab keeps the layer config at the top level, speculators
  under ``transformer_layer_config``; speculators' per-layer-type RoPE is written flattened, as
  speculators itself builds it;
* mask rules: a full layer is bidirectional in both; z-lab's ``is_causal`` and speculators'
  ``sliding_window_non_causal`` are chosen so that every layer keeps its rule (causality, window,
  where the window counts from), or the export is refused naming the layer and field;
* vocabulary: a full vocabulary uses the target's ``lm_head`` in both (no head is written); a
  reduced one keeps its ``lm_head.weight``, ``d2t`` and ``t2d`` in speculators and is refused for
  z-lab, which has no head of its own;
* DFlash2's convolutions and candidate selector: the same tensors (codebooks written without
  ``.weight``, the released z-lab form, which both references and vLLM read).

SpecForge's format is z-lab's layout with SpecForge's class and ``dflash_config`` keys
(:func:`~remote.drafters.checkpoint.specforge_config_dict`); it alone holds the Domino and DSpark heads,
and it holds only bidirectional full-attention DFlash drafters over the target's ``lm_head``
(:func:`_as_specforge` says why).

Refused, naming the field: what the target format cannot express (sliding windows counted from the
other end, causal full layers in speculators, z-lab's knobs in speculators, ``sample_from_anchor``
and reduced vocabularies in z-lab, a DFlash2 ``conv_kernel_size`` beyond the block in
speculators, keys the exporter does not know), and z-lab output without ``num_target_layers``
(z-lab's class needs it; ``--verifier DIR`` or ``--num-target-layers N`` supply it).

The folder is written atomically: into a hidden temporary sibling, every file fsynced, read back
and checked (the config read back behaves as the source's, every tensor equal bit for bit), then
renamed into place. An existing destination is refused unless ``--force`` (then replaced whole). A
destination that is, contains or lies inside an input of the export (the source, a verifier folder)
is refused, ``--force`` or not: nothing the export reads is ever replaced.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from remote.drafters.checkpoint import (CONFIG_NAME, CheckpointError, DrafterCheckpoint,
                                        check_tensors, check_vocab_maps, completeness_problems, layer_config_dict,
                                        open_checkpoint, read_json, read_tensors, sha256_file, specforge_config_dict,
                                        tensor_name, speculators_config_dict, speculators_proposal_config,
                                        zlab_config_dict)
from remote.drafters.config import DFLASH, DFLASH2, FULL, SLIDING, SPECULATORS, ZLAB, DrafterConfig
from remote.contract.formats import EXPORT_FORMATS, SPECFORGE
from remote.host.proc import alive

FORMATS = EXPORT_FORMATS
NOTE_NAME = "dflash-export.json"
WEIGHTS_NAME = "model.safetensors"

# Values z-lab reads from dflash_config, else from the config's top level (its _draft_value).
_DFLASH_VALUES = ("mask_token_id", "target_layer_ids", "block_size", "input_embedding_scale", "output_multiplier",
                  "final_logit_softcapping", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
_DFLASH2_VALUES = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
_ZLAB_OWN = {"architectures", "dflash_config", "num_target_layers", "target_hidden_size", "is_causal", *_DFLASH_VALUES}
# Layer-config keys written from the drafter's config; transformers folds the legacy RoPE keys into
# rope_parameters, so they are written there.
_LEGACY_ROPE = ("rope_theta", "rope_scaling", "partial_rotary_factor")
_LAYER_OWN = set(layer_config_dict(DrafterConfig(
    hidden_size=1, intermediate_size=1, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=1,
    target_layer_ids=[0], mask_token_id=0, vocab_size=1))) | set(_LEGACY_ROPE)
_SPECULATORS_OWN = {"speculators_model_type", "transformer_layer_config", "aux_hidden_state_layer_ids",
                    "draft_vocab_size", "mask_token_id", "block_size", "sliding_window_non_causal",
                    "sample_from_anchor", "target_hidden_size", "num_target_layers", "architectures", "auto_map",
                    "speculators_config", "speculators_version", *_DFLASH2_VALUES}
# transformers' own bookkeeping keys (no drafting semantics), carried wherever they are.
_GENERIC = {"_name_or_path", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label", "label2id",
            "is_encoder_decoder", "output_attentions", "output_hidden_states", "problem_type", "return_dict",
            "transformers_version", "tie_word_embeddings", "pad_token_id", "bos_token_id", "eos_token_id",
            "use_cache", "initializer_range", "attention_dropout", "max_window_layers"}
# Generic keys speculators' save writes at its top level (the first two there only).
_SPECULATORS_TOP = ("dtype", "torch_dtype", "tie_word_embeddings", "transformers_version")
_DEFAULT_NON_CAUSAL = {"dflash": False, "dflash2": True}     # speculators' sliding_window_non_causal defaults
ZLAB_LAYOUT = (ZLAB, SPECFORGE)       # formats that keep z-lab's config layout (layer config at the top level)
# SpecForge's dflash_config keys: the family's, read into the drafter's config and written again from it
# where the target format is SpecForge's; confidence_head_alpha is a training loss weight (no drafting semantics)
_SPECFORGE_OWN = {"projector_type", "pure_draft_prefix_len", "shift_label", "emb_dim", "gru_hidden_dim", "markov_rank",
                  "markov_head_type", "enable_confidence_head", "confidence_head_with_markov", "attention_mode"}
_SPECFORGE_CARRIED = {"confidence_head_alpha"}


class ExportRefused(ValueError):
    """The checkpoint cannot be written in the requested format; ``reasons`` name the fields."""

    def __init__(self, fmt: str, reasons: list[str]):
        self.fmt, self.reasons = fmt, reasons
        super().__init__(f"cannot export to {fmt}: " + "; ".join(reasons))


class DestinationError(ValueError):
    """The destination cannot be used: it exists (without ``--force``), is, contains or lies inside an
    input of the export, or has no parent."""


@dataclass
class Plan:
    """What an export writes: the drafter's config under the target format's rules, ``config.json``,
    and the account of every source item (``mapped``: carried under another name or form;
    ``not_carried``: left out, with why)."""
    source: DrafterCheckpoint
    fmt: str
    config: DrafterConfig
    raw: dict
    mapped: list[str] = field(default_factory=list)
    not_carried: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- semantics

def _rule_key(rule) -> tuple:
    return rule.causal, rule.window, rule.window_from if rule.window is not None else None


def behaviour(cfg: DrafterConfig) -> dict:
    """Everything that decides what the drafter computes, independent of the format's way of
    saying it: the per-layer rules (not ``mask_rule``/``is_causal``/``sliding_window_non_causal``),
    the vocabulary (``draft_vocab_size`` only when reduced), knobs with no effect normalised away."""
    out = cfg.to_dict()
    for key in ("mask_rule", "is_causal", "sliding_window_non_causal"):
        out.pop(key)
    out["rules"] = [_rule_key(r) for r in cfg.layer_rules()]
    out["draft_vocab_size"] = cfg.draft_vocab_size if cfg.reduced_vocab else None
    cap = cfg.final_logit_softcapping
    out["final_logit_softcapping"] = cap if cap is not None and cap > 0 else None
    out["sliding_window"] = cfg.sliding_window if SLIDING in cfg.layer_types else None
    return out


def _describe_rule(kind: str, key: tuple) -> str:
    causal, window, frm = key
    return (f"{kind}: {'causal' if causal else 'bidirectional'}"
            + (f", window {window} from the {frm}" if window is not None else ""))


def _family_refusals(cfg: DrafterConfig, fmt: str) -> list[str]:
    """A SpecForge family's heads, which neither z-lab's nor speculators' format has a place for."""
    if cfg.family == DFLASH:
        return []
    return [f"a {cfg.family} drafter's heads ({'; '.join(cfg.heads())}): {fmt} has no place for them (SpecForge's "
            f"own format keeps them: --to specforge)"]


def _as_specforge(cfg: DrafterConfig) -> tuple[DrafterConfig | None, list[str]]:
    """SpecForge's classes are plain DFlash backbones (plus the family's heads) over the target's
    ``lm_head``, and ``spec_generate`` drafts with ``is_causal=False`` and no attention mask: every
    layer sees every key, so only bidirectional full-attention layers keep their rule."""
    reasons = []
    if cfg.architecture == DFLASH2:
        reasons.append("a DFlash2 drafter (convolutions and a candidate selector): SpecForge's DFlashDraftModel has "
                       "neither")
    if cfg.sample_from_anchor:
        reasons.append("sample_from_anchor: every slot drafts (B drafts per block); SpecForge's block starts with the "
                       "anchor (B - 1 drafts)")
    if cfg.reduced_vocab:
        reasons.append(f"draft_vocab_size {cfg.draft_vocab_size} of {cfg.vocab_size} (lm_head.weight, d2t): SpecForge "
                       f"drafts with the target's lm_head over all {cfg.vocab_size} ids")
    for name, default in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0)):
        if getattr(cfg, name) != default:
            reasons.append(f"{name} {getattr(cfg, name)}: SpecForge's classes have no {name} (z-lab knob)")
    if (cfg.final_logit_softcapping or 0) > 0:
        reasons.append(f"final_logit_softcapping {cfg.final_logit_softcapping}: SpecForge has no logit soft-capping "
                       f"(z-lab knob)")
    for i, (kind, rule) in enumerate(zip(cfg.layer_types, cfg.layer_rules())):
        if rule.window is not None or rule.causal:
            reasons.append(f"layer {i} ({_describe_rule(kind, _rule_key(rule))}): SpecForge's spec_generate drafts with "
                           f"no attention mask (is_causal=False), so every layer attends to every key: field "
                           f"{'sliding_window' if rule.window is not None else 'is_causal'}")
    if reasons:
        return None, reasons
    return replace(cfg, mask_rule=ZLAB, is_causal=None, sliding_window_non_causal=False, draft_vocab_size=None,
                   final_logit_softcapping=None), []


def _as_zlab(cfg: DrafterConfig) -> tuple[DrafterConfig | None, list[str]]:
    want = [_rule_key(r) for r in cfg.layer_rules()]
    reasons = _family_refusals(cfg, "z-lab's format")
    if cfg.sample_from_anchor:
        reasons.append("sample_from_anchor: every slot drafts (slot 0 too, B drafts per block); z-lab's block "
                       "always starts with the anchor (B - 1 drafts)")
    if cfg.reduced_vocab:
        reasons.append(
            f"draft_vocab_size {cfg.draft_vocab_size} of {cfg.vocab_size} (lm_head.weight, d2t): z-lab has no head of "
            f"its own and drafts with the target's lm_head over all {cfg.vocab_size} ids, whose argmax can fall "
            f"outside the draft vocabulary and whose softmax spreads over every id: another drafter, even where the "
            f"head rows are the target's")
    for i, (kind, key) in enumerate(zip(cfg.layer_types, want)):
        if key[1] is not None and key[2] != "query":
            reasons.append(f"layer {i} ({kind}): its window of {key[1]} counts from the anchor (speculators: context "
                           f"c >= p - W, none inside the block); z-lab counts it from the query (|q - k| < W, "
                           f"context and block): field sliding_window")
    if reasons:
        return None, reasons
    for is_causal in dict.fromkeys([cfg.is_causal if cfg.mask_rule == ZLAB else None, None, True, False]):
        candidate = replace(cfg, mask_rule=ZLAB, is_causal=is_causal, sliding_window_non_causal=False)
        if [_rule_key(r) for r in candidate.layer_rules()] == want:
            return candidate, []
    rules = "; ".join(f"layer {i} {_describe_rule(k, r)}" for i, (k, r) in enumerate(zip(cfg.layer_types, want)))
    return None, [(f"layer causality ({rules}): z-lab has one is_causal for all layers (absent: sliding layers causal "
                   f"and full layers bidirectional; true: all causal; false: all bidirectional): field is_causal")]


def _as_speculators(cfg: DrafterConfig) -> tuple[DrafterConfig | None, list[str]]:
    want = [_rule_key(r) for r in cfg.layer_rules()]
    reasons = _family_refusals(cfg, "speculators' format")
    for name, default in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0)):
        if getattr(cfg, name) != default:
            reasons.append(f"{name} {getattr(cfg, name)}: speculators has no {name} (z-lab knob)")
    if (cfg.final_logit_softcapping or 0) > 0:
        reasons.append(f"final_logit_softcapping {cfg.final_logit_softcapping}: speculators has no logit soft-capping "
                       f"(z-lab knob)")
    for i, (kind, key) in enumerate(zip(cfg.layer_types, want)):
        if key[1] is not None and key[2] != "anchor":
            reasons.append(f"layer {i} ({kind}): its window of {key[1]} counts from the query (z-lab: |q - k| < W, "
                           f"context and block); speculators counts it from the anchor (context c >= p - W, none "
                           f"inside the block): field sliding_window")
        elif kind == FULL and key[0]:
            reasons.append(f"layer {i} ({kind}) is causal (is_causal: true); speculators' full layers are always "
                           f"bidirectional: field is_causal")
    if cfg.architecture == DFLASH2 and cfg.conv_kernel_size > cfg.block_size:
        reasons.append(f"conv_kernel_size {cfg.conv_kernel_size} exceeds block_size {cfg.block_size}: speculators "
                       f"refuses a DFlash2 convolution longer than the block")
    if reasons:
        return None, reasons
    default = _DEFAULT_NON_CAUSAL[cfg.architecture]
    prefer = cfg.sliding_window_non_causal if cfg.mask_rule == SPECULATORS else default
    for non_causal in dict.fromkeys([prefer, default, not default]):
        candidate = replace(cfg, mask_rule=SPECULATORS, is_causal=None, sliding_window_non_causal=non_causal,
                            draft_vocab_size=cfg.draft_vocab_size if cfg.reduced_vocab else cfg.vocab_size,
                            final_logit_softcapping=None)
        if [_rule_key(r) for r in candidate.layer_rules()] == want:
            return candidate, []
    rules = "; ".join(f"layer {i} {_describe_rule(k, r)}" for i, (k, r) in enumerate(zip(cfg.layer_types, want)))
    return None, [(f"layer causality ({rules}): speculators has one sliding_window_non_causal for all sliding "
                   f"layers and bidirectional full layers: field sliding_window_non_causal")]


# ----------------------------------------------------------------------------- the source's other keys

@dataclass
class _Carry:
    top: dict = field(default_factory=dict)       # top-level keys without drafting semantics
    layer: dict = field(default_factory=dict)     # layer-config keys without drafting semantics
    dflash: dict = field(default_factory=dict)    # dflash_config keys the exporter does not know
    proposal: dict | None = None                  # speculators_config
    mapped: list[str] = field(default_factory=list)
    not_carried: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)


def _carry(ckpt: DrafterCheckpoint, fmt: str) -> _Carry:
    """Sort every key of the source's config.json: read into the drafter's config (written again
    from it), carried as it is (no drafting semantics), or neither (refused, or left out with why).
    Carried keys go where the target format keeps its layer config: z-lab's top level,
    speculators' ``transformer_layer_config`` (and the generic keys speculators' save writes at its
    top level there too)."""
    raw, c = ckpt.raw, _Carry()
    dflash2 = ckpt.config.architecture == DFLASH2
    if ckpt.format in ZLAB_LAYOUT:
        dcfg = raw.get("dflash_config") or {}
        for key, value in dcfg.items():
            if key in _DFLASH2_VALUES and not dflash2:
                c.not_carried.append(f"dflash_config.{key} (read by DFlash2 only; this drafter is DFlash)")
            elif key == "block_size":
                c.mapped.append("dflash_config.block_size -> block_size at the top level (z-lab reads either)")
            elif key in _SPECFORGE_OWN:
                if fmt != SPECFORGE:       # a plain DFlash drafter's (the families' heads are refused)
                    c.not_carried.append(f"dflash_config.{key} {json.dumps(value)} (SpecForge's family settings; "
                                         f"its spec_generate of a plain DFlash drafter does not read it)")
            elif key in _SPECFORGE_CARRIED:
                if fmt == SPECFORGE:
                    c.dflash[key] = value
                else:
                    c.not_carried.append(f"dflash_config.{key} (a SpecForge training weight; no effect on drafting)")
            elif key not in _DFLASH_VALUES:
                if fmt in ZLAB_LAYOUT:
                    c.dflash[key] = value
                else:
                    c.refusals.append(f"dflash_config.{key}: a key this exporter does not know (speculators has no "
                                      f"place for it, and it may change what the drafter does)")
        for key, value in raw.items():
            if key == "auto_map":
                c.not_carried.append("auto_map (a remote-code hint naming Python files the export does not copy)")
            elif key in _DFLASH2_VALUES and not dflash2:
                c.not_carried.append(f"{key} (read by DFlash2 only; this drafter is DFlash)")
            elif key in _DFLASH_VALUES and key != "block_size" and key not in dcfg:
                c.mapped.append(f"{key}: top level -> {'dflash_config' if fmt in ZLAB_LAYOUT else 'speculators field'} "
                                f"(z-lab reads either place)")
            elif key not in _ZLAB_OWN and key not in _LAYER_OWN:
                if fmt == "speculators" and key in _SPECULATORS_TOP:
                    c.top[key] = value
                if fmt in ZLAB_LAYOUT or key not in ("dtype", "torch_dtype"):
                    c.layer[key] = value
    elif ckpt.format == "speculators":
        layer = raw.get("transformer_layer_config") or {}
        for key, value in layer.items():
            if key in _LAYER_OWN:
                continue
            if (key in _ZLAB_OWN or key == "auto_map") and fmt in ZLAB_LAYOUT:
                c.not_carried.append(f"transformer_layer_config.{key} (speculators does not read it; "
                                     f"{'z-lab' if fmt == ZLAB else 'SpecForge'} would)")
            else:
                c.layer[key] = value
        for key, value in raw.items():
            if key in ("speculators_config", "speculators_version"):
                if fmt == "speculators":
                    if key == "speculators_config":
                        c.proposal = value if isinstance(value, dict) else None
                    else:
                        c.top[key] = value
                elif value is not None:
                    c.not_carried.append(f"{key} (speculators' own record; {fmt} has no place for it)")
            elif key in _DFLASH2_VALUES and not dflash2:
                c.not_carried.append(f"{key} (read by DFlash2 only; this drafter is DFlash)")
            elif key in _SPECULATORS_OWN:
                continue
            elif key in _GENERIC or fmt == "speculators":
                c.top[key] = value
            else:
                c.refusals.append(f"{key}: a speculators field this exporter does not know ({fmt} has no place for "
                                  f"it, and it may change what the drafter does)")
        kind = layer.get("model_type")
        if kind not in (None, "qwen3"):
            c.mapped.append(f"transformer_layer_config.model_type {kind} -> qwen3 (every layer field is written; "
                            f"{fmt} reads its config as a Qwen3Config)")
    if fmt in ZLAB_LAYOUT:
        c.layer = {**c.top, **c.layer}
        c.top = {}
    return c


# ----------------------------------------------------------------------------- plan

def _verifier_facts(verifier: str) -> tuple[str, list[str], int | None]:
    """(name_or_path to record, architectures, decoder layers) of a verifier: a local folder is read
    (and recorded by its absolute path), anything else is recorded as a model id."""
    folder = Path(verifier).expanduser()
    cfg_path = folder / CONFIG_NAME
    if not folder.exists():
        return verifier, [], None
    if not cfg_path.is_file():
        raise CheckpointError(f"verifier {folder}: no {CONFIG_NAME}")
    raw = read_json(cfg_path)
    try:
        text = raw.get("text_config") or raw
        layers = text.get("num_hidden_layers")
        return str(folder.resolve()), list(raw.get("architectures") or []), None if layers is None else int(layers)
    except (OSError, ValueError, AttributeError, TypeError) as e:
        raise CheckpointError(f"{cfg_path}: cannot read the verifier's config ({e})") from None


def plan_export(ckpt: DrafterCheckpoint, fmt: str, verifier: str | None = None,
                num_target_layers: int | None = None) -> Plan:
    """The config an export to ``fmt`` writes, or :class:`ExportRefused` with every reason."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r} ({' or '.join(FORMATS)})")
    cfg = replace(ckpt.config)
    reasons: list[str] = []
    mapped: list[str] = []
    name, architectures, verifier_layers = _verifier_facts(verifier) if verifier else (None, [], None)
    given = num_target_layers if num_target_layers is not None else verifier_layers
    if given is not None:
        if cfg.num_target_layers is not None and int(cfg.num_target_layers) != int(given):
            reasons.append(f"num_target_layers: the checkpoint says {cfg.num_target_layers}, "
                           + (f"--num-target-layers {num_target_layers}" if num_target_layers is not None
                              else f"the verifier {name} has {verifier_layers} layers"))
        elif cfg.num_target_layers is None:
            cfg.num_target_layers = int(given)
            mapped.append(f"num_target_layers {given}: from "
                          + ("--num-target-layers" if num_target_layers is not None else f"the verifier {name}"))
    carry = _carry(ckpt, fmt)
    converted, refusals = {ZLAB: _as_zlab, SPECULATORS: _as_speculators, SPECFORGE: _as_specforge}[fmt](cfg)
    reasons = refusals + carry.refusals + reasons
    if fmt in ZLAB_LAYOUT and cfg.num_target_layers is None:
        reasons.append(f"num_target_layers: not recorded in the source, and {'z-lab' if fmt == ZLAB else 'SpecForge'}'s "
                       f"DFlashDraftModel needs it (it computes a default layer list from it even when "
                       f"target_layer_ids is set): pass --verifier DIR or --num-target-layers N")
    if reasons:
        raise ExportRefused(fmt, reasons)
    if behaviour(converted) != behaviour(cfg):      # the conversions above only choose the format's flags
        raise RuntimeError(f"export to {fmt} would change the drafter: {behaviour(cfg)} -> {behaviour(converted)}")
    mapped += carry.mapped
    if fmt in ZLAB_LAYOUT:
        if fmt == ZLAB:
            raw = zlab_config_dict(converted, base=carry.layer)
            raw["dflash_config"] = {**carry.dflash, **raw["dflash_config"]}
        else:
            raw = specforge_config_dict(converted, base=carry.layer, dflash_base=carry.dflash)
        if ckpt.format == SPECULATORS:
            mapped.append(f"aux_hidden_state_layer_ids {[i + 1 for i in cfg.target_layer_ids]} -> "
                          f"dflash_config.target_layer_ids {cfg.target_layer_ids} (z-lab id = hidden_states index - 1)")
    else:
        proposal = carry.proposal or speculators_proposal_config(converted)
        if verifier:
            proposal = {**proposal, "verifier": {"name_or_path": name, "architectures": architectures}}
        raw = speculators_config_dict(converted, base=carry.top, layer_base=carry.layer, proposal=proposal)
        if ckpt.format != SPECULATORS:
            mapped.append(f"target_layer_ids {cfg.target_layer_ids} -> aux_hidden_state_layer_ids "
                          f"{[i + 1 for i in cfg.target_layer_ids]} (hidden_states index = z-lab id + 1)")
    if ckpt.format != fmt and not {ckpt.format, fmt} <= set(ZLAB_LAYOUT):
        rules = [_describe_rule(k, _rule_key(r)) for k, r in zip(cfg.layer_types, cfg.layer_rules())]
        mapped.append(f"layer rules (unchanged): {rules}"
                      + (f" (is_causal {converted.is_causal})" if fmt == "zlab" and converted.is_causal is not None
                         else f" (sliding_window_non_causal {converted.sliding_window_non_causal})"
                         if fmt == "speculators" and SLIDING in cfg.layer_types else ""))
    rope = (ckpt.raw.get("transformer_layer_config") or {}).get("rope_parameters") if ckpt.format == "speculators" else None
    if isinstance(rope, dict) and ("sliding_attention" in rope or "full_attention" in rope):
        mapped.append(f"rope_parameters per layer type {sorted(rope)} -> {cfg.rope_parameters} for every layer (as "
                      f"speculators builds its rotary embedding)")
    cap = cfg.final_logit_softcapping
    if cap is not None and cap <= 0 and fmt == "speculators":
        mapped.append(f"final_logit_softcapping {cap}: no effect (z-lab caps only when > 0), so none is needed")
    legacy = [k for k in _LEGACY_ROPE if k in ckpt.raw or k in (ckpt.raw.get("transformer_layer_config") or {})]
    if legacy:
        mapped.append(f"{', '.join(legacy)} -> rope_parameters {cfg.rope_parameters} (transformers' standard form)")
    return Plan(source=ckpt, fmt=fmt, config=converted, raw=raw, mapped=mapped,
                not_carried=carry.not_carried)


def export_refusals(ckpt: DrafterCheckpoint, verifier: str | None = None,
                    num_target_layers: int | None = None) -> dict[str, str | None]:
    """Per target format: None when ``ckpt`` can be exported to it, else the reasons (one line).
    Reads only the config (``inspect`` shows it)."""
    out: dict[str, str | None] = {}
    for fmt in FORMATS:
        try:
            plan_export(ckpt, fmt, verifier, num_target_layers)
            out[fmt] = None
        except ExportRefused as e:
            out[fmt] = "; ".join(e.reasons)
        except CheckpointError as e:
            out[fmt] = str(e)
        except Exception as e:  # a report: an unforeseen config must not fail the inspection it is part of
            out[fmt] = f"cannot plan the export ({type(e).__name__}: {e})"
    return out


# ----------------------------------------------------------------------------- writing

def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_record(folder: Path, path: Path) -> dict:
    return {"path": str(path.relative_to(folder)), "size": path.stat().st_size, "sha256": sha256_file(path)}


def _source_files(ckpt: DrafterCheckpoint) -> list[Path]:
    """The files the export read: config.json, the shard index when the weights came through it, the weights."""
    files = [ckpt.path / CONFIG_NAME]
    index = ckpt.path / "model.safetensors.index.json"
    if index.exists():
        shards = set((json.loads(index.read_text()).get("weight_map") or {}).values())
        if {f.name for f in ckpt.weight_files} <= shards:
            files.append(index)
    return files + list(ckpt.weight_files)


def _default_out(ckpt: DrafterCheckpoint, fmt: str) -> Path:
    source = Path(os.path.abspath(ckpt.path))      # `.` or `..` named by where they are
    if not source.name:
        raise DestinationError(f"{source}: no folder beside it to write to: give --out")
    return source.with_name(f"{source.name}.{fmt}")


def _inputs(ckpt: DrafterCheckpoint, verifier: str | None) -> list[tuple[str, Path]]:
    """``(what, resolved path)`` of what the export reads: the source folder and a verifier folder."""
    found = [("source", ckpt.path.resolve())]
    if verifier and Path(verifier).expanduser().exists():
        found.append(("verifier", Path(verifier).expanduser().resolve()))
    return found


def _overlap(path: Path, inputs: list[tuple[str, Path]]) -> str | None:
    """How ``path`` (the entry itself, and where a link there leads) meets one of ``inputs``: it is
    one, contains one or lies inside one; None when it is apart from them all."""
    for where in dict.fromkeys([path.parent.resolve() / path.name, path.resolve()]):
        for what, folder in inputs:
            if where == folder:
                return f"is the {what} {folder}"
            if where in folder.parents:
                return f"contains the {what} {folder}"
            if folder in where.parents:
                return f"lies inside the {what} {folder}"
    return None


def _check_written(folder: Path, plan: Plan, tensors: dict) -> None:
    """Read the temporary folder back as any checkpoint is read: the format, the behaviour and every
    tensor (bit for bit, same dtype) must be what the plan meant to write."""
    import torch

    back = open_checkpoint(folder)
    if back.format != plan.fmt:
        raise CheckpointError(f"{folder}: written as {plan.fmt} but read back as {back.format}")
    if behaviour(back.config) != behaviour(plan.config):
        diff = {k: (v, behaviour(plan.config)[k]) for k, v in behaviour(back.config).items()
                if behaviour(plan.config)[k] != v}
        raise CheckpointError(f"{folder}: the config read back differs from the one meant: {diff}")
    got = read_tensors(back)
    if set(got) != set(tensors):
        raise CheckpointError(f"{folder}: tensors read back {sorted(set(got) ^ set(tensors))} differ from those written")
    for name, t in tensors.items():      # as bytes: a NaN written is a NaN read (NaN != NaN as a float)
        if got[name].dtype != t.dtype or got[name].shape != t.shape or \
                not torch.equal(_bytes(got[name]), _bytes(t)):
            raise CheckpointError(f"{folder}: tensor {name} read back differs from the one written")


def _bytes(t):
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def export(src: str | Path, fmt: str, out: str | Path | None = None, force: bool = False,
           verifier: str | None = None, num_target_layers: int | None = None) -> dict:
    """Export ``src`` to ``fmt`` (see the module docstring); returns the result dict printed by
    :func:`main`. Raises :class:`ExportRefused`, :class:`CheckpointError`, :class:`DestinationError`."""
    ckpt = open_checkpoint(src)
    problems = completeness_problems(ckpt.path)
    if problems:
        raise CheckpointError("; ".join(problems))
    plan = plan_export(ckpt, fmt, verifier, num_target_layers)
    dest = Path(os.path.abspath(Path(out).expanduser())) if out is not None else _default_out(ckpt, fmt)
    source = ckpt.path.resolve()
    inputs = _inputs(ckpt, verifier)
    overlap = _overlap(dest, inputs)
    if overlap:
        raise DestinationError(f"{dest}: the destination {overlap}, which the export reads: it is never replaced "
                               f"or written into, --force or not")
    if not dest.name:
        raise DestinationError(f"{dest}: not a folder to write")
    _remove_stale_temporaries(dest, inputs)
    if dest.exists() and not force:
        raise DestinationError(f"{dest} exists (--force replaces it)")
    if not dest.parent.is_dir():
        raise DestinationError(f"{dest.parent}: no such folder")

    tensors = read_tensors(ckpt)
    kept, ignored = check_tensors(ckpt, {k: tuple(v.shape) for k, v in tensors.items()})
    if plan.config.reduced_vocab:
        check_vocab_maps(ckpt, tensors["d2t"], tensors["t2d"])
    weights = {name: tensors[name].contiguous() for name in kept}
    not_carried = list(plan.not_carried)
    if ignored:
        not_carried.append(f"tensors {ignored} (the target's, or buffers: the drafter uses the target's embedding "
                           f"and, with a full vocabulary, its lm_head)")
    renamed = _renamed_tensors(ckpt, set(kept))
    mapped = list(plan.mapped)
    if renamed:
        mapped.append(f"tensor names: {', '.join(renamed)}")
    if len(ckpt.weight_files) > 1:
        mapped.append(f"{len(ckpt.weight_files)} weight files -> one {WEIGHTS_NAME}")

    tmp = dest.with_name(f".{dest.name}.export-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _save_weights(weights, tmp / WEIGHTS_NAME)
        (tmp / CONFIG_NAME).write_text(json.dumps(plan.raw, indent=2, sort_keys=True) + "\n")
        _check_written(tmp, plan, weights)
        files = [_file_record(tmp, tmp / CONFIG_NAME), _file_record(tmp, tmp / WEIGHTS_NAME)]
        note = {"tool": "dflash-ops export", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "source": {"path": str(source), "format": ckpt.format,
                           "files": [_file_record(ckpt.path, f) for f in _source_files(ckpt)]},
                "format": fmt, "files": files, "mapped": mapped, "not_carried": not_carried}
        (tmp / NOTE_NAME).write_text(json.dumps(note, indent=2) + "\n")
        for name in (WEIGHTS_NAME, CONFIG_NAME, NOTE_NAME):
            _fsync(tmp / name)
        _fsync(tmp)
        _replace(tmp, dest, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"ok": True, "source": str(source), "source_format": ckpt.format, "format": fmt, "out": str(dest),
            "files": files, "note": NOTE_NAME, "mapped": mapped, "not_carried": not_carried}


def _save_weights(weights: dict, path: Path) -> None:
    """safetensors' ``save_file``; its I/O failures (a full disk) are raised as the OSError they are."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(weights, str(path), metadata={"format": "pt"})
    except SafetensorError as e:
        raise OSError(None, str(e), str(path)) from None


def _renamed_tensors(ckpt: DrafterCheckpoint, kept: set[str]) -> list[str]:
    """``stored -> written`` for every kept tensor whose stored name :func:`read_tensors` normalised
    (:func:`~remote.drafters.checkpoint.tensor_name`)."""
    import torch
    from safetensors import safe_open

    from remote.drafters.checkpoint import _unnest

    stored: list[str] = []
    for f in ckpt.weight_files:
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as h:
                stored += list(h.keys())
        else:
            sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            stored += [k for k, v in _unnest(sd).items() if hasattr(v, "shape")]
    names = {k: tensor_name(ckpt.config, k) for k in stored}
    return sorted(f"{k} -> {name}" for k, name in names.items() if name != k and name in kept)


def _remove_stale_temporaries(dest: Path, inputs: list[tuple[str, Path]]) -> None:
    """What exports to ``dest`` killed mid-way left (their process is gone; never an input): the
    temporary folder of a write; the old destination a ``--force`` had moved aside, put back where
    the new one never arrived, else removed as that export would have."""
    for kind in ("export", "replaced"):
        for left in sorted(dest.parent.glob(f".{dest.name}.{kind}-*")):
            try:
                pid = int(left.name.rsplit("-", 1)[1])
            except ValueError:
                continue
            if alive(pid) or _overlap(left, inputs):
                continue
            if kind == "replaced" and not (dest.exists() or dest.is_symlink()):
                os.rename(left, dest)
            elif left.is_dir() and not left.is_symlink():
                shutil.rmtree(left, ignore_errors=True)
            else:
                left.unlink(missing_ok=True)


def _replace(tmp: Path, dest: Path, force: bool) -> None:
    """Rename ``tmp`` to ``dest``; with ``force`` an existing ``dest`` is moved aside first and removed
    once the new folder is in place (restored if the rename fails). The parent is fsynced."""
    old = None
    if dest.exists() or dest.is_symlink():
        if not force:
            raise DestinationError(f"{dest} appeared while exporting")
        old = dest.with_name(f".{dest.name}.replaced-{os.getpid()}")
        os.rename(dest, old)
    try:
        os.rename(tmp, dest)
    except BaseException:
        if old is not None:
            os.rename(old, dest)
        raise
    _fsync(dest.parent)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()
