"""Pre-flight memory plan: do the target, the drafter, the KV cache and the logits of the longest
context fit on the devices the worker will use? Read from the folders' configs and safetensors
headers, before any weights load.

``python -m remote.target.memory --target DIR --drafter DIR [--suite S --prompts N --max-new-tokens M
--device cuda --target-devices N|auto --max-memory GIB] --json`` prints the plan; exit 1 when it
does not fit. The worker runs the same check before it loads anything.

Terms (bytes): target and drafter = parameters x the run's dtype size; KV cache = 2 (K and V) x
full-attention layers x KV heads x head dim x dtype size per token of context, for the target and
the drafter; logits = context x vocabulary x 4 (the offline walk scores every position in fp32).
The context of the longest prompt is its tokens plus ``max_new_tokens`` per turn.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MAX_HEADER = 100_000_000      # safetensors' own limit on a header's length
GiB = 2**30
TEMPLATE_TOKENS = 32          # chat-template tokens around each turn (role markers, thinking tags)


class WeightsError(ValueError):
    """A weights file the plan cannot read (named, with why)."""


def weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files a loader reads from ``folder``: the shards its index names, else
    ``model.safetensors``, else every ``*.safetensors`` (a consolidated file beside its shards,
    or any other file there, is not counted twice)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            if index.stat().st_size > MAX_HEADER:
                raise ValueError(f"larger than {MAX_HEADER:,} bytes")
            weight_map = json.loads(index.read_bytes())["weight_map"]
            names = sorted({str(v) for v in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise WeightsError(f"{index}: not a safetensors index ({e})") from None
        if any("/" in n or n in ("", ".", "..") for n in names):
            raise WeightsError(f"{index}: a shard name is not a file of the folder")
        return [folder / n for n in names]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    return sorted(folder.glob("*.safetensors"))


def identity(folder: str | Path) -> dict | None:
    """What a resume compares of a target folder, cheaply (no weights read): config.json's sha256
    and the name and size of each weight file a loader reads (:func:`weight_files`); None for what
    is not a readable model folder (a hub id)."""
    folder = Path(folder).expanduser()
    try:
        config = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()
        weights = {p.name: p.stat().st_size for p in weight_files(folder)}
    except (OSError, WeightsError):
        return None
    return {"config_sha256": config, "weights": weights}


def safetensors_header(path: Path) -> tuple[dict, int]:
    """``(header, where its data starts)`` of one safetensors file: the header read at most
    MAX_HEADER bytes (safetensors' own limit) and never more than the file holds. OSError, ValueError."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise ValueError("shorter than its 8-byte header length")
        (size,) = struct.unpack("<Q", raw)
        if size > min(MAX_HEADER, path.stat().st_size - 8):
            raise ValueError(f"header length {size:,} exceeds the file or {MAX_HEADER:,} bytes")
        header = json.loads(fh.read(size))
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    return header, 8 + size


def header_parameters(path: Path) -> int:
    """Parameters of one safetensors file, from its header (:func:`safetensors_header`)."""
    try:
        header, _ = safetensors_header(path)
        total = 0
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            shape = meta["shape"]
            if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                      for d in shape):
                raise ValueError(f"tensor {name!r} has shape {str(shape)[:40]}")
            n = 1
            for d in shape:
                n *= d
            total += n
        return total
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise WeightsError(f"{path}: not a readable safetensors file ({e})") from None


def parameter_count(folder: str | Path) -> int:
    """Parameters in the safetensors files a loader reads from ``folder`` (:func:`weight_files`),
    from their headers only."""
    return sum(header_parameters(f) for f in weight_files(folder))


def text_config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.exists():
        return {}
    cfg = json.loads(path.read_text())
    return cfg.get("text_config") or cfg


