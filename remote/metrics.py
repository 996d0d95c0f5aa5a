"""Acceptance metrics (τ includes the bonus token; see docs/run-format.md)."""
from __future__ import annotations


def row_stats(acceptance_lengths: list[int]) -> dict:
    cycles, tokens = len(acceptance_lengths), sum(acceptance_lengths)
    return {"cycles": cycles, "tokens": tokens, "tau": tokens / cycles if cycles else None}


def tau_summary(per_prompt: list[list[int]]) -> dict:
    """``tau_macro`` (mean of per-prompt means, z-lab) and ``tau_pooled`` (Σ tokens / Σ cycles)."""
    rows = [row_stats(a) for a in per_prompt if a]
    cycles = sum(r["cycles"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    return {"tau_macro": sum(r["tau"] for r in rows) / len(rows) if rows else None,
            "tau_pooled": tokens / cycles if cycles else None, "cycles": cycles, "tokens": tokens}


def histogram(per_prompt: list[list[int]], block_size: int) -> dict[str, int]:
    hist = {str(k): 0 for k in range(1, block_size + 1)}
    for lengths in per_prompt:
        for n in lengths:
            hist[str(n)] += 1
    return hist


def per_position_acceptance(per_prompt: list[list[int]], block_size: int) -> list[float]:
    """acc_k = (cycles with length >= k + 1) / cycles, k = 1..B-1; τ_pooled = 1 + Σ acc_k."""
    lengths = [n for a in per_prompt for n in a]
    if not lengths:
        return [0.0] * (block_size - 1)
    return [sum(n >= k + 1 for n in lengths) / len(lengths) for k in range(1, block_size)]


def responses(rows: list[dict]) -> list[dict]:
    """One entry per response: each turn of a multi-turn row, else the row itself."""
    return [t for r in rows for t in (r.get("turns") or [r])]


def tau_sglang(rows: list[dict]) -> float | None:
    """τ as SGLang reports it, ``Σ completion_tokens / Σ spec_verify_ct``: every response's first
    token (from the prefill) counts as a completion token, verify cycles are the cycles."""
    per_response = [t["acceptance_lengths"] for t in responses(rows)]
    cycles = sum(len(a) for a in per_response)
    return sum(1 + sum(a) for a in per_response) / cycles if cycles else None


def expected_summary(rows: list[dict]) -> dict:
    """T > 0 offline: the expected acceptance along the reference completions (an estimate)."""
    parts = [r["expected"] for r in rows if r.get("expected")]
    alpha = [sum(v) for v in zip(*(p["alpha_sum"] for p in parts))]
    count = [sum(v) for v in zip(*(p["count"] for p in parts))]
    anchors = sum(p["anchors"] for p in parts)
    return {"label": "estimate: α_k = Σ_x min(p_k(x), q_k(x)) along the reference completion, "
                     "expected τ = 1 + Σ_k Π_{j≤k} α_j, averaged over anchors",
            "alpha": [a / n if n else None for a, n in zip(alpha, count)],
            "tau": sum(p["tau_sum"] for p in parts) / anchors if anchors else None, "anchors": anchors}


def summarize(rows: list[dict], block_size: int, mode: str, max_length: int | None = None) -> dict:
    """``max_length``: the most tokens a cycle can commit (default ``block_size``; ``B + 1`` for a
    sample_from_anchor drafter)."""
    per_prompt = [r["acceptance_lengths"] for r in rows]
    longest = max_length or block_size
    summary = {"mode": mode, "block_size": block_size, "prompts": len(rows), **tau_summary(per_prompt),
               "tau_macro_turns": tau_summary([t["acceptance_lengths"] for t in responses(rows)])["tau_macro"],
               "tau_sglang": tau_sglang(rows), "responses": len(responses(rows)),
               "acceptance_histogram": histogram(per_prompt, longest),
               "per_position_acceptance": per_position_acceptance(per_prompt, longest)}
    if any(r.get("expected") for r in rows):
        summary["expected"] = expected_summary(rows)
    budgets = sorted({b for r in rows for b in (r.get("ddtree") or {})}, key=int)
    if budgets:
        summary["ddtree"] = {}
        for b in budgets:
            t = tau_summary([r["ddtree"][b]["acceptance_lengths"] for r in rows if b in r.get("ddtree", {})])
            summary["ddtree"][b] = {"tau_macro": t["tau_macro"], "tau_pooled": t["tau_pooled"]}
    if any("all_anchors" in r for r in rows):
        drafts = max(len(r["all_anchors"]["correct"]) for r in rows if "all_anchors" in r)
        correct = [0] * drafts
        count = [0] * drafts
        for r in rows:
            for k, (c, n) in enumerate(zip(r["all_anchors"]["correct"], r["all_anchors"]["count"])):
                correct[k] += c
                count[k] += n
        acc = [c / n if n else 0.0 for c, n in zip(correct, count)]
        cum, run = [], 1.0
        for a in acc:
            run *= a
            cum.append(run)
        summary["all_anchors_accuracy"], summary["all_anchors_cumulative"] = acc, cum
    if rows and all("wall_s" in r for r in rows):
        wall = sum(r["wall_s"] for r in rows)
        target_wall = sum(r.get("target_wall_s") or 0.0 for r in rows)
        tokens = sum(len(t["output_ids"]) for r in rows for t in (r.get("turns") or [r]))
        online = {"wall_s": wall, "tokens_per_s": tokens / wall if wall else None}
        if target_wall:
            online.update(target_wall_s=target_wall, target_tokens_per_s=tokens / target_wall,
                          speedup=target_wall / wall if wall else None)
        checked = [r.get("lossless", True) for r in rows if r.get("lossless", True) is not None]
        online["lossless"] = all(checked) if checked else None   # None: sampled, not checkable per prompt
        summary["online"] = online
    return summary
