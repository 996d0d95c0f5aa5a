"""Drafter / target compatibility, checked from configs and tensor headers before any heavy work."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from remote.drafters.checkpoint import CheckpointError, DrafterCheckpoint


class IncompatibleError(ValueError):
    """The drafter does not fit the target (or the requested settings); the message names the cause."""


@dataclass
class TargetInfo:
    path: str
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int           # rows of embed_tokens
    layer_types: list[str]

    def describe(self) -> dict:
        return dict(self.__dict__)


def read_target_config(folder: str | Path) -> TargetInfo:
    """Text-model facts of a target folder; a Qwen3.5/3.6 VLM config is read through ``text_config``."""
    folder = Path(folder).expanduser()
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"target not found: {cfg_path} does not exist")
    raw = json.loads(cfg_path.read_text())
    text = raw.get("text_config") or raw
    try:
        layers = int(text["num_hidden_layers"])
        return TargetInfo(path=str(folder), model_type=str(raw.get("model_type", "?")),
                          hidden_size=int(text["hidden_size"]), num_hidden_layers=layers,
                          vocab_size=int(text["vocab_size"]),
                          layer_types=list(text.get("layer_types") or ["full_attention"] * layers))
    except KeyError as e:
        raise CheckpointError(f"{cfg_path}: missing {e.args[0]!r}") from None


def compatibility_problems(ckpt: DrafterCheckpoint, target: TargetInfo, fc_shape: tuple | None = None,
                           block_size: int | None = None) -> list[str]:
    """Every reason the drafter cannot be used with ``target``; empty when it fits."""
    c = ckpt.config
    L, H = target.num_hidden_layers, target.hidden_size
    problems = []
    k = len(c.target_layer_ids)
    if fc_shape is not None and fc_shape[1] != k * H:
        if fc_shape[1] % H == 0:
            problems.append(f"fc input width {fc_shape[1]} = {fc_shape[1] // H} x target hidden {H}, but "
                            f"target_layer_ids lists {k} layers {c.target_layer_ids} (needs {k} x {H} = {k * H}): "
                            f"the fc is not fed all {k} target layers ('4 of 5 layers' bug)")
        else:
            problems.append(f"fc input width {fc_shape[1]} is not a multiple of the target hidden size {H}: "
                            f"drafter paired with the wrong target?")
    for i in c.target_layer_ids:
        if not 0 <= i < L:
            problems.append(f"target layer id {i} is out of range for a {L}-layer target (valid 0..{L - 2})")
        elif i == L - 1:
            problems.append(f"target layer id {i} is the target's last layer: hidden_states[{L}] is taken after "
                            f"the final norm, not the raw layer output (valid 0..{L - 2})")
    if len(set(c.target_layer_ids)) != k:
        problems.append(f"target_layer_ids {c.target_layer_ids} repeats a layer")
    if not 0 <= c.mask_token_id < target.vocab_size:
        problems.append(f"mask_token_id {c.mask_token_id} is outside the target's embedding rows "
                        f"(0..{target.vocab_size - 1})")
    if c.hidden_size != H:
        problems.append(f"hidden size mismatch: drafter {c.hidden_size}, target {H} (block tokens use the "
                        f"target's embedding and logits its lm_head)")
    if c.target_hidden_size != H:
        problems.append(f"drafter expects target hidden size {c.target_hidden_size}, target has {H}")
    if c.vocab_size != target.vocab_size:
        problems.append(f"vocab mismatch: drafter {c.vocab_size}, target {target.vocab_size}")
    if c.num_target_layers is not None and int(c.num_target_layers) != L:
        problems.append(f"drafter was built for a {c.num_target_layers}-layer target, this target has {L} "
                        f"layers: wrong target?")
    if block_size is not None and block_size != c.block_size:
        problems.append(f"block size mismatch: requested {block_size}, drafter was trained with {c.block_size}")
    return problems


def check_compatible(ckpt: DrafterCheckpoint, target: TargetInfo, fc_shape=None, block_size=None) -> None:
    problems = compatibility_problems(ckpt, target, fc_shape, block_size)
    if problems:
        raise IncompatibleError(f"drafter {ckpt.path} does not fit target {target.path}:\n  - " + "\n  - ".join(problems))
