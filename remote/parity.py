"""Train/eval parity: the same checkpoint's teacher-forced per-position accuracy, computed the
training way (all anchors at once through the anchor-block mask) and the eval way (one anchor at a
time, context slice ``[:p]``), plus the classic mistake (context ``[:p+1]``) for reference.

``python -m remote.parity --target DIR --drafter DIR --results results.jsonl --out parity.json``

If the first two columns disagree, the eval path does not reproduce training semantics; a
checkpoint whose training log says 3.58 while an eval says 0.33 is diagnosed here in one run.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _turns(row: dict) -> list[tuple[list[int], list[int]]]:
    return [(t["prompt_ids"], t["output_ids"]) for t in row.get("turns") or [row]]


def parity(drafter, target, pairs: list[tuple[list[int], list[int]]], max_anchors: int | None = None) -> dict:
    import torch

    from remote.decode.offline import DraftTable
    from remote.target.model import target_features

    device = next(target.parameters()).device
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    n = drafter.config.num_drafts
    methods = ("training", "eval", "eval_ctx_plus_one")
    hits = {m: [0] * n for m in methods}
    count = [0] * n
    disagreements = 0            # draft tokens where the two paths differ (expected 0 in fp32)
    anchors_done = 0
    with torch.no_grad():
        for prompt, output in pairs:
            ref = list(prompt) + list(output)
            if len(ref) < len(prompt) + 2:
                continue
            ids = torch.tensor(ref, device=device)
            _, th = target_features(target, ids[None], drafter.config.target_layer_ids)
            th = th.to(next(drafter.parameters()).dtype)
            anchors = list(range(len(prompt), len(ref) - 1))
            if max_anchors is not None:
                anchors = anchors[:max(0, max_anchors - anchors_done)]
            if not anchors:
                break
            table = DraftTable(drafter, th, ids, embed.weight, head, cut_last_blocks=False)
            table.compute(anchors)
            for p in anchors:
                batched = table.tokens[p]
                per_anchor = _draft_tokens(drafter, th, p, ids[p:p + 1], embed.weight, head)
                plus_one = _draft_tokens(drafter, th, p, ids[p:p + 1], embed.weight, head, extra_context=True)
                for k in range(min(n, len(ref) - 1 - p)):
                    truth = ref[p + 1 + k]
                    count[k] += 1
                    hits["training"][k] += int(batched[k] == truth)
                    hits["eval"][k] += int(per_anchor[k] == truth)
                    hits["eval_ctx_plus_one"][k] += int(plus_one[k] == truth)
                disagreements += sum(a != b for a, b in zip(batched, per_anchor))
            anchors_done += len(anchors)
    acc = {m: [h / c if c else 0.0 for h, c in zip(hits[m], count)] for m in methods}
    cum = {}
    for m in methods:
        run, cum[m] = 1.0, []
        for a in acc[m]:
            run *= a
            cum[m].append(run)
    return {"anchors": anchors_done, "block_size": drafter.block_size, "count": count, "accuracy": acc,
            "cumulative": cum, "tau_estimate": {m: 1 + sum(cum[m]) for m in methods},
            "draft_disagreements": disagreements, "agree": disagreements == 0}


def _draft_tokens(drafter, th, p, anchor_token, embed_weight, head, extra_context: bool = False) -> list[int]:
    """The per-anchor path's full-block drafts at ``p``: context ``[:p]``, or with
    ``extra_context`` the mistaken ``[:p+1]`` (one token too many, every key visible), block
    positions as usual."""
    import torch

    from remote.drafters.dflash import block_input_ids

    B = drafter.block_size
    noise = drafter.embed(block_input_ids(anchor_token, B, drafter.config.mask_token_id)[None], embed_weight)
    noise = noise.to(th.dtype)
    if extra_context:
        positions = torch.arange(p + B, device=th.device)[None]
        cos, sin = drafter.rope(positions, th.dtype)
        kv = drafter.context_kv(th[:, :p + 1], (cos[:, :p + 1], sin[:, :p + 1]))
        hidden = drafter(noise, (cos[:, p:], sin[:, p:]), kv, [None] * len(drafter.layers))
    else:
        hidden, _ = drafter.draft(noise, p, th[:, :p])
    return drafter.propose(drafter.draft_slots(hidden), anchor_token, head, embed_weight=embed_weight).tokens[0].tolist()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m remote.parity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--results", required=True, help="results.jsonl of a run (prompt and reference completions)")
    ap.add_argument("--out", required=True, help="parity.json to write")
    ap.add_argument("--max-anchors", type=int, default=2000)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    args = ap.parse_args(argv)
    import torch

    from remote.drafters.checkpoint import load_drafter
    from remote.target.model import load_target
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    target = load_target(args.target, device, dtype)
    drafter, _ = load_drafter(args.drafter, device=device, dtype=getattr(torch, dtype))
    rows = [json.loads(line) for line in Path(args.results).read_text().splitlines() if line.strip()]
    pairs = [pair for row in rows for pair in _turns(row)]
    report = parity(drafter, target, pairs, args.max_anchors)
    report.update(device=device, dtype=dtype, drafter=args.drafter, target=args.target)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
