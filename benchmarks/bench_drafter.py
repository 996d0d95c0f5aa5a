"""Batched anchor-block mask vs the per-anchor loop (every position an anchor), CPU, tiny drafter.

Prints one ratio: per-anchor loop time / batched time, measured in the same run on the same
sequences, after checking that both paths give the same logits.  Goal: >= 10x.

    python benchmarks/bench_drafter.py [--seq-len 256] [--block-size 16] [--chunk 64] [--repeats 3]
"""
from __future__ import annotations

import argparse
import time

import torch

from remote.drafters.dflash import DFlashDrafter, block_input_ids, init_weights
from remote.drafters.config import DrafterConfig


def per_anchor_loop(model, target_hidden, noise):
    B = model.block_size
    return torch.cat([model.draft(noise[:, p * B:(p + 1) * B], p, target_hidden[:, :p])[0]
                      for p in range(target_hidden.shape[1])], 1)


def batched(model, target_hidden, noise, chunk):
    B, T = model.block_size, target_hidden.shape[1]
    outs = []
    for start in range(0, T, chunk):
        anchors = torch.arange(start, min(start + chunk, T))[None]
        outs.append(model.forward_anchors(target_hidden[:, : anchors.max() + 1], noise[:, start * B:(start + anchors.numel()) * B], anchors))
    return torch.cat(outs, 1)


def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=32, help="anchors per batched forward")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=64)
    args = ap.parse_args()
    torch.manual_seed(0)
    H, V, T = args.hidden, 512, args.seq_len
    cfg = DrafterConfig(hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, target_layer_ids=[1, 5, 9, 13, 17], mask_token_id=V - 1,
                        vocab_size=V, block_size=args.block_size)
    model = DFlashDrafter(cfg).eval()
    init_weights(model, std=0.05)
    embed = torch.nn.Embedding(V, H)
    target_hidden = torch.randn(1, T, 5 * H)
    ids = torch.randint(0, V - 1, (1, T))
    with torch.no_grad():
        noise = embed(block_input_ids(ids[0], cfg.block_size, cfg.mask_token_id))[None]
        t_loop, ref = best_of(lambda: per_anchor_loop(model, target_hidden, noise), args.repeats)
        t_batch, out = best_of(lambda: batched(model, target_hidden, noise, args.chunk), args.repeats)
    diff = (out - ref).abs().max().item()
    assert diff < 1e-4, f"paths disagree: max |diff| = {diff}"
    print(f"anchors={T} block={cfg.block_size} chunk={args.chunk} threads={torch.get_num_threads()}")
    print(f"per-anchor loop: {t_loop * 1e3:.1f} ms   batched mask: {t_batch * 1e3:.1f} ms   max|diff| {diff:.2e}")
    print(f"ratio (per-anchor / batched): {t_loop / t_batch:.1f}x")


if __name__ == "__main__":
    main()
