"""The target model: loading, kernel path, and hidden-state capture for the drafter's context.

Layer ids are z-lab ids (see :mod:`remote.drafters.dflash`): a forward hook on decoder layer ``i`` sees
exactly HF ``hidden_states[i + 1]``. Only the layers the drafter needs are captured; the full
``output_hidden_states`` tuple (every layer, every position) is never kept.
"""
from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType


def guard_cpu_kernels(device: str) -> None:
    """On CPU, keep flash-linear-attention out before transformers binds it (with fla + triton
    installed, transformers <= 5.24 binds fla and the forward crashes with '0 active drivers')."""
    if device == "cpu" and "transformers.models.qwen3_5.modeling_qwen3_5" not in sys.modules:
        sys.modules.setdefault("fla", None)


def remote_code_problem(config: dict) -> str | None:
    """Why a target's ``config.json`` asks for Python code of its own, else None: an ``auto_map``
    whose ``model_type`` transformers does not know (transformers would ask whether to run the
    folder's code). No load here runs it: each passes ``trust_remote_code=False``."""
    from transformers import CONFIG_MAPPING, __version__

    auto_map, kind = config.get("auto_map"), config.get("model_type")
    if not auto_map or (isinstance(kind, str) and kind in CONFIG_MAPPING):
        return None
    shown = json.dumps(auto_map)
    return (f"auto_map {shown if len(shown) <= 120 else shown[:117] + '...'}: the target asks to run Python code of "
            f"its own (model_type {kind!r} is not one transformers {__version__} knows), and dflash-ops never runs a "
            f"checkpoint's code")


def gdn_kernel_path(model) -> str:
    """Which Gated DeltaNet implementation the loaded model runs: ``fla``, ``torch`` or ``n/a``."""
    cfg = getattr(model.config, "text_config", None) or model.config
    if "linear_attention" not in (getattr(cfg, "layer_types", None) or []):
        return "n/a"
    return "fla" if isinstance(sys.modules.get("fla"), ModuleType) else "torch"


def decoder_layers(model):
    """The decoder layer list of a CausalLM (``model.model.layers``) or a VLM wrapper
    (``model.model.language_model.layers``)."""
    inner = model.model if hasattr(model, "model") else model
    for path in (("layers",), ("language_model", "layers"), ("model", "layers")):
        obj = inner
        for attr in path:
            obj = getattr(obj, attr, None)
        if obj is not None:
            return obj
    raise ValueError(f"cannot find decoder layers in {type(model).__name__}")


@contextmanager
def capture(model, layer_ids: list[int]):
    """Forward hooks on the needed layers. Yields a dict ``layer_id -> [b, T, H]`` filled by each
    forward (overwritten by the next one)."""
    layers = decoder_layers(model)
    store: dict[int, object] = {}
    handles = []
    for i in sorted(set(layer_ids)):
        def hook(_mod, _inp, out, i=i):
            store[i] = out[0] if isinstance(out, tuple) else out
        handles.append(layers[i].register_forward_hook(hook))
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


def features(store: dict, layer_ids: list[int]):
    """Concatenate captured layers in ``target_layer_ids`` order: ``[b, T, K*H]``, on the device of
    the deepest one (a target split over devices yields each layer where it ran)."""
    import torch
    device = store[max(layer_ids)].device
    return torch.cat([store[i].to(device) for i in layer_ids], dim=-1)


def module_device(module):
    """Where a module of the target computes: its accelerate hook's execution device (a
    device_map split, offloaded weights included), else its parameters' device."""
    import torch
    device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if device is None:
        return next(module.parameters()).device
    return torch.device(f"cuda:{device}" if isinstance(device, int) else device)


def features_device(model, layer_ids: list[int]):
    """The device :func:`features` returns the drafter's context on: the deepest captured layer's."""
    return module_device(decoder_layers(model)[max(layer_ids)])


def target_features(model, input_ids, layer_ids: list[int], **forward_kwargs):
    """One forward; returns ``(outputs, target_hidden [b, T, K*H])``."""
    import torch
    with capture(model, layer_ids) as store, torch.no_grad():
        out = model(input_ids=input_ids, **forward_kwargs)
    return out, features(store, layer_ids)


def load_target(folder: str | Path, device: str = "cpu", dtype: str | None = None, devices: list[str] | None = None,
                max_memory: dict[str, int] | None = None, device_map: dict | str | None = None,
                offload_folder: str | None = None):
    """Load a target folder as its text-only CausalLM (a Qwen3.5/3.6 VLM checkpoint gives the
    text model). Default dtype: bfloat16 on CUDA, float32 on CPU.

    ``devices`` (e.g. ``["cuda:0", "cuda:1"]``) splits the layers over those devices with
    transformers' ``device_map="auto"`` (accelerate), each device holding at most ``max_memory``
    bytes; ``device_map`` names the placement module by module instead (``"disk"`` entries are
    offloaded to ``offload_folder`` and streamed in per forward)."""
    guard_cpu_kernels(device)
    import torch
    from transformers import AutoModelForCausalLM

    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    if devices and len(devices) > 1 and device_map is None:
        device_map = "auto"
        limits = max_memory or {}
        max_memory = {int(d.split(":")[1]) if d.startswith("cuda:") else d: limits.get(d, "0GiB") for d in devices}
    elif devices and device_map is None:
        device = devices[0]
    if device_map is not None:
        kwargs = {k: v for k, v in (("max_memory", max_memory), ("offload_folder", offload_folder)) if v}
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype), device_map=device_map,
                                                     trust_remote_code=False, **kwargs)
        return model.eval()
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype), trust_remote_code=False)
    return model.to(device).eval()
