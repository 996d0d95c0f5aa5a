"""An eval run's metrics, recomputed from its ``results.jsonl`` rows, and where the worker's
``summary.json`` disagrees with them.

All arithmetic is :mod:`remote.contract.metrics` (the worker's own implementation, stdlib only); this
module adds what a report needs on top: per-prompt stored-vs-recomputed values, τ per category,
and lengths outside 1..B. The consistency check catches a damaged or hand-edited run folder
(the two files are written by one function, so on a healthy run they always agree).
"""
from __future__ import annotations

import math
from typing import Optional

from remote.contract.metrics import category_summary, out_of_range, row_stats, summarize

TAU_CONVENTIONS = ("τ counts the tokens one draft–verify cycle commits, bonus token included. tau_macro: mean of "
                   "per-prompt τ; tau_macro_turns: mean over responses, one per turn of a multi-turn prompt (how "
                   "z-lab's benchmark.py and DDTree average MT-Bench; equal to tau_macro on single-turn suites); "
                   "tau_pooled: Σ tokens / Σ cycles (vLLM, Spec-Bench); tau_sglang: Σ completion_tokens / "
                   "Σ spec_verify_ct exactly as SGLang reports it (every response's first token counted), to set "
                   "beside a served SGLang number.")


def multi_turn_note(m: dict) -> Optional[str]:
    """What a report says of a multi-turn suite (None for single-turn runs)."""
    if not m.get("responses") or m["responses"] == m.get("prompts"):
        return None
    return (f"Multi-turn suite: {m['responses']} responses (turns) over {m['prompts']} prompts. z-lab and DDTree "
            f"average per turn: tau_macro_turns is the number to set beside theirs.")


def compute_metrics(rows: list[dict], block_size: int, mode: Optional[str] = None,
                    max_length: Optional[int] = None) -> dict:
    """summary.json's fields recomputed from the rows, plus ``max_length``, ``per_prompt``,
    ``categories`` and ``out_of_range_lengths``. ``max_length``: the most tokens one cycle can commit
    (the run's ``verify_block``: B, or B + 1 for a sample_from_anchor drafter; default B)."""
    longest = int(max_length or block_size)
    m = summarize(rows, int(block_size), mode, max_length=longest)
    m["max_length"] = longest
    per_prompt = [list(r.get("acceptance_lengths") or []) for r in rows]
    m["out_of_range_lengths"] = out_of_range(per_prompt, longest)
    m["per_prompt"] = [{"id": r.get("id"), "category": r.get("category"), **row_stats(a),
                        "stored_tau": r.get("tau"), "stored_tokens": r.get("tokens"),
                        "stored_cycles": r.get("cycles")} for r, a in zip(rows, per_prompt)]
    categories = category_summary(rows)
    if categories:
        m["categories"] = categories
    return m


def _close(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-4, abs_tol=5e-4)
    except (TypeError, ValueError):
        return a == b


def _fmt(x) -> str:
    return f"{x:.4f}" if isinstance(x, float) else str(x)


def summary_disagreements(computed: dict, summary: Optional[dict]) -> list[str]:
    """Where summary.json disagrees with the recomputation from results.jsonl; also rows whose
    stored tau/tokens/cycles disagree with their lengths, and lengths outside 1..B."""
    out: list[str] = []
    bad_rows = [p for p in computed.get("per_prompt", [])
                if (p["stored_tokens"] is not None and p["stored_tokens"] != p["tokens"])
                or (p["stored_cycles"] is not None and p["stored_cycles"] != p["cycles"])
                or (p["stored_tau"] is not None and not _close(p["stored_tau"], p["tau"]))]
    if bad_rows:
        ids = ", ".join(str(p["id"]) for p in bad_rows[:5]) + (" …" if len(bad_rows) > 5 else "")
        out.append(f"{len(bad_rows)} row(s) of results.jsonl store tau/tokens/cycles that disagree with "
                   f"their acceptance_lengths ({ids}); the lengths are used")
    if computed.get("out_of_range_lengths"):
        out.append(f"{computed['out_of_range_lengths']} acceptance length(s) outside "
                   f"1..{computed.get('max_length') or computed['block_size']}")
    if summary is None:
        return out
    for key in ("prompts", "cycles", "tokens", "tau_macro", "tau_pooled", "tau_macro_turns", "tau_sglang",
                "block_size"):
        if key in summary and not _close(summary[key], computed.get(key)):
            out.append(f"summary.json {key} = {summary[key]} but results.jsonl gives {_fmt(computed.get(key))}")
    if "mode" in summary and computed.get("mode") and summary["mode"] != computed["mode"]:
        out.append(f"summary.json mode = {summary['mode']} but the run says {computed['mode']}")
    sh = summary.get("acceptance_histogram")
    if isinstance(sh, dict):
        diff = [k for k in computed["acceptance_histogram"]
                if int(sh.get(k, 0) or 0) != computed["acceptance_histogram"][k]]
        if diff:
            out.append(f"summary.json acceptance_histogram differs from results.jsonl at length(s) {', '.join(diff)}")
    for key in ("per_position_acceptance", "all_anchors_accuracy"):
        sv, cv = summary.get(key), computed.get(key)
        if isinstance(sv, list) and cv is not None:
            if len(sv) != len(cv) or not all(_close(a, b) for a, b in zip(sv, cv)):
                out.append(f"summary.json {key} differs from results.jsonl")
    se, ce = summary.get("expected"), computed.get("expected") or {}
    if isinstance(se, dict):
        for key in ("tau_macro", "tau_pooled"):
            if key in se and not _close(se[key], ce.get(key)):
                out.append(f"summary.json expected.{key} = {se[key]} but results.jsonl gives {_fmt(ce.get(key))}")
        sv, cv = se.get("per_position_acceptance"), ce.get("per_position_acceptance")
        if isinstance(sv, list) and (cv is None or len(sv) != len(cv) or not all(_close(a, b) for a, b in zip(sv, cv))):
            out.append("summary.json expected.per_position_acceptance differs from results.jsonl")
    for b, v in (summary.get("ddtree") or {}).items():
        cv = (computed.get("ddtree") or {}).get(str(b))
        if cv is None:
            out.append(f"summary.json has DDTree-{b} but no row of results.jsonl does")
            continue
        for key in ("tau_macro", "tau_pooled"):
            if key in v and not _close(v[key], cv[key]):
                out.append(f"summary.json ddtree[{b}].{key} = {v[key]} but results.jsonl gives {_fmt(cv[key])}")
    so, co = summary.get("online"), computed.get("online")
    if isinstance(so, dict) and co:
        for key in ("wall_s", "tokens_per_s", "target_tokens_per_s", "speedup"):
            if key in so and key in co and not _close(so[key], co[key]):
                out.append(f"summary.json online.{key} = {so[key]} but results.jsonl gives {_fmt(co[key])}")
    return out
