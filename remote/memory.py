"""Pre-flight memory plan: do the target, the drafter, the KV cache and the logits of the longest
context fit on the devices the worker will use? Read from the folders' configs and safetensors
headers, before any weights load.

``python -m remote.memory --target DIR --drafter DIR [--suite S --prompts N --max-new-tokens M
--device cuda --target-devices N|auto --max-memory GIB] --json`` prints the plan; exit 1 when it
does not fit. The worker runs the same check before it loads anything.

Terms (bytes): target and drafter = parameters x the run's dtype size; KV cache = 2 (K and V) x
full-attention layers x KV heads x head dim x dtype size per token of context, for the target and
the drafter; logits = context x vocabulary x 4 (the offline walk scores every position in fp32).
The context of the longest prompt is its tokens plus ``max_new_tokens`` per turn.
"""
from __future__ import annotations

import argparse
import json
import struct
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GiB = 2**30
TEMPLATE_TOKENS = 32          # chat-template tokens around each turn (role markers, thinking tags)


def parameter_count(folder: str | Path) -> int:
    """Parameters in a folder's ``*.safetensors`` files, from their headers only."""
    total = 0
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, meta in header.items():
            if name != "__metadata__":
                n = 1
                for d in meta["shape"]:
                    n *= d
                total += n
    return total


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


def longest_context(rows, tokenizer, max_new_tokens: int) -> int:
    """Tokens of the longest conversation: its prompt turns, the answers before each next turn and
    the last answer (``max_new_tokens`` each), plus the chat template's markers."""
    longest = 0
    for row in rows:
        if row.input_ids is not None:
            n = len(row.input_ids) + max_new_tokens
        else:
            text = sum(len(tokenizer(t)["input_ids"]) if tokenizer else len(t) for t in row.turns)
            n = text + len(row.turns) * (max_new_tokens + TEMPLATE_TOKENS)
        longest = max(longest, n)
    return longest


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
    if device.startswith("cuda"):
        import torch
        count = torch.cuda.device_count()
        n = count if target_devices == "auto" else int(target_devices or 1)
        first = int(device.split(":")[1]) if ":" in device else 0
        out = [(f"cuda:{i}", torch.cuda.mem_get_info(i)[0]) for i in range(first, min(first + n, count))]
    else:
        out = [("cpu", available_ram())]
    return [(d, min(free, cap) if cap is not None else free) for d, free in out]


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
    """The plan's flags (remote.memory and remote.preflight): the target, and the run's settings
    as the worker reads them (the plan uses the suite, prompts, tokens, device, dtype and memory)."""
    from remote.settings import add_arguments

    p.add_argument("--target", required=True)
    add_arguments(p)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m remote.memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True)
    add_plan_arguments(p)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result = plan_for_suite(args.target, args.drafter, args.suite, args.prompts, args.max_new_tokens, args.device,
                            args.dtype, args.target_devices, args.max_memory)
    print(json.dumps(result.to_dict()) if args.json else result.describe())
    return 0 if result.fits else 1


def plan_for_suite(target_dir, drafter_dir, suite: str, prompts: int | None, max_new_tokens: int,
                   device: str | None = None, dtype: str | None = None, target_devices=None,
                   max_memory_gb: float | None = None) -> Plan:
    """The plan of a worker run over a prompt suite, with the worker's device and dtype defaults."""
    from remote.prompts import load_suite
    import torch
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    rows = load_suite(suite, limit=prompts).rows
    return check(target_dir, drafter_dir, rows, max_new_tokens, device, dtype, target_devices, max_memory_gb)


def check(target_dir, drafter_dir, rows, max_new_tokens: int, device: str, dtype: str,
          target_devices=None, max_memory_gb: float | None = None) -> Plan:
    """The plan of a worker run (the tokenizer only, no weights, is loaded to count prompt tokens)."""
    tokenizer = None
    if any(r.input_ids is None for r in rows):
        try:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
        except Exception:  # noqa: BLE001 — characters then bound the tokens from above
            tokenizer = None
    return plan(target_dir, drafter_dir, longest_context(rows, tokenizer, max_new_tokens), dtype,
                free_memory(device, target_devices, max_memory_gb))


if __name__ == "__main__":
    sys.exit(main())
