"""Drafter checkpoints: detect the format, normalise the config, check and load the tensors.

Formats
* ``zlab`` — z-lab ``dflash`` / Hugging Face: ``config.json`` (a Qwen3Config plus ``dflash_config:
  {mask_token_id, target_layer_ids, ...}``, ``block_size`` at the top level or in ``dflash_config``;
  ``architectures`` names ``DFlashDraftModel`` or ``DFlash2DraftModel``) and ``model.safetensors``
  (or a sharded index) with bare key names (``fc.weight``, ``layers.0...``). Values are read as z-lab
  reads them: ``dflash_config[name]`` first, then the config attribute, then z-lab's default.
* ``specforge`` — SpecForge's DFlash family (``specforge.modeling.draft``): the z-lab layout with
  ``dflash_config.projector_type`` naming the family's head (``domino``: ``emb_dim``,
  ``gru_hidden_dim``; ``dspark``: ``markov_rank``, ``markov_head_type``, ``enable_confidence_head``
  or ``confidence_head_alpha`` > 0, ``confidence_head_with_markov``, ``attention_mode``), optional
  ``pure_draft_prefix_len`` and ``shift_label``, ``architectures`` ``DominoDraftModel`` /
  ``DSparkDraftModel`` (or ``DFlashDraftModel``); the heads' tensors ``prefix_gru.*``,
  ``embed_proj.*``, ``markov_head.*``, ``confidence_head.*`` (early checkpoints: under
  ``logit_head.``). A plain DFlash written by SpecForge without these keys is a z-lab checkpoint.
* ``speculators`` — vLLM speculators (``speculators_model_type: dflash | dflash2``), the layer config
  under ``transformer_layer_config``, ``aux_hidden_state_layer_ids`` index HF ``hidden_states`` and
  are therefore the z-lab ids **+ 1** (converted here, once); speculators' defaults
  (``draft_vocab_size`` 32000, ``block_size`` 8, ``sliding_window_non_causal`` False for DFlash and
  True for DFlash2). A reduced draft vocabulary brings ``lm_head.weight``, ``d2t`` and ``t2d``.
* ``state_dict`` — what an in-house training run saves: a ``.pt``/``.bin``/``.safetensors`` state
  dict (possibly nested under ``model``/``state_dict``, keys prefixed ``module.``/``model.``/
  ``_orig_mod.``) plus a small flat ``config.json`` whose keys are :class:`DrafterConfig` fields.
"""
from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from remote.contract.formats import SPECFORGE
from remote.drafters.config import (ATTENTION_MODES, DFLASH, DFLASH2, DOMINO, DSPARK, FULL, MARKOV_HEADS, SIZE_LIMITS,
                                     SLIDING, SPECULATORS, ZLAB, DrafterConfig, raw_size_problems)

CONFIG_NAME = "config.json"
WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")
STRIP_PREFIXES = ("_orig_mod.", "module.", "model.", "draft_model.", "drafter.")
# Tensors some trainers save next to the drafter that belong to the target (or are buffers).
IGNORABLE = ("embed_tokens.weight", "lm_head.weight", "rotary_emb.inv_freq", "verifier_lm_head.weight",
             "verifier_norm.weight", "t2d", "d2t")


class CheckpointError(ValueError):
    """A drafter checkpoint that cannot be used; the message names the cause."""


@dataclass
class DrafterCheckpoint:
    path: Path
    format: str                      # zlab | speculators | state_dict
    config: DrafterConfig
    weight_files: list[Path]
    notes: list[str] = field(default_factory=list)
    raw: dict = field(default_factory=dict)   # config.json as read

    def describe(self) -> dict:
        c = self.config
        return {"path": str(self.path), "format": self.format, "block_size": c.block_size,
                "target_layer_ids": c.target_layer_ids, "mask_token_id": c.mask_token_id,
                "num_hidden_layers": c.num_hidden_layers, "hidden_size": c.hidden_size,
                "vocab_size": c.vocab_size, "num_target_layers": c.num_target_layers,
                "layer_types": c.layer_types, "sliding_window": c.sliding_window,
                "variant": c.describe_rules(),
                "weight_files": [p.name for p in self.weight_files], "notes": self.notes}


# ----------------------------------------------------------------------------- config

# speculators model types that are not DFlash block drafters (or are DFlash derivatives this worker
# does not implement): refused by name.
SPECULATORS_REFUSED = {
    "xpress": "XPress (a DFlash drafter plus a causal refiner head resolved by Jacobi passes)",
    "dspark": "DSpark (a DFlash drafter plus Markov and confidence heads)",
    "eagle3": "EAGLE-3 (an autoregressive drafter, not a block drafter)",
    "peagle": "P-EAGLE (an autoregressive drafter, not a block drafter)",
    "mtp": "MTP (multi-token prediction heads, not a block drafter)",
}
ZLAB_ARCHITECTURES = {"DFlashDraftModel": DFLASH, "DFlash2DraftModel": DFLASH2}
# SpecForge's classes by the family they draft (``architectures``) and the keys its dflash_config adds
SPECFORGE_ARCHITECTURES = {"DominoDraftModel": DOMINO, "DSparkDraftModel": DSPARK}
SPECFORGE_CLASSES = {DFLASH: "DFlashDraftModel", **{family: cls for cls, family in SPECFORGE_ARCHITECTURES.items()}}
# early SpecForge checkpoints keep the families' heads under a ``logit_head.`` container
LEGACY_HEAD_PREFIX = "logit_head."


# A checkpoint's JSON files (config, shard index, sync manifest) are read whole: bounded in size and depth.
MAX_JSON_BYTES = 64 << 20
MAX_JSON_DEPTH = 32
_SPECIAL_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                  (stat.S_ISSOCK, "a socket"))


def _special_kind(mode: int) -> str | None:
    """What a file that is neither a regular file nor a folder is (opening or reading one can block or
    never end), else None."""
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return next((kind for test, kind in _SPECIAL_KINDS if test(mode)), "not a regular file")


def special_files(folder: str | Path) -> list[str]:
    """Every entry under ``folder`` (a link: what it points to) that is not a regular file or a
    folder, as ``name (kind)``; nothing is opened."""
    root = Path(folder).expanduser()
    out = []
    for top, dirs, names in os.walk(root):
        dirs.sort()
        for name in sorted(names):
            path = Path(top, name)
            try:
                kind = _special_kind(path.stat().st_mode)
            except OSError:        # a dangling link: nothing to read
                continue
            if kind:
                shown = path.relative_to(root).as_posix()
                out.append(f"{shown} -> {os.readlink(path)} ({kind})" if path.is_symlink() else f"{shown} ({kind})")
    return out


def refuse_special_files(folder: str | Path, what: str) -> None:
    """:class:`CheckpointError` naming the entries of :func:`special_files`, before anything is read."""
    found = special_files(folder)
    if found:
        raise CheckpointError(f"{folder}: the {what} folder holds what is not a regular file, never read: "
                              f"{_short(found)}")


