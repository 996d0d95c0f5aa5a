"""Offline eval throughput and memory vs the seed harness's per-anchor loop, CPU, one run, ratios printed.

Drafts for every completion position of reference sequences (prompt + ``--completion`` tokens),
z-lab's drafter shape ratio (5 target layers, block 16, 2 drafter layers):

* **ours**: what the worker runs (:class:`remote.decode.offline.DraftTable`): the context K/V of the
  sequence projected once, anchors batched in chunks through the anchor-block mask;
* **seed loop**: the seed harness, one anchor at a time, the context ``[:p]`` re-projected through
  ``fc`` and every layer's k/v for every anchor (``DFlashDrafter.draft`` without past K/V).

Printed: anchors/s of both and the ratio (goal >= 10x), the peak memory of each (RSS growth of a
fresh subprocess over the models and inputs, Linux peak RSS reset before the path, CPU; ``torch.cuda.max_memory_allocated`` on CUDA) and
max |Δ| of the draft logits and of the argmax drafts (must be 0). The seed loop's cost grows with
the anchor's position, so by default it is timed on ``--seed-anchors`` anchors spread evenly over
the completion (its anchors/s is then an unbiased estimate of the whole loop's; the drafts are
compared on those anchors); ``--full`` runs it on every anchor (about an hour on a loaded 2-core
CPU at the default size).

``--capture`` adds the hidden-state capture comparison (forward hooks on the 5 layers vs
``output_hidden_states=True``).

    python benchmarks/bench_offline.py [--completion 2048] [--hidden 256] [--full] [--capture] [--device cuda]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = 64


def build(args):
    from remote.drafters.tiny import tiny_drafter, tiny_drafter_config, tiny_target
    L = args.layers
    target = tiny_target("qwen3", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=L, tie=False)
    ids = [1, L // 4, L // 2, 3 * L // 4, L - 2]                       # 5 target layers, as z-lab's drafters
    cfg = tiny_drafter_config(target, layers=2, block_size=16, target_layer_ids=ids)
    drafter = tiny_drafter(cfg)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    return target.to(args.device, dtype), drafter.to(args.device, dtype)


def inputs(args, target, drafter):
    """The reference sequence and its target features (one target forward, as the worker does)."""
    from remote.target.model import target_features
    T = PROMPT + args.completion
    ids = torch.randint(0, args.vocab - 1, (T,), generator=torch.Generator().manual_seed(0)).to(args.device)
    with torch.no_grad():
        _, th = target_features(target, ids[None, :-1], drafter.config.target_layer_ids)
    return ids, th


def seed_anchors(args) -> list[int]:
    anchors = list(range(PROMPT, PROMPT + args.completion - 1))
    if args.full or args.seed_anchors >= len(anchors):
        return anchors
    step = len(anchors) / args.seed_anchors
    return [anchors[int(i * step + step / 2)] for i in range(args.seed_anchors)]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def run_ours(args, target, drafter, ids, th):
    """Every anchor of the completion through the worker's DraftTable; logits of the seed anchors."""
    from remote.decode.offline import DraftTable
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    sync(args.device)
    t0 = time.perf_counter()
    table = DraftTable(drafter, th, ids, embed.weight, head, chunk=args.chunk, cut_last_blocks=False)
    table.compute(range(PROMPT, ids.numel() - 1))
    sync(args.device)
    elapsed = time.perf_counter() - t0
    picked = seed_anchors(args)
    # the logits of the compared anchors, recomputed the same way (outside the timing)
    B = drafter.block_size
    ctx = table._context_kv()
    logits = []
    for i in range(0, len(picked), args.chunk):
        a = torch.tensor(picked[i:i + args.chunk], device=ids.device)
        T = int(a.max()) + 1
        h = drafter.forward_anchors(th[:, :T], table._noise(ids[a], B)[None], a[None],
                                    ctx_kv=[(k[:, :, :T], v[:, :, :T]) for k, v in ctx])
        logits.append(drafter.logits(drafter.draft_slots(h.view(len(a), B, -1)), head).float())
    return {"anchors": ids.numel() - 1 - PROMPT, "seconds": elapsed,
            "drafts": [table.tokens[p] for p in picked], "logits": torch.cat(logits)}


@torch.no_grad()
def run_seed(args, target, drafter, ids, th):
    """The seed harness: one anchor at a time, context [:p] re-projected every time."""
    from remote.drafters.dflash import block_input_ids
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    picked = seed_anchors(args)
    drafts, logits = [], []
    sync(args.device)
    t0 = time.perf_counter()
    for p in picked:
        noise = embed(block_input_ids(ids[p:p + 1], 16, drafter.config.mask_token_id))[None]
        out = drafter.logits(drafter.draft(noise, p, th[:, :p])[0][:, 1:], head)
        drafts.append(out.argmax(-1)[0].tolist())
        logits.append(out.float())
    sync(args.device)
    return {"anchors": len(picked), "seconds": time.perf_counter() - t0, "drafts": drafts,
            "logits": torch.cat(logits)}


def proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> int:
    """Return freed heap to the OS and reset the peak RSS (Linux ``clear_refs``), so the peak that
    follows is the measured path's; returns the current RSS in bytes (the baseline)."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    Path("/proc/self/clear_refs").write_text("5")
    return proc_status_kib("VmRSS") * 1024


def child(args) -> None:
    """In a fresh process: build the models, load the sequence and its features (computed by the
    parent, so the target forward's memory is not in this process's peak), run one path; save its
    timing, drafts, logits and peak memory growth."""
    torch.manual_seed(0)
    target, drafter = build(args)
    saved = torch.load(args.inputs)
    ids, th = saved["ids"].to(args.device), saved["th"].to(args.device)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = reset_peak_rss()
    res = (run_ours if args.child == "ours" else run_seed)(args, target, drafter, ids, th)
    if args.device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = proc_status_kib("VmHWM") * 1024 - base
    torch.save({**res, "peak_bytes": peak}, args.result)


def capture_child(args) -> None:
    """``--capture`` in a fresh process: one target forward over ``--mem-len`` tokens, hooks on the
    K drafter layers vs ``output_hidden_states=True`` (every layer kept); kept bytes and RSS growth."""
    from remote.target.model import target_features
    torch.manual_seed(0)
    target, drafter = build(args)
    ids = torch.randint(0, args.vocab - 1, (1, args.mem_len))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.no_grad():
        if args.child == "hooks":
            _, th = target_features(target, ids, drafter.config.target_layer_ids)
            kept = th.numel() * th.element_size()
        else:
            out = target(input_ids=ids, output_hidden_states=True)
            kept = sum(h.numel() * h.element_size() for h in out.hidden_states)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"kept_bytes": kept, "rss_growth_kib": peak - base}))


def capture_memory(args) -> None:
    res = {}
    for mode in ("hooks", "hidden_states"):
        out = subprocess.run([sys.executable, __file__, "--child", mode, "--layers", str(args.layers), "--hidden",
                              str(args.hidden), "--mem-len", str(args.mem_len)], capture_output=True, text=True,
                             check=True)
        res[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    h, a = res["hooks"], res["hidden_states"]
    print(f"hidden-state capture, one forward of {args.mem_len} tokens: kept by hooks {h['kept_bytes'] / 2**20:.1f} MiB,"
          f" by output_hidden_states {a['kept_bytes'] / 2**20:.1f} MiB ({a['kept_bytes'] / h['kept_bytes']:.1f}x); "
          f"RSS growth {h['rss_growth_kib'] / 1024:.0f} vs {a['rss_growth_kib'] / 1024:.0f} MiB")


def run_child(args, which: str, result: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", which, "--result", str(result), "--inputs", str(result.parent / "in.pt")]
    for name in ("completion", "hidden", "layers", "vocab", "chunk", "seed_anchors", "device", "dtype", "threads"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.full:
        cmd.append("--full")
    subprocess.run(cmd, check=True)
    return torch.load(result)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--completion", type=int, default=2048, help="completion tokens per sequence")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=16, help="target decoder layers")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=64, help="anchors per batched forward (ours)")
    ap.add_argument("--seed-anchors", type=int, default=96, help="anchors the seed loop is timed on")
    ap.add_argument("--rounds", type=int, default=2, help="alternated runs of both paths; the best of each counts")
    ap.add_argument("--full", action="store_true", help="the seed loop over every anchor (slow)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared machine)")
    ap.add_argument("--capture", action="store_true",
                    help="also compare hook capture with output_hidden_states (peak memory of one forward)")
    ap.add_argument("--mem-len", type=int, default=4096, help="tokens of the --capture forward")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--inputs", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.child in ("hooks", "hidden_states"):
        return capture_child(args)
    if args.child:
        return child(args)

    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        ids, th = inputs(args, *build(args))
        torch.save({"ids": ids.cpu(), "th": th.cpu()}, Path(tmp) / "in.pt")
        ours, seed = None, None
        for _ in range(args.rounds):       # alternated, best of each: background load hits both alike
            o, sd = run_child(args, "ours", Path(tmp) / "ours.pt"), run_child(args, "seed", Path(tmp) / "seed.pt")
            ours = o if ours is None or o["seconds"] < ours["seconds"] else ours
            seed = sd if seed is None or sd["seconds"] < seed["seconds"] else seed
    rate_ours, rate_seed = ours["anchors"] / ours["seconds"], seed["anchors"] / seed["seconds"]
    d_logits = (ours["logits"] - seed["logits"]).abs().max().item()
    d_drafts = sum(a != b for x, y in zip(ours["drafts"], seed["drafts"]) for a, b in zip(x, y))
    mib = 2 ** 20
    print(f"{args.completion}-token completion + {PROMPT}-token prompt, target {args.layers} layers x hidden "
          f"{args.hidden}, drafter 2 layers, 5 target layers, block 16, {args.device} {args.dtype}, "
          f"threads {args.threads}")
    print(f"ours (context K/V once, {args.chunk} anchors per forward): {rate_ours:9.1f} anchors/s over "
          f"{ours['anchors']} anchors, peak memory {ours['peak_bytes'] / mib:7.1f} MiB")
    print(f"seed loop (context re-projected per anchor):  {rate_seed:9.1f} anchors/s over {seed['anchors']} "
          f"anchors{'' if args.full else ' spread over the completion'}, peak memory "
          f"{seed['peak_bytes'] / mib:7.1f} MiB")
    print(f"max |Δ| draft logits {d_logits:.2e}   draft tokens differing (argmax): {d_drafts}")
    print(f"ratio ours / seed loop: {rate_ours / rate_seed:.1f}x   (goal >= 10x)")
    if args.capture:
        capture_memory(args)
    if d_drafts and args.dtype == "float32":      # bf16: different kernels may flip a near tie; reported
        sys.exit("argmax drafts differ between the two paths")


if __name__ == "__main__":
    main()
