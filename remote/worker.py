"""The eval worker: ``python -m remote.worker --target DIR --drafter DIR [options]``.

Runs on the eval host (or by hand on any GPU box). Loads the target and the drafter, gets a
reference completion per prompt (SGLang's greedy output when ``--sglang`` is given, otherwise
local greedy decoding with the loaded target), evaluates the drafter (``offline`` walk or real
``online`` speculative decoding) and writes ``results.jsonl`` (one line per prompt, flushed as it
finishes), ``summary.json`` and ``env.json`` into ``--out`` (format: docs/run-format.md).
Progress: one JSON event per line on stdout; human-readable logs on stderr.

Exit status: 0 done, 1 a check failed (drafter/target mismatch, bad prompts, SGLang down),
2 bad usage (missing folders, ...), 3 an unexpected error during the run (finished prompts kept).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from remote.offline import DEFAULT_BUDGETS


class WorkerError(Exception):
    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def log(message: str) -> None:
    print(f"[worker {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m remote.worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target model folder (HF format; a Qwen3.5/3.6 VLM loads as text-only)")
    p.add_argument("--drafter", required=True, help="drafter checkpoint folder (z-lab, speculators or state-dict format)")
    p.add_argument("--suite", default="default", help="built-in suite name (default, humaneval, hf:gsm8k, ...) or a JSONL file")
    p.add_argument("--prompts", type=int, default=None, help="evaluate the first N prompts (default: all)")
    p.add_argument("--mode", choices=("offline", "online"), default="offline",
                   help="offline: walk the reference completion (batched); online: real speculative decoding")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-blocks", type=int, default=None, help="offline: at most N draft blocks per prompt turn")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--sglang", default=None, help="SGLang URL for reference completions (as seen from this host)")
    p.add_argument("--resume", action="store_true", help="keep finished prompts in --out and do the rest")
    p.add_argument("--ddtree-budgets", default=",".join(map(str, DEFAULT_BUDGETS)),
                   help="offline DDTree node budgets, comma-separated ('' to skip)")
    p.add_argument("--all-anchors", action="store_true", help="offline: also every completion position as an anchor")
    p.add_argument("--thinking", choices=("default", "on", "off"), default="default",
                   help="chat template enable_thinking (default: the template's default)")
    p.add_argument("--block-size", type=int, default=None, help="refuse to run unless the drafter uses this block size")
    p.add_argument("--shard", default=None, metavar="K/N",
                   help="evaluate only prompts K, K+N, K+2N, ... of the selected ones (0-based; sharding over hosts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host-label", default=None, help="host name recorded in env.json")
    args = p.parse_args(argv)
    if args.prompts is not None and args.prompts < 1:
        p.error("--prompts must be >= 1")
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    args.shard_index, args.shard_count = 0, 1
    if args.shard:
        try:
            k, n = (int(x) for x in args.shard.split("/"))
            assert 0 <= k < n
        except (ValueError, AssertionError):
            p.error(f"--shard must be K/N with 0 <= K < N, got {args.shard!r}")
        args.shard_index, args.shard_count = k, n
    try:
        args.budgets = [int(b) for b in args.ddtree_budgets.split(",") if b.strip()]
    except ValueError:
        p.error(f"--ddtree-budgets: not a comma-separated list of integers: {args.ddtree_budgets!r}")
    return args


# ----------------------------------------------------------------------------- output folder

def read_finished(path: Path) -> list[dict]:
    """Rows already in results.jsonl; a torn last line (killed mid-write) is dropped from the file."""
    if not path.exists():
        return []
    rows, good = [], 0
    raw = path.read_bytes()
    for line in raw.splitlines(keepends=True):
        try:
            rows.append(json.loads(line))
            good += len(line)
        except json.JSONDecodeError:
            break
    if good != len(raw):
        with open(path, "r+b") as f:
            f.truncate(good)
    return rows


def weight_hashes(ckpt) -> dict[str, str]:
    """sha256 per weight file, reused from a sync manifest in the folder when it covers the file
    with the same size."""
    from remote.checkpoint import MANIFEST, sha256_file

    manifest: dict = {}
    if (ckpt.path / MANIFEST).exists():
        try:
            manifest = {e["path"]: e for e in json.loads((ckpt.path / MANIFEST).read_text()).get("files", [])}
        except (json.JSONDecodeError, KeyError, TypeError):
            pass
    out = {}
    for f in ckpt.weight_files:
        entry = manifest.get(f.name)
        out[f.name] = entry["sha256"] if entry and entry.get("size") == f.stat().st_size else sha256_file(f)
    return out


def versions() -> dict:
    from importlib import metadata
    out = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "safetensors", "tokenizers", "flash-linear-attention", "triton"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


# ----------------------------------------------------------------------------- the run

def stop_ids(tokenizer, target) -> list[int]:
    ids = set()
    eos = getattr(target.generation_config, "eos_token_id", None) or getattr(target.config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
        if im_end is not None:
            ids.add(im_end)
    return sorted(i for i in ids if i is not None)


def preflight(args) -> None:
    from remote.inspect_cli import inspect

    for flag, value in (("--target", args.target), ("--drafter", args.drafter)):
        if not Path(value).expanduser().is_dir():
            raise WorkerError(f"{flag} {value}: no such folder", code=2)
    report = inspect(args.drafter, args.target, args.block_size)
    if not report["ok"]:
        raise WorkerError("pre-flight check failed:\n  - " + "\n  - ".join(report["problems"]))


def run(args) -> dict:
    preflight(args)
    from remote.prompts import load_suite, reference_turns
    from remote.prompts import PromptError
    try:
        suite = load_suite(args.suite, limit=args.prompts)
    except PromptError as e:
        raise WorkerError(str(e)) from None
    if not suite.rows:
        raise WorkerError(f"suite {args.suite}: no prompts")
    rows_to_do = suite.rows[args.shard_index::args.shard_count]
    client = None
    if args.sglang:
        from remote.sglang import SGLangClient
        from remote.sglang import SGLangError
        client = SGLangClient(args.sglang)
        try:
            client.health()
        except SGLangError as e:
            raise WorkerError(str(e)) from None

    out = Path(args.out)
    results_path = out / "results.jsonl"
    if results_path.exists() and results_path.stat().st_size and not args.resume:
        raise WorkerError(f"{results_path} already has results: pass --resume to continue it, or use another --out", 2)
    out.mkdir(parents=True, exist_ok=True)
    finished = read_finished(results_path) if args.resume else []
    done_ids = {r["id"] for r in finished}

    import torch
    from remote.target import gdn_kernel_path, load_target
    from remote.checkpoint import load_drafter
    torch.manual_seed(args.seed)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise WorkerError("--device cuda but torch sees no CUDA device (use --device cpu)", 2)
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    log(f"loading target {args.target} on {device} ({dtype})")
    target = load_target(args.target, device, dtype)
    for p in target.parameters():
        p.requires_grad_(False)
    drafter, ckpt = load_drafter(args.drafter, device=device, dtype=getattr(torch, dtype))
    tokenizer = None
    try:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(args.target)
    except Exception as e:  # rows with input_ids need no tokenizer
        if any(r.input_ids is None for r in rows_to_do):
            raise WorkerError(f"cannot load the target's tokenizer from {args.target}: {e}")
    stops = stop_ids(tokenizer, target)

    env = {"host": args.host_label or socket.gethostname(), "device": device,
           "gpu": torch.cuda.get_device_name(device) if device.startswith("cuda") else None,
           "dtype": dtype, "kernel_path": gdn_kernel_path(target), "versions": versions(),
           "drafter": {**ckpt.describe(), "sha256": weight_hashes(ckpt)},
           "target": {"path": str(Path(args.target).resolve()), "model_type": target.config.model_type,
                      "num_hidden_layers": getattr(getattr(target.config, "text_config", target.config), "num_hidden_layers", None)},
           "suite": {"name": suite.name, "sha256": suite.sha256, "prompts": len(suite.rows),
                     "shard": args.shard, "ids": [r.id for r in rows_to_do]},
           "settings": {"mode": args.mode, "max_new_tokens": args.max_new_tokens, "max_blocks": args.max_blocks,
                        "block_size": drafter.block_size, "enable_thinking": {"default": None, "on": True, "off": False}[args.thinking],
                        "ddtree_budgets": args.budgets if args.mode == "offline" else [],
                        "all_anchors": args.all_anchors, "reference": "sglang" if client else "local",
                        "sglang_url": args.sglang, "stop_token_ids": stops},
           "seed": args.seed, "command": [sys.executable, "-m", "remote.worker", *sys.argv[1:]],
           "started_at": now(), "finished_at": None}
    (out / "env.json").write_text(json.dumps(env, indent=2))

    emit("start", prompts=len(rows_to_do), done=len(done_ids), mode=args.mode)
    rows = list(finished)
    with open(results_path, "a") as results:
        for index, row in enumerate(rows_to_do):
            if row.id in done_ids:
                continue
            t0 = time.perf_counter()
            result = evaluate_row(args, row, target, drafter, tokenizer, client, stops, reference_turns)
            results.write(json.dumps(result) + "\n")
            results.flush()
            os.fsync(results.fileno())
            rows.append(result)
            tau_running = sum(sum(r["acceptance_lengths"]) for r in rows) / max(1, sum(len(r["acceptance_lengths"]) for r in rows))
            emit("prompt", id=row.id, index=index, done=len(rows), prompts=len(rows_to_do), cycles=result["cycles"],
                 tau=result["tau"], tau_running=tau_running)
            log(f"{row.id}: {result['cycles']} cycles, tau {result['tau']:.2f} ({time.perf_counter() - t0:.1f}s)")

    from remote.metrics import summarize
    order = {r.id: i for i, r in enumerate(suite.rows)}
    rows.sort(key=lambda r: order.get(r["id"], len(order)))
    summary = summarize(rows, drafter.block_size, args.mode)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    env["finished_at"] = now()
    (out / "env.json").write_text(json.dumps(env, indent=2))
    emit("end", summary=summary)
    return summary


def evaluate_row(args, row, target, drafter, tokenizer, client, stops, reference_turns) -> dict:
    """All turns of one prompt row -> one results row (docs/run-format.md)."""
    import torch
    from remote.metrics import row_stats
    from remote.offline import evaluate_offline
    from remote.online import speculative_generate, target_greedy

    device = next(target.parameters()).device
    thinking = {"default": None, "on": True, "off": False}[args.thinking]
    turn_stats: list[dict] = []

    def complete(prompt_ids: list[int]) -> list[int]:
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
        if args.mode == "online":
            spec = speculative_generate(target, drafter, ids, args.max_new_tokens, stops)
            base = target_greedy(target, ids, args.max_new_tokens, stops)
            turn_stats.append({"acceptance_lengths": spec.acceptance_lengths, "wall_s": spec.wall_s,
                               "target_wall_s": base.wall_s, "lossless": spec.output_ids == base.output_ids})
            return spec.output_ids
        if client is not None:
            return client.generate(prompt_ids, args.max_new_tokens, stops)
        return target_greedy(target, ids, args.max_new_tokens, stops).output_ids

    turns = reference_turns(row, tokenizer, complete, thinking)
    if args.mode == "offline":
        for turn in turns:
            turn_stats.append(evaluate_offline(drafter, target, turn.prompt_ids, turn.output_ids,
                                               max_blocks=args.max_blocks, budgets=args.budgets,
                                               all_anchors=args.all_anchors))
    acceptance = [n for s in turn_stats for n in s["acceptance_lengths"]]
    result = {"id": row.id, "category": row.category, "reference": "sglang" if client else "local",
              "prompt_ids": list(turns[-1].prompt_ids), "output_ids": list(turns[-1].output_ids),
              "acceptance_lengths": acceptance, **row_stats(acceptance)}
    if len(turns) > 1:
        result["turns"] = [{"prompt_ids": list(t.prompt_ids), "output_ids": list(t.output_ids),
                            "acceptance_lengths": s["acceptance_lengths"]} for t, s in zip(turns, turn_stats)]
    if args.mode == "offline":
        if args.budgets:
            result["ddtree"] = {}
            for b in map(str, args.budgets):
                lengths = [n for s in turn_stats for n in s["ddtree"][b]["acceptance_lengths"]]
                result["ddtree"][b] = {"acceptance_lengths": lengths, "tau": row_stats(lengths)["tau"]}
        if args.all_anchors:
            result["all_anchors"] = {k: [sum(v) for v in zip(*(s["all_anchors"][k] for s in turn_stats))]
                                     for k in ("correct", "count")}
    else:
        result["wall_s"] = sum(s["wall_s"] for s in turn_stats)
        result["target_wall_s"] = sum(s["target_wall_s"] for s in turn_stats)
        result["lossless"] = all(s["lossless"] for s in turn_stats)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        run(args)
        return 0
    except WorkerError as e:
        emit("error", message=str(e))
        log(f"error: {e}")
        return e.code
    except Exception as e:  # finished prompts are already on disk
        import traceback
        traceback.print_exc()
        emit("error", message=f"{type(e).__name__}: {e}")
        return 3


if __name__ == "__main__":
    raise SystemExit(main())