def read_json(path: Path) -> dict:
    """A JSON object from a checkpoint folder: a regular file of at most :data:`MAX_JSON_BYTES`,
    nested at most :data:`MAX_JSON_DEPTH` deep."""
    try:
        st = path.stat()
        kind = _special_kind(st.st_mode)
        if kind:
            raise CheckpointError(f"{path}: {kind}, not a regular file: never read")
        if st.st_size > MAX_JSON_BYTES:
            raise CheckpointError(f"{path}: {st.st_size} bytes, more than any config ({MAX_JSON_BYTES} at most)")
        data = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: nested deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    deep = _deeper_than(data, MAX_JSON_DEPTH)
    if deep:
        raise CheckpointError(f"{path}: field {deep!r} is nested deeper than {MAX_JSON_DEPTH} levels")
    return data


def _deeper_than(data, limit: int) -> str | None:
    """The first top-level key under which ``data`` nests more than ``limit`` levels (no recursion)."""
    stack = [(data, 1, None)]
    while stack:
        value, depth, key = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > limit:
                return key
            items = value.items() if isinstance(value, dict) else ((key, v) for v in value)
            stack += [(v, depth + 1, k if key is None else key) for k, v in items]
    return None


# Positive numbers by name wherever they are in a config (a layer config, rope_parameters, text_config).
_POSITIVE = ("rms_norm_eps", "layer_norm_eps", "norm_eps", "layer_norm_epsilon", "rope_theta")


def number_problem(raw: dict) -> str | None:
    """The first number of a config that no model computes with: NaN or an infinity anywhere, an
    epsilon or a RoPE base (:data:`_POSITIVE`) that is not positive; None when there is none."""
    stack = [(raw, [])]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            stack += [(v, [*path, str(k)]) for k, v in reversed(value.items())]
        elif isinstance(value, list):
            stack += [(v, [*path, str(i)]) for i, v in reversed(list(enumerate(value)))]
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and path:
            name, section = path[-1], ".".join(path[:-1])
            field_ = f"field {name!r}" + (f" in {section}" if section else "")
            if isinstance(value, float) and not math.isfinite(value):
                return f"{field_} must be a finite number, got {json.dumps(value)}"
            if name in _POSITIVE and not value > 0:
                return f"{field_} must be a positive number, got {json.dumps(value)}"
    return None


# The fields this module reads itself, with the JSON type each must have (transformers checks the
# fields of its own config classes). A null counts as absent only where the reader allows it.
INT, NUM, BOOL, STR, INTS, STRS, OBJ = ("an integer", "a number", "true or false", "a string",
                                        "a list of integers", "a list of strings", "an object")
_DFLASH_FIELDS = {"mask_token_id": INT, "target_layer_ids": INTS, "block_size": INT, "input_embedding_scale": NUM,
                  "output_multiplier": NUM, "final_logit_softcapping": NUM, "conv_kernel_size": INT,
                  "conv_group_size": INT, "selector_rank": INT, "selector_top_k": INT}
_SPECFORGE_FIELDS = {"projector_type": STR, "pure_draft_prefix_len": INT, "shift_label": BOOL, "emb_dim": INT,
                     "gru_hidden_dim": INT, "markov_rank": INT, "markov_head_type": STR, "enable_confidence_head": BOOL,
                     "confidence_head_alpha": NUM, "confidence_head_with_markov": BOOL, "attention_mode": STR}
_ZLAB_FIELDS = {**_DFLASH_FIELDS, "architectures": STRS, "vocab_size": INT, "num_target_layers": INT,
                "target_hidden_size": INT, "dflash_config": OBJ, "is_causal": BOOL}
_SPECULATORS_FIELDS = {**_DFLASH_FIELDS, "speculators_model_type": STR, "transformer_layer_config": OBJ,
                       "aux_hidden_state_layer_ids": INTS, "draft_vocab_size": INT, "num_target_layers": INT,
                       "target_hidden_size": INT, "sliding_window_non_causal": BOOL, "sample_from_anchor": BOOL}
_NULLABLE = {"projector_type", "final_logit_softcapping", "num_target_layers", "target_hidden_size", "is_causal", "sliding_window",
             "draft_vocab_size", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"}
_ANNOTATION_KINDS = {"int": INT, "float": NUM, "bool": BOOL, "str": STR, "list[int]": INTS, "list[str]": STRS,
                     "dict": OBJ}


def _is_kind(value, kind: str) -> bool:
    integer = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    return {INT: integer, NUM: lambda v: integer(v) or isinstance(v, float), BOOL: lambda v: isinstance(v, bool),
            STR: lambda v: isinstance(v, str), OBJ: lambda v: isinstance(v, dict),
            INTS: lambda v: isinstance(v, list) and all(map(integer, v)),
            STRS: lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)}[kind](value)


def _check_types(raw: dict, kinds: dict[str, str], where: str, section: str | None = None) -> None:
    """Refuse a field of ``raw`` whose JSON type is not ``kinds[field]``, naming the file and the field."""
    for name, kind in kinds.items():
        value = raw.get(name)
        if name not in raw or (value is None and name in _NULLABLE) or _is_kind(value, kind):
            continue
        shown = json.dumps(value)
        raise CheckpointError(f"{where}: field {name!r}{f' in {section}' if section else ''} must be {kind}, "
                              f"got {shown if len(shown) <= 60 else shown[:57] + '...'}")


def _flat_kinds() -> dict[str, str]:
    kinds = {}
    for f in fields(DrafterConfig):
        base = str(f.type).replace(" | None", "")
        if base in _ANNOTATION_KINDS:
            kinds[f.name] = _ANNOTATION_KINDS[base]
            if "None" in str(f.type):
                _NULLABLE.add(f.name)
    return {**kinds, "rope_theta": NUM}


def check_config_types(raw: dict, fmt: str, where: str) -> None:
    """The JSON types of the fields the ``fmt`` reader takes from ``raw`` (see the kinds above)."""
    if fmt in ("zlab", SPECFORGE):
        _check_types(raw, _ZLAB_FIELDS, where)
        _check_types(raw.get("dflash_config") or {}, {**_DFLASH_FIELDS, **_SPECFORGE_FIELDS}, where, "dflash_config")
    elif fmt == "speculators":
        _check_types(raw, _SPECULATORS_FIELDS, where)
    else:
        _check_types(raw, _flat_kinds(), where)


def _require(value, name: str, where: str):
    if value is None:
        hint = (" (z-lab would guess round(1 + i*(T-4)/(L-1)), which is usually not what the drafter "
                "was trained with; write the ids into the config)") if name == "target_layer_ids" else ""
        raise CheckpointError(f"{where}: missing {name}{hint}")
    return value


def _transformers_config(raw: dict, where: str, auto: bool):
    """The drafter's layer config as the reference reads it: z-lab through ``Qwen3Config``
    (its ``config_class``), speculators through the class of the config's ``model_type``. Defaults,
    ``use_sliding_window`` and RoPE standardisation are transformers' own."""
    from transformers import AutoConfig, Qwen3Config

    try:
        if auto and raw.get("model_type"):
            return AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
        return Qwen3Config.from_dict(raw)
    except Exception as e:  # strict dataclass validation, unknown model_type, ...
        raise CheckpointError(f"{where}: transformers cannot read this config ({type(e).__name__}: {e})") from None


