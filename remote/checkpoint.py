"""Drafter checkpoints: detect the format, normalise the config, check and load the tensors.

Formats
* ``zlab`` — z-lab / Hugging Face: ``config.json`` (a Qwen3Config plus ``dflash_config:
  {mask_token_id, target_layer_ids}``, ``block_size`` at the top level or in ``dflash_config``)
  and ``model.safetensors`` (or a sharded index) with bare key names (``fc.weight``, ``layers.0...``).
* ``speculators`` — vLLM speculators: ``speculators_model_type: dflash``, the layer config under
  ``transformer_layer_config``, ``aux_hidden_state_layer_ids`` index HF ``hidden_states`` and are
  therefore the z-lab ids **+ 1** (converted here, once).
* ``state_dict`` — what an in-house training run saves: a ``.pt``/``.bin``/``.safetensors`` state
  dict (possibly nested under ``model``/``state_dict``, keys prefixed ``module.``/``model.``/
  ``_orig_mod.``) plus a small flat ``config.json`` whose keys are :class:`DrafterConfig` fields.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from remote.drafter import FULL, DrafterConfig

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

    def describe(self) -> dict:
        c = self.config
        return {"path": str(self.path), "format": self.format, "block_size": c.block_size,
                "target_layer_ids": c.target_layer_ids, "mask_token_id": c.mask_token_id,
                "num_hidden_layers": c.num_hidden_layers, "hidden_size": c.hidden_size,
                "vocab_size": c.vocab_size, "num_target_layers": c.num_target_layers,
                "layer_types": c.layer_types, "sliding_window": c.sliding_window,
                "weight_files": [p.name for p in self.weight_files], "notes": self.notes}


# ----------------------------------------------------------------------------- config

def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def _rope_theta(raw: dict) -> float:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", None):
        raise CheckpointError(f"unsupported RoPE type {kind!r} (only default RoPE drafters are supported)")
    return float(raw.get("rope_theta", params.get("rope_theta", 1_000_000.0)))


def _layer_config(raw: dict, where: str, **extra) -> DrafterConfig:
    try:
        heads = int(raw["num_attention_heads"])
        layers = int(raw["num_hidden_layers"])
        hidden = int(raw["hidden_size"])
        cfg = DrafterConfig(
            hidden_size=hidden, intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads", heads)),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=_rope_theta(raw),
            attention_bias=bool(raw.get("attention_bias", False)),
            layer_types=list(raw.get("layer_types") or [FULL] * layers),
            sliding_window=raw.get("sliding_window"), **extra)
    except KeyError as e:
        raise CheckpointError(f"{where}: missing field {e.args[0]!r}") from None
    if len(cfg.layer_types) != cfg.num_hidden_layers:
        raise CheckpointError(f"{where}: layer_types has {len(cfg.layer_types)} entries for "
                              f"{cfg.num_hidden_layers} layers")
    if "sliding_attention" in cfg.layer_types and not cfg.sliding_window:
        raise CheckpointError(f"{where}: sliding_attention layers but no sliding_window")
    if not any(t == "sliding_attention" for t in cfg.layer_types):
        cfg.sliding_window = None
    return cfg


def _require(value, name: str, where: str):
    if value is None:
        hint = (" (z-lab would guess round(1 + i*(T-4)/(L-1)), which is usually not what the drafter "
                "was trained with; write the ids into the config)") if name == "target_layer_ids" else ""
        raise CheckpointError(f"{where}: missing {name}{hint}")
    return value


def _zlab_config(raw: dict, where: str) -> DrafterConfig:
    dcfg = raw.get("dflash_config") or {}
    top, inner = raw.get("block_size"), dcfg.get("block_size")
    if top is not None and inner is not None and int(top) != int(inner):
        raise CheckpointError(f"{where}: block size mismatch: block_size={top} at the top level but "
                              f"dflash_config.block_size={inner}")
    block = top if top is not None else inner
    return _layer_config(
        raw, where,
        target_layer_ids=_require(dcfg.get("target_layer_ids", raw.get("target_layer_ids")), "target_layer_ids", where),
        mask_token_id=int(_require(dcfg.get("mask_token_id", raw.get("mask_token_id")), "mask_token_id", where)),
        vocab_size=int(_require(raw.get("vocab_size"), "vocab_size", where)),
        block_size=int(block if block is not None else 16),
        num_target_layers=raw.get("num_target_layers"),
        target_hidden_size=raw.get("target_hidden_size"))


def _speculators_config(raw: dict, where: str) -> DrafterConfig:
    layer_raw = raw.get("transformer_layer_config")
    if not isinstance(layer_raw, dict):
        raise CheckpointError(f"{where}: speculators config without transformer_layer_config")
    aux = _require(raw.get("aux_hidden_state_layer_ids"), "aux_hidden_state_layer_ids", where)
    return _layer_config(
        layer_raw, f"{where} (transformer_layer_config)",
        target_layer_ids=[int(i) - 1 for i in aux],  # speculators index hidden_states: z-lab id + 1
        mask_token_id=int(_require(raw.get("mask_token_id"), "mask_token_id", where)),
        vocab_size=int(_require(layer_raw.get("vocab_size", raw.get("vocab_size")), "vocab_size", where)),
        block_size=int(raw.get("block_size", 8)),
        num_target_layers=raw.get("num_target_layers"),
        target_hidden_size=raw.get("target_hidden_size"))


def _flat_config(raw: dict, where: str) -> DrafterConfig:
    known = {f.name for f in fields(DrafterConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise CheckpointError(f"{where}: unknown drafter config keys {unknown}")
    try:
        return DrafterConfig(**raw)
    except TypeError as e:
        raise CheckpointError(f"{where}: {e}") from None


def detect_format(raw: dict) -> str:
    if raw.get("speculators_model_type") or "transformer_layer_config" in raw:
        return "speculators"
    if "dflash_config" in raw or "DFlashDraftModel" in (raw.get("architectures") or []):
        return "zlab"
    return "state_dict"


def _weight_files(folder: Path, fmt: str) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(_read_json(index).get("weight_map", {}).values()))
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
    cfg_path = folder / CONFIG_NAME
    if not cfg_path.exists():
        raise CheckpointError(f"{folder}: no {CONFIG_NAME} next to the drafter weights")
    raw = _read_json(cfg_path)
    fmt = detect_format(raw)
    where = str(cfg_path)
    cfg = {"zlab": _zlab_config, "speculators": _speculators_config, "state_dict": _flat_config}[fmt](raw, where)
    files = [path] if path.is_file() else _weight_files(folder, fmt)
    if len(files) > 1 and fmt == "state_dict":
        raise CheckpointError(f"{folder}: several state-dict files {[p.name for p in files]}: name one")
    return DrafterCheckpoint(path=folder, format=fmt, config=cfg, weight_files=files)


MANIFEST = ".dflash-manifest.json"   # written by `dflash-ops sync-ckpt` (remote/ckpt_tool.py)


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
        for entry in _read_json(manifest).get("files", []):
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
        name = _strip(k)
        if name in renamed:
            raise CheckpointError(f"{ckpt.path}: tensor {name!r} appears twice (as {k!r})")
        renamed[name] = v
    return renamed


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple]:
    import torch
    from remote.drafter import DFlashDrafter
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_tensors(ckpt: DrafterCheckpoint, found: dict[str, tuple]) -> tuple[dict, list[str]]:
    """Compare found shapes with the config. Returns (kept names -> shape, ignored names);
    raises :class:`CheckpointError` listing missing / unexpected / mis-shaped tensors."""
    cfg = ckpt.config
    want = expected_shapes(cfg)
    problems = []
    fc = found.get("fc.weight")
    if fc is not None and len(fc) == 2 and fc[1] != want["fc.weight"][1]:
        k, h = cfg.num_target_features, cfg.target_hidden_size
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


def _short(items: list[str], n: int = 6) -> str:
    return ", ".join(items[:n]) + (f", ... (+{len(items) - n} more)" if len(items) > n else "")


def load_drafter(path: str | Path, device="cpu", dtype=None):
    """Open, check and load a drafter. Returns ``(model in eval mode, DrafterCheckpoint)``."""
    import torch
    from remote.drafter import DFlashDrafter

    ckpt = open_checkpoint(path)
    tensors = read_tensors(ckpt)
    _, ignored = check_tensors(ckpt, {k: tuple(v.shape) for k, v in tensors.items()})
    if ignored:
        ckpt.notes.append(f"ignored tensors that belong to the target or are buffers: {ignored}")
    with torch.device("meta"):
        model = DFlashDrafter(ckpt.config)
    state = {k: v for k, v in tensors.items() if k not in ignored}
    model.load_state_dict(state, assign=True, strict=True)
    dtype = dtype or next(iter(state.values())).dtype
    return model.to(device=device, dtype=dtype).eval(), ckpt


# ----------------------------------------------------------------------------- saving

def _hf_layer_fields(cfg: DrafterConfig) -> dict:
    return {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "attention_bias": cfg.attention_bias,
            "layer_types": cfg.layer_types, "sliding_window": cfg.sliding_window, "vocab_size": cfg.vocab_size,
            "model_type": "qwen3", "hidden_act": "silu"}


def save_drafter(model, folder: str | Path, fmt: str = "zlab", prefix: str = "", file_name: str | None = None) -> Path:
    """Write ``model`` in one of the three formats (used by tests, the demo and the training step)."""
    import torch
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg: DrafterConfig = model.config
    sd = {prefix + k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if fmt == "zlab":
        raw = {**_hf_layer_fields(cfg), "architectures": ["DFlashDraftModel"], "block_size": cfg.block_size,
               "num_target_layers": cfg.num_target_layers,
               "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": cfg.target_layer_ids}}
        if cfg.target_hidden_size != cfg.hidden_size:
            raw["target_hidden_size"] = cfg.target_hidden_size
        save_file(sd, str(folder / (file_name or "model.safetensors")))
    elif fmt == "speculators":
        raw = {"speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"],
               "transformer_layer_config": _hf_layer_fields(cfg),
               "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
               "block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
               "target_hidden_size": cfg.target_hidden_size, "num_target_layers": cfg.num_target_layers}
        save_file(sd, str(folder / (file_name or "model.safetensors")))
    elif fmt == "state_dict":
        raw = cfg.to_dict()
        name = file_name or "drafter.pt"
        if name.endswith(".safetensors"):
            save_file(sd, str(folder / name))
        else:
            torch.save({"model": sd, "step": 0}, folder / name)
    else:
        raise ValueError(f"unknown format {fmt!r}")
    (folder / CONFIG_NAME).write_text(json.dumps(raw, indent=2))
    return folder