def kv_bytes_per_token(cfg: dict, dtype_bytes: int) -> int:
    """K and V of one token in every full-attention layer (linear-attention layers keep a fixed state)."""
    layers = cfg.get("num_hidden_layers") or 0
    if cfg.get("layer_types"):
        layers = sum(t == "full_attention" for t in cfg["layer_types"])
    heads = cfg.get("num_attention_heads") or 1
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or (cfg.get("hidden_size") or 0) // heads
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def prompt_tokens(rows, tokenizer) -> list[list[int | None]]:
    """Per row, ``[its token ids' count or None, its turns' text tokens, its turns]``: what
    :func:`context_tokens` needs of a prompt (characters bound the text's tokens without a tokenizer)."""
    out = []
    for row in rows:
        if row.input_ids is not None:
            out.append([len(row.input_ids), 0, 1])
        else:
            out.append([None, sum(len(tokenizer(t)["input_ids"]) if tokenizer else len(t) for t in row.turns),
                        len(row.turns)])
    return out


def context_tokens(counts, max_new_tokens: int) -> int:
    """Tokens of the longest conversation of ``counts`` (:func:`prompt_tokens`): its prompt turns,
    the answers before each next turn and the last answer (``max_new_tokens`` each), plus the chat
    template's markers."""
    longest = 0
    for ids, text, turns in counts:
        n = ids + max_new_tokens if ids is not None else text + turns * (max_new_tokens + TEMPLATE_TOKENS)
        longest = max(longest, n)
    return longest


def longest_context(rows, tokenizer, max_new_tokens: int) -> int:
    return context_tokens(prompt_tokens(rows, tokenizer), max_new_tokens)


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


@dataclass
class Plan:
    target: int
    drafter: int
    kv_cache: int
    logits: int
    context_tokens: int
    devices: list[tuple[str, int]] = field(default_factory=list)     # (device, bytes free for this run)

    @property
    def need(self) -> int:
        return self.target + self.drafter + self.kv_cache + self.logits

    @property
    def have(self) -> int:
        return sum(free for _, free in self.devices)

    @property
    def fits(self) -> bool:
        return self.need <= self.have

    def describe(self) -> str:
        g = human_bytes
        where = ", ".join(d for d, _ in self.devices)
        return (f"target {g(self.target)} + drafter {g(self.drafter)} + KV cache {g(self.kv_cache)} + logits "
                f"{g(self.logits)} (longest context {self.context_tokens:,} tokens) = {g(self.need)} "
                f"{'<=' if self.fits else '>'} {g(self.have)} free on {where}")

    def refusal(self) -> str:
        hint = ("; load the target across more GPUs with --target-devices N (or auto)"
                if self.devices and self.devices[0][0].startswith("cuda") else "")
        return f"the plan does not fit in memory: {self.describe()}{hint}"

    def to_dict(self) -> dict:
        return {**asdict(self), "need": self.need, "have": self.have, "fits": self.fits, "text": self.describe(),
                "refusal": None if self.fits else self.refusal()}


def free_memory(device: str, target_devices: int | str | None, max_memory_gb: float | None) -> list[tuple[str, int]]:
    """(device, free bytes) of the devices the target will use: ``target_devices`` GPUs (``auto``:
    every visible one), or this machine's available RAM on CPU; each capped at ``max_memory_gb``."""
    cap = int(max_memory_gb * GiB) if max_memory_gb else None
    assumed = assumed_gpu_memory()
    if device.startswith("cuda") and assumed is not None:      # planned where the GPUs are not (a login node)
        out = [(f"cuda:{i}", int(assumed * GiB)) for i in range(1 if target_devices == "auto" else
                                                                 int(target_devices or 1))]
    elif device.startswith("cuda"):
        import torch
        count = torch.cuda.device_count()
        n = count if target_devices == "auto" else int(target_devices or 1)
        first = int(device.split(":")[1]) if ":" in device else 0
        out = [(f"cuda:{i}", torch.cuda.mem_get_info(i)[0]) for i in range(first, min(first + n, count))]
    else:
        out = [("cpu", available_ram())]
    return [(d, min(free, cap) if cap is not None else free) for d, free in out]


