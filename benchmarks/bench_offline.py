"""Offline eval throughput and hidden-state capture memory, CPU, one run, ratios printed.

1. anchors/s: drafts for every completion position of the same reference sequences, computed
   (a) the way the worker does (batched anchor-block mask, chunks of anchors, context K/V once)
   and (b) like the seed harness (one anchor at a time, context re-projected for every anchor).
   Both must give identical drafts.
2. peak memory of one target forward: forward hooks on the K drafter layers vs
   ``output_hidden_states=True`` (every layer kept), each in a fresh subprocess (peak RSS).

    python benchmarks/bench_offline.py [--seq-len 384] [--layers 16] [--hidden 256]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch


def build(layers: int, hidden: int, vocab: int = 512):
    from remote.tiny import tiny_drafter, tiny_drafter_config, tiny_target
    target = tiny_target("qwen3", vocab_size=vocab, hidden_size=hidden, num_layers=layers, tie=False)
    ids = [1, layers // 4, layers // 2, 3 * layers // 4, layers - 2]
    cfg = tiny_drafter_config(target, layers=2, block_size=16, target_layer_ids=ids)
    return target, tiny_drafter(cfg)


def throughput(args) -> None:
    from remote.drafter import block_input_ids
    from remote.offline import DraftTable
    from remote.target import target_features

    torch.manual_seed(0)
    target, drafter = build(args.layers, args.hidden)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    prompt = 32
    seqs = [torch.randint(0, 500, (args.seq_len,), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    with torch.no_grad():
        feats = [target_features(target, s[None], drafter.config.target_layer_ids)[1] for s in seqs]
        t0 = time.perf_counter()
        batched = []
        for s, th in zip(seqs, feats):
            table = DraftTable(drafter, th, s, embed.weight, head, chunk=64, cut_last_blocks=False)
            table.compute(range(prompt, s.numel() - 1))
            batched.append([table.tokens[p] for p in range(prompt, s.numel() - 1)])
        t_batched = time.perf_counter() - t0
        t0 = time.perf_counter()
        looped = []
        for s, th in zip(seqs, feats):
            out = []
            for p in range(prompt, s.numel() - 1):
                noise = embed(block_input_ids(s[p:p + 1], 16, drafter.config.mask_token_id))[None]
                out.append(head(drafter.draft(noise, p, th[:, :p])[0][:, 1:]).argmax(-1)[0].tolist())
            looped.append(out)
        t_loop = time.perf_counter() - t0
    assert batched == looped, "batched and per-anchor drafts differ"
    n = sum(len(b) for b in batched)
    print(f"anchors: {n} (2 sequences x {args.seq_len - prompt - 1}), block 16, threads {torch.get_num_threads()}")
    print(f"batched mask: {n / t_batched:8.1f} anchors/s   per-anchor loop (seed harness): {n / t_loop:8.1f} anchors/s")
    print(f"ratio (batched / per-anchor): {t_loop / t_batched:.1f}x   drafts identical: True")


def capture_child(args) -> None:
    """In a subprocess: one forward, report what was kept and the peak RSS."""
    from remote.target import target_features
    torch.manual_seed(0)
    target, drafter = build(args.layers, args.hidden)
    ids = torch.randint(0, 500, (1, args.mem_len))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.no_grad():
        if args.child == "hooks":
            _, th = target_features(target, ids, drafter.config.target_layer_ids)
            kept = th.numel() * th.element_size()
        else:
            out = target(input_ids=ids, output_hidden_states=True)
            kept = sum(h.numel() * h.element_size() for h in out.hidden_states)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"kept_bytes": kept, "peak_rss_kib": peak, "rss_growth_kib": peak - base}))


def memory(args) -> None:
    res = {}
    for mode in ("hooks", "hidden_states"):
        out = subprocess.run([sys.executable, __file__, "--child", mode, "--layers", str(args.layers), "--hidden",
                              str(args.hidden), "--mem-len", str(args.mem_len)], capture_output=True, text=True,
                             check=True)
        res[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    h, a = res["hooks"], res["hidden_states"]
    print(f"one forward of {args.mem_len} tokens, {args.layers} layers x hidden {args.hidden}:")
    print(f"  kept: hooks {h['kept_bytes'] / 2**20:.1f} MiB   output_hidden_states {a['kept_bytes'] / 2**20:.1f} MiB"
          f"   ratio {a['kept_bytes'] / h['kept_bytes']:.1f}x")
    # RSS is coarse (the allocator reuses memory freed after model init), so it is shown, not divided
    print(f"  peak RSS growth during the forward: hooks {h['rss_growth_kib'] / 1024:.0f} MiB   "
          f"output_hidden_states {a['rss_growth_kib'] / 1024:.0f} MiB")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=384)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--mem-len", type=int, default=4096)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return capture_child(args)
    throughput(args)
    memory(args)


if __name__ == "__main__":
    main()