def _layer_fields(hf, where: str, flatten_rope: bool) -> dict:
    """DrafterConfig fields read from a transformers config the way the references read them."""
    heads = int(hf.num_attention_heads)
    rope = dict(getattr(hf, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    if "sliding_attention" in rope or "full_attention" in rope:
        if not flatten_rope:
            raise CheckpointError(f"{where}: per-layer-type rope_parameters {sorted(rope)}: z-lab's drafter builds "
                                  f"one Qwen3RotaryEmbedding from the config and cannot use them")
        rope = dict(rope.get("sliding_attention") or rope["full_attention"])   # speculators' flatten_rope_parameters
    layers = int(hf.num_hidden_layers)
    return {"hidden_size": int(hf.hidden_size), "intermediate_size": int(hf.intermediate_size),
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": int(getattr(hf, "num_key_value_heads", None) or heads),
            "head_dim": int(getattr(hf, "head_dim", None) or int(hf.hidden_size) // heads),
            "rms_norm_eps": float(hf.rms_norm_eps), "hidden_act": str(getattr(hf, "hidden_act", "silu")),
            "attention_bias": bool(getattr(hf, "attention_bias", False)), "rope_parameters": rope,
            "max_position_embeddings": int(getattr(hf, "max_position_embeddings", 32768)),
            "layer_types": list(getattr(hf, "layer_types", None) or [FULL] * layers),
            "sliding_window": getattr(hf, "sliding_window", None)}


def _zlab_value(hf, name: str, default=None):
    """z-lab's ``_draft_value``: ``dflash_config[name]``, else the config attribute, else the default."""
    return (getattr(hf, "dflash_config", None) or {}).get(name, getattr(hf, name, default))


def _family_fields(raw: dict, dcfg: dict, where: str) -> dict:
    """SpecForge's family and its heads' settings (module docstring), read as SpecForge's classes
    read them; a family named twice two ways, an unknown one, a setting out of its range: refused."""
    archs = [SPECFORGE_ARCHITECTURES[a] for a in architectures(raw) if a in SPECFORGE_ARCHITECTURES]
    projector = dcfg.get("projector_type")
    if projector is not None and projector not in (DFLASH, DOMINO, DSPARK):
        raise CheckpointError(f"{where}: dflash_config.projector_type {projector!r} is not a family this worker "
                              f"knows (dflash, domino, dspark)")
    family = archs[0] if archs else projector or DFLASH
    if projector not in (None, family):
        raise CheckpointError(f"{where}: architectures name a {family} drafter but dflash_config.projector_type is "
                              f"{projector!r}")
    out: dict = {"family": family, "pure_draft_prefix_len": int(dcfg.get("pure_draft_prefix_len", 0) or 0),
                 "shift_label": bool(dcfg.get("shift_label", False))}
    if family == DOMINO:
        for name in ("emb_dim", "gru_hidden_dim"):
            out[name] = int(_require(dcfg.get(name), f"dflash_config.{name}", where))
    if family == DSPARK:
        head = str(dcfg.get("markov_head_type", "vanilla")).lower()
        if head not in MARKOV_HEADS:
            raise CheckpointError(f"{where}: dflash_config.markov_head_type {dcfg.get('markov_head_type')!r} is not a "
                                  f"DSpark Markov head ({', '.join(MARKOV_HEADS)})")
        mode = str(dcfg.get("attention_mode", "gqa")).lower()
        if mode not in ATTENTION_MODES:
            raise CheckpointError(f"{where}: dflash_config.attention_mode {dcfg.get('attention_mode')!r} is not one of "
                                  f"{', '.join(ATTENTION_MODES)}")
        alpha = float(dcfg.get("confidence_head_alpha", 0.0) or 0.0)
        out.update(markov_rank=int(dcfg.get("markov_rank", 0) or 0), markov_head_type=head, attention_mode=mode,
                   confidence_head=bool(dcfg.get("enable_confidence_head", alpha > 0.0)),
                   confidence_head_with_markov=bool(dcfg.get("confidence_head_with_markov", False)))
    foreign = sorted(set(dcfg) & ({"markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_alpha",
                                   "confidence_head_with_markov", "attention_mode"} if family != DSPARK else set())
                     | set(dcfg) & ({"emb_dim", "gru_hidden_dim"} if family != DOMINO else set()))
    if foreign:
        raise CheckpointError(f"{where}: dflash_config sets {', '.join(foreign)} but the drafter is a {family} drafter, "
                              f"which has no such head")
    return out


def _zlab_config(raw: dict, where: str) -> DrafterConfig:
    supported = {**ZLAB_ARCHITECTURES, **SPECFORGE_ARCHITECTURES}
    known = [a for a in architectures(raw) if a in supported]
    unknown = [a for a in architectures(raw) if ("dflash" in a.lower() or a.endswith("DraftModel"))
               and a not in supported]
    if unknown and not known:
        raise CheckpointError(f"{where}: drafter architecture {unknown[0]!r} is not supported "
                              f"(supported: {', '.join(supported)})")
    architecture = DFLASH2 if "DFlash2DraftModel" in known else DFLASH
    hf = _transformers_config(raw, where, auto=False)
    dcfg = raw.get("dflash_config") or {}
    strange = sorted(set(dcfg) - set(_DFLASH_FIELDS) - set(_SPECFORGE_FIELDS) - {"block_size"})
    if strange:
        raise CheckpointError(f"{where}: dflash_config keys this worker does not know: {', '.join(strange)} "
                              f"(known: {', '.join(sorted({*_DFLASH_FIELDS, *_SPECFORGE_FIELDS}))})")
    top, inner = raw.get("block_size"), dcfg.get("block_size")
    if top is not None and inner is not None and int(top) != int(inner):
        raise CheckpointError(f"{where}: block size mismatch: block_size={top} at the top level but "
                              f"dflash_config.block_size={inner}")
    extra = {}
    if architecture == DFLASH2:
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            extra[name] = int(_require(_zlab_value(hf, name), name, where))
    extra.update(_family_fields(raw, dcfg, where))
    softcap = _zlab_value(hf, "final_logit_softcapping")
    is_causal = getattr(hf, "is_causal", None)
    return DrafterConfig(
        **_layer_fields(hf, where, flatten_rope=False), **extra, architecture=architecture, mask_rule=ZLAB,
        target_layer_ids=_require(_zlab_value(hf, "target_layer_ids"), "target_layer_ids", where),
        mask_token_id=int(_require(_zlab_value(hf, "mask_token_id"), "mask_token_id", where)),
        vocab_size=int(_require(raw.get("vocab_size"), "vocab_size", where)),
        block_size=int(_zlab_value(hf, "block_size", 16)),
        num_target_layers=raw.get("num_target_layers"), target_hidden_size=raw.get("target_hidden_size"),
        is_causal=None if is_causal is None else bool(is_causal),
        input_embedding_scale=float(_zlab_value(hf, "input_embedding_scale", 1.0)),
        output_multiplier=float(_zlab_value(hf, "output_multiplier", 1.0)),
        final_logit_softcapping=None if softcap is None else float(softcap))


def _speculators_config(raw: dict, where: str) -> DrafterConfig:
    kind = raw.get("speculators_model_type") or "dflash"
    if kind in SPECULATORS_REFUSED:
        raise CheckpointError(f"{where}: speculators model type {kind!r} is {SPECULATORS_REFUSED[kind]}; this worker "
                              f"evaluates DFlash and DFlash2 drafters only")
    if kind not in (DFLASH, DFLASH2):
        raise CheckpointError(f"{where}: unknown speculators model type {kind!r} (supported: dflash, dflash2)")
    layer_raw = raw.get("transformer_layer_config")
    if not isinstance(layer_raw, dict):
        raise CheckpointError(f"{where}: speculators config without transformer_layer_config")
    sub = f"{where} (transformer_layer_config)"
    hf = _transformers_config(layer_raw, sub, auto=True)
    aux = _require(raw.get("aux_hidden_state_layer_ids"), "aux_hidden_state_layer_ids", where)
    vocab = int(_require(getattr(hf, "vocab_size", None), "vocab_size", sub))
    extra = {}
    if kind == DFLASH2:   # DFlash2SpeculatorConfig's defaults
        extra = {"conv_kernel_size": int(raw.get("conv_kernel_size", 2)), "conv_group_size": int(raw.get("conv_group_size", 16)),
                 "selector_rank": int(raw.get("selector_rank", 256)), "selector_top_k": int(raw.get("selector_top_k", 16))}
    return DrafterConfig(
        **_layer_fields(hf, sub, flatten_rope=True), **extra, architecture=kind, mask_rule=SPECULATORS,
        target_layer_ids=[int(i) - 1 for i in aux],  # speculators index hidden_states: z-lab id + 1
        mask_token_id=int(_require(raw.get("mask_token_id"), "mask_token_id", where)),
        vocab_size=vocab, block_size=int(raw.get("block_size", 8)),
        num_target_layers=raw.get("num_target_layers"), target_hidden_size=raw.get("target_hidden_size"),
        draft_vocab_size=int(raw.get("draft_vocab_size", 32000)),
        sliding_window_non_causal=bool(raw.get("sliding_window_non_causal", kind == DFLASH2)),
        sample_from_anchor=bool(raw.get("sample_from_anchor", False)))


def _flat_config(raw: dict, where: str) -> DrafterConfig:
    raw = dict(raw)
    if "rope_theta" in raw:   # configs written before rope_parameters
        raw["rope_parameters"] = {"rope_type": "default", "rope_theta": float(raw.pop("rope_theta"))}
    known = {f.name for f in fields(DrafterConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise CheckpointError(f"{where}: unknown drafter config keys {unknown}")
    try:
        return DrafterConfig(**raw)
    except TypeError as e:
        raise CheckpointError(f"{where}: {e}") from None


def validate_config(cfg: DrafterConfig, where: str) -> None:
    """Refuse, by name, every setting the drafter cannot honour."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    sizes = cfg.size_problems()
    if sizes:
        raise CheckpointError(f"{where}: {'; '.join(sizes)} (a size no drafter has)")
    if len(cfg.layer_types) != cfg.num_hidden_layers:
        raise CheckpointError(f"{where}: layer_types has {len(cfg.layer_types)} entries for "
                              f"{cfg.num_hidden_layers} layers")
    odd = sorted(set(cfg.layer_types) - {FULL, SLIDING})
    if odd:
        raise CheckpointError(f"{where}: unsupported drafter layer types {odd} (supported: {FULL}, {SLIDING})")
    if SLIDING in cfg.layer_types and not cfg.sliding_window:
        raise CheckpointError(f"{where}: sliding_attention layers but no sliding_window (transformers' Qwen3Config "
                              f"drops sliding_window unless use_sliding_window is true)")
    if SLIDING not in cfg.layer_types:
        cfg.sliding_window = None
    if cfg.mask_rule not in (ZLAB, SPECULATORS):
        raise CheckpointError(f"{where}: unknown mask_rule {cfg.mask_rule!r} (zlab or speculators)")
    kind = cfg.rope_parameters.get("rope_type", "default")
    if kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
        raise CheckpointError(f"{where}: RoPE type {kind!r} is not one transformers knows "
                              f"(default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))})")
    theta = cfg.rope_parameters.get("rope_theta")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
        raise CheckpointError(f"{where}: field 'rope_theta' (or rope_parameters.rope_theta) must be a positive "
                              f"number, got {json.dumps(theta)[:60]}")
    if not 0 < cfg.rms_norm_eps < math.inf:
        raise CheckpointError(f"{where}: field 'rms_norm_eps' must be a positive number, got {cfg.rms_norm_eps}")
    for name in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping"):
        value = getattr(cfg, name)
        if value is not None and not math.isfinite(value):
            raise CheckpointError(f"{where}: field {name!r} must be a finite number, got {value}")
    from transformers.activations import ACT2FN
    if cfg.hidden_act not in ACT2FN:
        raise CheckpointError(f"{where}: field 'hidden_act' {cfg.hidden_act!r} is not an activation transformers "
                              f"knows ({', '.join(sorted(ACT2FN))})")
    try:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
        Qwen3RotaryEmbedding(cfg.transformers_config())
    except Exception as e:  # a RoPE type without its required parameters
        raise CheckpointError(f"{where}: transformers cannot build this RoPE ({kind}: {type(e).__name__}: {e})") from None
    if cfg.block_size < 2:
        raise CheckpointError(f"{where}: block_size {cfg.block_size}: a DFlash block needs at least 2 slots")

    if cfg.architecture not in (DFLASH, DFLASH2):
        raise CheckpointError(f"{where}: unknown architecture {cfg.architecture!r} (dflash or dflash2)")
    if cfg.architecture == DFLASH2:
        if cfg.reduced_vocab:
            raise CheckpointError(f"{where}: a DFlash2 drafter with a reduced draft vocabulary ({cfg.draft_vocab_size} "
                                  f"of {cfg.vocab_size}) is not supported (speculators refuses it too: the candidate "
                                  f"selector's codebooks cover the full vocabulary)")
        if cfg.hidden_size % cfg.conv_group_size:
            raise CheckpointError(f"{where}: DFlash2 conv_group_size {cfg.conv_group_size} does not divide hidden_size "
                                  f"{cfg.hidden_size}")
        if cfg.selector_top_k > cfg.vocab_size:
            raise CheckpointError(f"{where}: DFlash2 selector_top_k {cfg.selector_top_k} exceeds the vocabulary "
                                  f"({cfg.vocab_size})")
        if cfg.mask_rule == SPECULATORS and cfg.conv_kernel_size > cfg.block_size:
            raise CheckpointError(f"{where}: DFlash2 conv_kernel_size {cfg.conv_kernel_size} exceeds block_size "
                                  f"{cfg.block_size} (speculators refuses it)")
    _validate_family(cfg, where)


def _validate_family(cfg: DrafterConfig, where: str) -> None:
    """SpecForge's own refusals for its families (their classes' ``__init__``), each by name."""
    if cfg.family not in (DFLASH, DOMINO, DSPARK):
        raise CheckpointError(f"{where}: unknown drafter family {cfg.family!r} (dflash, domino or dspark)")
    if cfg.family == DFLASH:
        return
    if cfg.architecture != DFLASH or cfg.mask_rule != ZLAB or cfg.reduced_vocab or cfg.sample_from_anchor:
        raise CheckpointError(f"{where}: a {cfg.family} drafter is SpecForge's DFlash backbone with its head; this one "
                              f"also asks for {cfg.architecture} / {cfg.mask_rule} mask rules / a reduced vocabulary, "
                              f"which SpecForge's class has not")
    if not 0 <= cfg.pure_draft_prefix_len < cfg.block_size:
        raise CheckpointError(f"{where}: pure_draft_prefix_len {cfg.pure_draft_prefix_len} is outside "
                              f"0..{cfg.block_size - 1} (the block's draft slots)")
    if cfg.family == DOMINO:
        for name in ("emb_dim", "gru_hidden_dim"):
            if not 1 <= getattr(cfg, name) <= SIZE_LIMITS["hidden_size"]:
                raise CheckpointError(f"{where}: Domino {name} {getattr(cfg, name)} is outside "
                                      f"1..{SIZE_LIMITS['hidden_size']}")
        return
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads % kv:
        raise CheckpointError(f"{where}: DSpark needs num_key_value_heads ({kv}) to divide num_attention_heads "
                              f"({heads})")
    if cfg.attention_mode == "gqa" and kv >= heads:
        raise CheckpointError(f"{where}: dflash_config.attention_mode gqa but num_key_value_heads {kv} is not fewer "
                              f"than num_attention_heads {heads} (set attention_mode mha for equal counts)")
    if cfg.attention_mode == "mha" and kv != heads:
        raise CheckpointError(f"{where}: dflash_config.attention_mode mha but num_key_value_heads {kv} differs from "
                              f"num_attention_heads {heads}")
    if not 0 <= cfg.markov_rank <= SIZE_LIMITS["selector_rank"]:
        raise CheckpointError(f"{where}: DSpark markov_rank {cfg.markov_rank} is outside "
                              f"0..{SIZE_LIMITS['selector_rank']}")
    if cfg.markov_head_type not in MARKOV_HEADS:
        raise CheckpointError(f"{where}: unknown DSpark markov_head_type {cfg.markov_head_type!r} "
                              f"({', '.join(MARKOV_HEADS)})")
    if cfg.confidence_head_with_markov and not (cfg.confidence_head and cfg.markov_rank):
        raise CheckpointError(f"{where}: confidence_head_with_markov needs a confidence head and markov_rank > 0")


def architectures(raw: dict) -> list[str]:
    """The names in a config's ``architectures`` (a damaged entry is left out here; the config's
    check names it)."""
    archs = raw.get("architectures")
    return [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []


def detect_format(raw: dict) -> str:
    if raw.get("speculators_model_type") or "transformer_layer_config" in raw:
        return "speculators"
    archs, dcfg = architectures(raw), raw.get("dflash_config") or {}
    if any(a in SPECFORGE_ARCHITECTURES for a in archs) or set(dcfg) & set(_SPECFORGE_FIELDS):
        return SPECFORGE
    if "dflash_config" in raw or "DFlashDraftModel" in archs:
        return "zlab"
    return "state_dict"


def _weight_files(folder: Path, fmt: str) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map", {})
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: field 'weight_map' must be an object of tensor name -> file name")
        shards = sorted(set(weight_map.values()))
        outside = [s for s in shards if Path(s).is_absolute() or ".." in Path(s).parts]
        if outside:
            raise CheckpointError(f"{index}: shards outside the folder: {outside[:3]}")
        missing = [s for s in shards if not (folder / s).exists()]
        if missing:
            raise CheckpointError(f"{folder}: shards listed in model.safetensors.index.json are missing: {missing}")
        return [folder / s for s in shards]
    if (folder / "model.safetensors").exists():
        return [folder / "model.safetensors"]
    files = sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if not files:
        partial = sorted(p.name for p in folder.iterdir() if p.name.endswith(".part"))
        extra = f" (incomplete transfer: {partial})" if partial else ""
        raise CheckpointError(f"{folder}: no weights file (model.safetensors, *.pt, *.bin){extra}")
    if len(files) > 1 and fmt != "state_dict":
        raise CheckpointError(f"{folder}: several weight files and no index: {[p.name for p in files]}")
    return files


def open_checkpoint(path: str | Path) -> DrafterCheckpoint:
    """Read the config and find the weights; no tensors are loaded."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"drafter not found: {path}")
    folder = path if path.is_dir() else path.parent
    if path.is_dir():
        refuse_special_files(folder, "drafter")
    elif _special_kind(path.stat().st_mode):
        raise CheckpointError(f"{path}: {_special_kind(path.stat().st_mode)}, not a regular file: never read")
    cfg_path = folder / CONFIG_NAME
    if not cfg_path.exists():
        raise CheckpointError(f"{folder}: no {CONFIG_NAME} next to the drafter weights")
    raw = read_json(cfg_path)
    where = str(cfg_path)
    sizes = raw_size_problems(raw)
    if sizes:       # before any reader (transformers' included) builds lists or tensors of these sizes
        raise CheckpointError(f"{where}: {'; '.join(sizes)} (a size no drafter has)")
    if not isinstance(raw.get("architectures") or [], list) or not isinstance(raw.get("dflash_config") or {}, dict):
        check_config_types(raw, "zlab", where)   # detect_format reads these two
    fmt = detect_format(raw)
    check_config_types(raw, fmt, where)
    numbers = number_problem(raw)
    if numbers:
        raise CheckpointError(f"{where}: {numbers}")
    try:
        cfg = {"zlab": _zlab_config, SPECFORGE: _zlab_config, "speculators": _speculators_config,
               "state_dict": _flat_config}[fmt](raw, where)
        validate_config(cfg, where)
    except CheckpointError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:   # a value the checks above let by
        raise CheckpointError(f"{where}: cannot read the drafter config ({type(e).__name__}: {e})") from None
    files = [path] if path.is_file() else _weight_files(folder, fmt)
    if len(files) > 1 and fmt == "state_dict":
        raise CheckpointError(f"{folder}: several state-dict files {[p.name for p in files]}: name one")
    return DrafterCheckpoint(path=folder, format=fmt, config=cfg, weight_files=files, raw=raw)


MANIFEST = ".dflash-manifest.json"   # written by `dflash-ops sync-ckpt` (remote/sync_host.py)


def sha256_file(path: str | Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def completeness_problems(folder: str | Path, verify_hashes: bool = False) -> list[str]:
    """A checkpoint folder that is still arriving or was damaged: ``.part`` files, or files that
    disagree with the sync manifest (size always; sha256 with ``verify_hashes``)."""
    folder = Path(folder)
    problems = []
    parts = sorted(str(p.relative_to(folder)) for p in folder.rglob("*.part"))
    if parts:
        problems.append(f"{folder}: incomplete, partial files present (interrupted transfer?): {_short(parts)}")
    manifest = folder / MANIFEST
    if manifest.exists():
        entries = read_json(manifest).get("files", [])
        if not isinstance(entries, list) or not all(
                isinstance(e, dict) and isinstance(e.get("path"), str) and isinstance(e.get("size"), int)
                and ".." not in Path(e["path"]).parts and not Path(e["path"]).is_absolute() for e in entries):
            raise CheckpointError(f"{manifest}: field 'files' must be a list of {{path, size}} of files in the folder")
        for entry in entries:
            f = folder / entry["path"]
            if not f.exists():
                problems.append(f"{folder}: {entry['path']} is in the sync manifest but missing")
            elif f.stat().st_size != entry["size"]:
                problems.append(f"{folder}: {entry['path']} has {f.stat().st_size} bytes, the sync manifest "
                                f"says {entry['size']}")
            elif verify_hashes and entry.get("sha256"):
                if sha256_file(f) != entry["sha256"]:
                    problems.append(f"{folder}: {entry['path']} does not match its sha256 in the sync manifest")
    return problems


# ----------------------------------------------------------------------------- tensors

def _unnest(sd: dict) -> dict:
    for key in ("state_dict", "model", "module", "drafter", "draft_model"):
        if key in sd and isinstance(sd[key], dict) and not hasattr(sd[key], "shape"):
            return _unnest(sd[key])
    return sd


def _strip(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for p in STRIP_PREFIXES:
            if name.startswith(p):
                name, changed = name[len(p):], True
    for book in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"):
        if name == book + ".weight":   # z-lab's nn.Embedding names; released checkpoints drop ".weight"
            return book
    return name


def tensor_name(cfg: DrafterConfig, stored: str) -> str:
    """A stored tensor name as the drafter's modules name it: wrappers' prefixes stripped (``module.``),
    DFlash2 codebooks without ``.weight``, the families' heads out of early SpecForge's ``logit_head.``."""
    name = _strip(stored)
    if name.startswith(LEGACY_HEAD_PREFIX) and cfg.family != DFLASH:
        name = name[len(LEGACY_HEAD_PREFIX):]
    return name


def read_tensors(ckpt: DrafterCheckpoint, shapes_only: bool = False) -> dict:
    """Normalised name -> tensor (or shape tuple with ``shapes_only``; safetensors headers only)."""
    import torch

    out: dict = {}
    for f in ckpt.weight_files:
        if f.suffix == ".safetensors":
            from safetensors import safe_open
            try:
                with safe_open(str(f), framework="pt") as h:
                    for k in h.keys():
                        out[k] = tuple(h.get_slice(k).get_shape()) if shapes_only else h.get_tensor(k)
            except Exception as e:  # truncated / not safetensors
                raise CheckpointError(f"{f}: cannot read safetensors ({e})") from None
        else:
            try:
                sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:
                raise CheckpointError(f"{f}: cannot read state dict ({e})") from None
            if not isinstance(sd, dict):
                raise CheckpointError(f"{f}: expected a state dict, found {type(sd).__name__}")
            for k, v in _unnest(sd).items():
                if hasattr(v, "shape"):
                    out[k] = tuple(v.shape) if shapes_only else v
    renamed: dict = {}
    for k, v in out.items():
        name = tensor_name(ckpt.config, k)
        if name in renamed:
            raise CheckpointError(f"{ckpt.path}: tensor {name!r} appears twice (as {k!r})")
        renamed[name] = v
    return renamed


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple]:
    import torch
    from remote.drafters.families import build_drafter
    with torch.device("meta"):
        model = build_drafter(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_tensors(ckpt: DrafterCheckpoint, found: dict[str, tuple]) -> tuple[dict, list[str]]:
    """Compare found shapes with the config. Returns (kept names -> shape, ignored names);
    raises :class:`CheckpointError` listing missing / unexpected / mis-shaped tensors."""
    cfg = ckpt.config
    want = expected_shapes(cfg)
    problems = []
    fc = found.get("fc.weight")
    if fc is not None and len(fc) == 2 and fc[1] != want["fc.weight"][1]:
        k, h = cfg.num_target_features, cfg.hidden_size
        if fc[1] % h == 0:
            problems.append(
                f"fc.weight takes {fc[1]} inputs = {fc[1] // h} x {h}, but target_layer_ids lists {k} layers "
                f"{cfg.target_layer_ids} -> {k} x {h} = {k * h}: the fc is not fed all target layers "
                f"(the '4 of 5 layers' bug) or the ids are wrong")
        else:
            problems.append(f"fc.weight takes {fc[1]} inputs, expected {k} layers x {h} = {k * h}")
    ignored = sorted(n for n in found if n not in want and any(n == s or n.endswith("." + s) for s in IGNORABLE))
    missing = sorted(set(want) - set(found))
    unexpected = sorted(set(found) - set(want) - set(ignored))
    misshaped = [f"{n}: {found[n]} (expected {want[n]})" for n in sorted(set(want) & set(found))
                 if tuple(found[n]) != want[n] and n != "fc.weight"]
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {_short(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {_short(unexpected)}")
    if misshaped:
        problems.append(f"mis-shaped tensors ({len(misshaped)}): {_short(misshaped)}")
    if problems:
        raise CheckpointError(f"{ckpt.path} ({ckpt.format}): " + "; ".join(problems))
    return {n: found[n] for n in want}, ignored


# A float is NaN or infinite iff every bit of ``mask`` (its exponent; float8 e4m3fn: all but the sign,
# its only NaN) is set, by safetensors' dtype names; tested on the bits as unsigned integers of the
# float's width: ``(bits << 1) >= (mask << 1)``, the sign shifted out (one shift and one max per chunk).
NONFINITE_BITS = {"BF16": 0x7F80, "F16": 0x7C00, "F32": 0x7F800000, "F64": 0x7FF0000000000000, "F8_E5M2": 0x7C,
                  "F8_E4M3": 0x7F}
TORCH_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64", "float8_e5m2": "F8_E5M2",
                "float8_e4m3fn": "F8_E4M3"}
SCAN_CHUNK = 1 << 22          # elements tested at once (a buffer of at most 32 MiB)
# where a tensor sits in the drafter, as a non-finite weight is named (in this order): its head, the fc,
# the layers, else its top module
WEIGHT_PARTS = (("confidence_head.", "confidence head"), ("markov_head.", "Markov head"),
                ("prefix_gru.", "Domino head"), ("embed_proj.", "Domino head"),
                ("candidate_selector.", "candidate selector"), ("fc.", "fc"), ("layers.", "layers"))


def weight_part(name: str) -> str:
    return next((part for prefix, part in WEIGHT_PARTS if name.startswith(prefix)), name.split(".")[0])


def _nonfinite_bits(bits, mask: int) -> bool:
    """Whether any of ``bits`` (a numpy array of unsigned integers: a tensor's floats) is NaN or
    infinite (:data:`NONFINITE_BITS`)."""
    import numpy as np

    bits = bits.reshape(-1)
    top = bits.dtype.type((mask << 1) & ((1 << 8 * bits.itemsize) - 1))
    buf = np.empty(min(bits.size, SCAN_CHUNK), bits.dtype)
    for i in range(0, bits.size, SCAN_CHUNK):
        part = bits[i:i + SCAN_CHUNK]
        shifted = buf[:part.size]
        np.left_shift(part, 1, out=shifted)
        if shifted.max() >= top:
            return True
    return False


def nonfinite_tensors(ckpt: DrafterCheckpoint, names) -> list[str]:
    """The tensors among ``names`` (normalised, as :func:`read_tensors` names them) that hold a NaN or
    an infinity. A safetensors file is read where its header says each tensor lies, through a
    read-only memory map, a chunk at a time (nothing is copied whole); a state dict as
    :func:`read_tensors` loads it (memory-mapped)."""
    import numpy as np

    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
    names, found = set(names), []
    for f in ckpt.weight_files:
        if f.suffix != ".safetensors":
            continue
        from remote.target.memory import safetensors_header
        try:
            header, start = safetensors_header(f)
            data = np.memmap(f, dtype=np.uint8, mode="r") if f.stat().st_size > start else None
            for stored, meta in header.items():
                name = tensor_name(ckpt.config, stored)
                if stored == "__metadata__" or name not in names or meta["dtype"] not in NONFINITE_BITS:
                    continue
                begin, end = (start + int(o) for o in meta["data_offsets"])
                if end > begin and _nonfinite_bits(data[begin:end].view(unsigned[_itemsize(meta["dtype"])]),
                                                   NONFINITE_BITS[meta["dtype"]]):
                    found.append(name)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{f}: cannot read safetensors ({e})") from None
    if any(f.suffix != ".safetensors" for f in ckpt.weight_files):
        import torch

        for name, t in read_tensors(ckpt).items():
            kind = TORCH_DTYPES.get(str(t.dtype).removeprefix("torch."))
            if name in names and kind and t.numel():
                ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
                bits = t.detach().contiguous().view(ints).numpy().view(unsigned[t.element_size()])
                if _nonfinite_bits(bits, NONFINITE_BITS[kind]):
                    found.append(name)
    return found


def _itemsize(dtype: str) -> int:
    return 1 if dtype.startswith("F8") else int(dtype[-2:]) // 8


def nonfinite_problem(ckpt: DrafterCheckpoint, names) -> str | None:
    """One line naming every tensor among ``names`` that holds NaN or an infinity, by the part of
    the drafter it belongs to (:func:`weight_part`); None when every weight is finite."""
    found = nonfinite_tensors(ckpt, names)
    if not found:
        return None
    parts: dict[str, list[str]] = {}
    for name in found:
        parts.setdefault(weight_part(name), []).append(name)
    order = [part for _, part in WEIGHT_PARTS]
    shown = sorted(parts, key=lambda part: (order.index(part) if part in order else len(order), part))
    return (f"{ckpt.path}: weights that are NaN or infinite in {len(found)} tensor(s), by part: "
            + "; ".join(f"{part}: {_short(sorted(parts[part]))}" for part in shown)
            + " (nothing drafted with them is a result)")


def _short(items: list[str], n: int = 6) -> str:
    return ", ".join(items[:n]) + (f", ... (+{len(items) - n} more)" if len(items) > n else "")


def check_vocab_maps(ckpt: DrafterCheckpoint, d2t, t2d) -> None:
    """A reduced vocabulary's maps must agree: ``d2t`` offsets land inside the target vocabulary, on
    distinct ids, exactly the ones ``t2d`` marks."""
    import torch

    cfg = ckpt.config
    target_ids = torch.arange(cfg.draft_vocab_size) + d2t.long()
    where = f"{ckpt.path} ({ckpt.format})"
    if target_ids.min() < 0 or target_ids.max() >= cfg.vocab_size:
        raise CheckpointError(f"{where}: d2t maps draft ids outside the target vocabulary (0..{cfg.vocab_size - 1})")
    if target_ids.unique().numel() != cfg.draft_vocab_size:
        raise CheckpointError(f"{where}: d2t maps two draft ids to the same target id")
    marked = t2d.bool()
    if int(marked.sum()) != cfg.draft_vocab_size or not bool(marked[target_ids].all()):
        raise CheckpointError(f"{where}: t2d marks {int(marked.sum())} target ids, not the {cfg.draft_vocab_size} "
                              f"that d2t maps to")


def load_drafter(path: str | Path, device="cpu", dtype=None):
    """Open, check and load a drafter. Returns ``(model in eval mode, DrafterCheckpoint)``."""
    import torch
    from remote.drafters.families import build_drafter

    ckpt = open_checkpoint(path)
    tensors = read_tensors(ckpt)
    _, ignored = check_tensors(ckpt, {k: tuple(v.shape) for k, v in tensors.items()})
    if ignored:
        ckpt.notes.append(f"ignored tensors that belong to the target or are buffers: {ignored}")
    if ckpt.config.reduced_vocab:
        check_vocab_maps(ckpt, tensors["d2t"], tensors["t2d"])
    with torch.device("meta"):
        model = build_drafter(ckpt.config)
    state = {k: v for k, v in tensors.items() if k not in ignored}
    model.load_state_dict(state, assign=True, strict=True)
    dtype = dtype or state["fc.weight"].dtype
    return model.to(device=device, dtype=dtype).eval(), ckpt


# ----------------------------------------------------------------------------- saving

def layer_config_dict(cfg: DrafterConfig) -> dict:
    """The transformers (``Qwen3Config``) fields of the drafter's layers, written in full so that no
    class default is relied on: z-lab keeps them at the top level of ``config.json``, speculators
    under ``transformer_layer_config``."""
    return {"model_type": "qwen3", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden_act": cfg.hidden_act,
            "rms_norm_eps": cfg.rms_norm_eps, "attention_bias": cfg.attention_bias,
            "rope_parameters": dict(cfg.rope_parameters), "max_position_embeddings": cfg.max_position_embeddings,
            "layer_types": list(cfg.layer_types), "use_sliding_window": cfg.sliding_window is not None,
            "sliding_window": cfg.sliding_window, "vocab_size": cfg.vocab_size}


def zlab_config_dict(cfg: DrafterConfig, base: dict | None = None) -> dict:
    """``config.json`` of a z-lab-format drafter: a Qwen3Config plus ``dflash_config`` (what z-lab's
    own ``from_pretrained`` reads). The knobs are written only where they differ from z-lab's
    defaults. ``base``: keys without drafting semantics carried from another config (written under
    the generated ones)."""
    if cfg.mask_rule != ZLAB or cfg.reduced_vocab or cfg.sample_from_anchor:
        raise ValueError("only z-lab-rule, full-vocabulary drafters without sample_from_anchor can be written "
                         "in the z-lab format")
    dflash = {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)}
    if cfg.input_embedding_scale != 1.0:
        dflash["input_embedding_scale"] = cfg.input_embedding_scale
    if cfg.output_multiplier != 1.0:
        dflash["output_multiplier"] = cfg.output_multiplier
    if cfg.final_logit_softcapping is not None:
        dflash["final_logit_softcapping"] = cfg.final_logit_softcapping
    raw = {**(base or {}), **layer_config_dict(cfg),
           "architectures": ["DFlash2DraftModel" if cfg.architecture == DFLASH2 else "DFlashDraftModel"],
           "block_size": cfg.block_size, "num_target_layers": cfg.num_target_layers, "dflash_config": dflash}
    if cfg.is_causal is not None:
        raw["is_causal"] = cfg.is_causal
    if cfg.target_hidden_size != cfg.hidden_size:
        raw["target_hidden_size"] = cfg.target_hidden_size
    if cfg.architecture == DFLASH2:
        dflash.update(conv_kernel_size=cfg.conv_kernel_size, conv_group_size=cfg.conv_group_size,
                      selector_rank=cfg.selector_rank, selector_top_k=cfg.selector_top_k)
    return raw


def specforge_config_dict(cfg: DrafterConfig, base: dict | None = None, dflash_base: dict | None = None) -> dict:
    """``config.json`` of a SpecForge-format drafter: z-lab's layout (:func:`zlab_config_dict`) with the
    family's class in ``architectures`` and its ``dflash_config`` keys, as SpecForge's classes read
    them. ``pure_draft_prefix_len`` and ``shift_label`` are always written (every SpecForge class
    reads both), which is also what tells this reader a plain DFlash drafter is SpecForge's.
    ``dflash_base``: ``dflash_config`` keys without drafting semantics carried from the source."""
    if cfg.architecture != DFLASH or cfg.is_causal not in (None, False) or SLIDING in cfg.layer_types:
        raise ValueError("only DFlash drafters with bidirectional full-attention layers can be written in "
                         "SpecForge's format")
    raw = zlab_config_dict(replace(cfg, is_causal=None), base=base)
    raw["architectures"] = [SPECFORGE_CLASSES[cfg.family]]
    dflash = {**(dflash_base or {}), **raw["dflash_config"],
              "pure_draft_prefix_len": cfg.pure_draft_prefix_len, "shift_label": cfg.shift_label}
    if cfg.family == DOMINO:
        dflash.update(projector_type=DOMINO, emb_dim=cfg.emb_dim, gru_hidden_dim=cfg.gru_hidden_dim)
    elif cfg.family == DSPARK:
        dflash.update(projector_type=DSPARK, markov_rank=cfg.markov_rank, markov_head_type=cfg.markov_head_type,
                      enable_confidence_head=cfg.confidence_head,
                      confidence_head_with_markov=cfg.confidence_head_with_markov, attention_mode=cfg.attention_mode)
    raw["dflash_config"] = dflash
    return raw


def speculators_proposal_config(cfg: DrafterConfig, verifier: str | None = None,
                                verifier_architectures: list[str] | None = None) -> dict:
    """speculators' ``speculators_config`` (what vLLM requires of a speculators checkpoint): one greedy
    proposal of ``num_drafts`` tokens and the verifier's name (None: not recorded)."""
    return {"algorithm": cfg.architecture, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.num_drafts,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures or [])}}


def speculators_config_dict(cfg: DrafterConfig, base: dict | None = None, layer_base: dict | None = None,
                            proposal: dict | None = None) -> dict:
    """``config.json`` of a speculators-format drafter (``DFlashSpeculatorConfig`` /
    ``DFlash2SpeculatorConfig``): the layer config under ``transformer_layer_config``,
    ``aux_hidden_state_layer_ids`` = z-lab ids + 1, every field written. ``base`` / ``layer_base``:
    keys without drafting semantics carried from another config (top level / layer config);
    ``proposal``: the ``speculators_config`` (default :func:`speculators_proposal_config`)."""
    knobs = cfg.input_embedding_scale != 1.0 or cfg.output_multiplier != 1.0 or (cfg.final_logit_softcapping or 0) > 0
    if cfg.mask_rule != SPECULATORS or cfg.is_causal is not None or knobs:
        raise ValueError("only speculators-rule drafters without z-lab's is_causal and knobs can be written in the "
                         "speculators format")
    if cfg.architecture == DFLASH2 and cfg.conv_kernel_size > cfg.block_size:
        raise ValueError(f"speculators refuses a DFlash2 conv_kernel_size ({cfg.conv_kernel_size}) larger than "
                         f"block_size ({cfg.block_size})")
    kind = "DFlash2" if cfg.architecture == DFLASH2 else "DFlash"
    raw = {**(base or {}), "speculators_model_type": cfg.architecture, "architectures": [f"{kind}DraftModel"],
           "auto_map": {"": f"config.{kind}SpeculatorConfig"},
           "transformer_layer_config": {**(layer_base or {}), **layer_config_dict(cfg)},
           "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
           "draft_vocab_size": cfg.draft_vocab_size if cfg.reduced_vocab else cfg.vocab_size,
           "mask_token_id": cfg.mask_token_id, "block_size": cfg.block_size,
           "sliding_window_non_causal": cfg.sliding_window_non_causal, "sample_from_anchor": cfg.sample_from_anchor,
           "target_hidden_size": None if cfg.target_hidden_size == cfg.hidden_size else cfg.target_hidden_size,
           "speculators_config": proposal or speculators_proposal_config(cfg)}
    if cfg.num_target_layers is not None:
        raw["num_target_layers"] = cfg.num_target_layers
    if cfg.architecture == DFLASH2:
        raw.update(conv_kernel_size=cfg.conv_kernel_size, conv_group_size=cfg.conv_group_size,
                   selector_rank=cfg.selector_rank, selector_top_k=cfg.selector_top_k)
    return raw


def save_drafter(model, folder: str | Path, fmt: str = "zlab", prefix: str = "", file_name: str | None = None) -> Path:
    """Write ``model`` in the z-lab, speculators or flat state-dict format (tests, the demo, the
    training step). Converting a checkpoint from one format to another is :mod:`remote.export`."""
    import torch
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg: DrafterConfig = model.config
    sd = {prefix + k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if fmt == "zlab":
        raw = zlab_config_dict(cfg)
        save_file(sd, str(folder / (file_name or "model.safetensors")))
    elif fmt == "speculators":
        raw = speculators_config_dict(cfg)
        save_file(sd, str(folder / (file_name or "model.safetensors")))
    elif fmt == "state_dict":
        raw = cfg.to_dict()
        name = file_name or "drafter.pt"
        if name.endswith(".safetensors"):
            save_file(sd, str(folder / name))
        else:
            torch.save({"model": sd, "step": 0}, folder / name)
    else:
        raise ValueError(f"unknown format {fmt!r} (zlab, speculators or state_dict)")
    (folder / CONFIG_NAME).write_text(json.dumps(raw, indent=2))
    return folder