def assumed_gpu_memory() -> float | None:
    """GiB per GPU the plan assumes when pre-flight runs where the run's GPUs are not (a Slurm
    login node; remote.contract.settings.ASSUMED_GPU_MEMORY_ENV), else None: measured."""
    import os

    from remote.contract.settings import ASSUMED_GPU_MEMORY_ENV

    try:
        value = float(os.environ.get(ASSUMED_GPU_MEMORY_ENV) or "nan")
    except ValueError:
        return None
    return value if value > 0 else None


def available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def plan(target_dir, drafter_dir, context_tokens: int, dtype: str, devices: list[tuple[str, int]]) -> Plan:
    size = DTYPE_BYTES[dtype]
    tcfg = text_config(target_dir)
    kv = (kv_bytes_per_token(tcfg, size) + kv_bytes_per_token(text_config(drafter_dir), size)) * context_tokens
    return Plan(target=parameter_count(target_dir) * size, drafter=parameter_count(drafter_dir) * size,
                kv_cache=kv, logits=context_tokens * (tcfg.get("vocab_size") or 0) * 4,
                context_tokens=context_tokens, devices=devices)


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The plan's flags (remote.target.memory and remote.preflight): the target, and the run's settings
    as the worker reads them (the plan uses the suite, prompts, tokens, device, dtype and memory)."""
    from remote.contract.settings import add_arguments

    p.add_argument("--target", required=True)
    add_arguments(p)


def parse_plan_arguments(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """``p``'s arguments, the settings among them checked as the worker checks them (a usage error)."""
    from remote.contract.settings import EvalSettings, SettingsError

    args = p.parse_args(argv)
    try:
        EvalSettings.from_args(args)
    except SettingsError as e:
        p.error(str(e))
    return args


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m remote.target.memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True)
    add_plan_arguments(p)
    p.add_argument("--json", action="store_true")
    args = parse_plan_arguments(p, argv)
    result = plan_for_suite(args.target, args.drafter, args.suite, args.prompts, args.max_new_tokens, args.device,
                            args.dtype, args.target_devices, args.max_memory)
    print(json.dumps(result.to_dict()) if args.json else result.describe())
    return 0 if result.fits else 1


def run_dtype(device: str, dtype: str | None) -> str:
    """The worker's dtype: the one asked for, else bfloat16 on CUDA and float32 on CPU."""
    return dtype or ("bfloat16" if device.startswith("cuda") else "float32")


def plan_for_suite(target_dir, drafter_dir, suite: str, prompts: int | None, max_new_tokens: int,
                   device: str | None = None, dtype: str | None = None, target_devices=None,
                   max_memory_gb: float | None = None) -> Plan:
    """The plan of a worker run over a prompt suite, with the worker's device and dtype defaults."""
    from remote.suites.prompts import load_suite
    if device is None:
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = load_suite(suite, limit=prompts).rows
    return check(target_dir, drafter_dir, rows, max_new_tokens, device, run_dtype(device, dtype), target_devices,
                 max_memory_gb)


def count_tokens(target_dir, rows) -> list[list[int | None]]:
    """:func:`prompt_tokens` of ``rows`` with the target's tokenizer (loaded only when a row is text)."""
    tokenizer = None
    if any(r.input_ids is None for r in rows):
        try:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(str(target_dir), trust_remote_code=False)
        except Exception:  # noqa: BLE001 — characters then bound the tokens from above
            tokenizer = None
    return prompt_tokens(rows, tokenizer)


def check(target_dir, drafter_dir, rows, max_new_tokens: int, device: str, dtype: str,
          target_devices=None, max_memory_gb: float | None = None) -> Plan:
    """The plan of a worker run (the tokenizer only, no weights, is loaded to count prompt tokens)."""
    return plan(target_dir, drafter_dir, context_tokens(count_tokens(target_dir, rows), max_new_tokens), dtype,
                free_memory(device, target_devices, max_memory_gb))


if __name__ == "__main__":
    sys.exit(main())
