"""Metrics recomputed from ``results.jsonl`` rows, and paired statistics for comparing runs.

Definitions (docs/run-format.md, REFERENCE §2): an acceptance length counts the bonus token (1..B);
``tau_macro`` = mean over prompts of each prompt's tokens/cycles (z-lab), ``tau_pooled`` =
Σ tokens / Σ cycles (Spec-Bench, SGLang, vLLM); ``per_position_acceptance[k-1]`` = share of cycles
with length ≥ k+1, k = 1..B-1, so ``tau_pooled = 1 + Σ per_position_acceptance``.

The paired statistics treat the *prompt* as the unit: a bootstrap resamples prompts (the same
prompts for both runs) and the significance test swaps the two runs' values within prompts.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np

TIE_TOL = 1e-9  # two per-prompt τ closer than this are a tie


# --------------------------------------------------------------------------- run metrics

def row_tokens_cycles(lengths: Sequence[int]) -> tuple[int, int]:
    return int(sum(lengths)), len(lengths)


def _tau_block(per_prompt: list[Sequence[int]]) -> dict:
    pairs = [row_tokens_cycles(a) for a in per_prompt if len(a)]
    tokens = sum(t for t, _ in pairs)
    cycles = sum(c for _, c in pairs)
    return {"prompts": len(pairs), "tokens": tokens, "cycles": cycles,
            "tau_macro": (sum(t / c for t, c in pairs) / len(pairs)) if pairs else None,
            "tau_pooled": tokens / cycles if cycles else None}


def compute_metrics(rows: list[dict], block_size: int, mode: Optional[str] = None) -> dict:
    """Everything the reports show, from the rows alone (same shape as summary.json, plus
    ``per_prompt`` and ``categories``)."""
    B = int(block_size)
    per_prompt = [list(r.get("acceptance_lengths") or []) for r in rows]
    base = _tau_block(per_prompt)
    hist = {str(k): 0 for k in range(1, B + 1)}
    over = 0
    for a in per_prompt:
        for n in a:
            if 1 <= n <= B:
                hist[str(int(n))] += 1
            else:
                over += 1
    all_lengths = np.fromiter((n for a in per_prompt for n in a), dtype=np.int64)
    cycles = len(all_lengths)
    ppa = [float((all_lengths >= k + 1).sum() / cycles) if cycles else 0.0 for k in range(1, B)]
    m: dict = {"mode": mode, "block_size": B, "prompts": len(rows), "cycles": base["cycles"],
               "tokens": base["tokens"], "tau_macro": base["tau_macro"], "tau_pooled": base["tau_pooled"],
               "acceptance_histogram": hist, "per_position_acceptance": ppa,
               "out_of_range_lengths": over}
    m["per_prompt"] = [
        {"id": r.get("id"), "category": r.get("category"), "tokens": t, "cycles": c,
         "tau": (t / c) if c else None, "stored_tau": r.get("tau"),
         "stored_tokens": r.get("tokens"), "stored_cycles": r.get("cycles")}
        for r, (t, c) in ((r, row_tokens_cycles(a)) for r, a in zip(rows, per_prompt))]

    budgets = sorted({str(b) for r in rows for b in (r.get("ddtree") or {})}, key=int)
    if budgets:
        m["ddtree"] = {}
        for b in budgets:
            lists = [r["ddtree"][b].get("acceptance_lengths") or [] for r in rows if b in (r.get("ddtree") or {})]
            t = _tau_block(lists)
            m["ddtree"][b] = {"tau_macro": t["tau_macro"], "tau_pooled": t["tau_pooled"], "prompts": t["prompts"]}

    cats: dict[str, list] = {}
    for r, a in zip(rows, per_prompt):
        if r.get("category") is not None:
            cats.setdefault(str(r["category"]), []).append(a)
    if cats:
        m["categories"] = {c: _tau_block(v) for c, v in sorted(cats.items())}

    if any("all_anchors" in r for r in rows):
        correct = np.zeros(B - 1, dtype=np.int64)
        count = np.zeros(B - 1, dtype=np.int64)
        for r in rows:
            aa = r.get("all_anchors") or {}
            c, n = list(aa.get("correct") or [])[:B - 1], list(aa.get("count") or [])[:B - 1]
            correct[:len(c)] += np.asarray(c, dtype=np.int64)
            count[:len(n)] += np.asarray(n, dtype=np.int64)
        acc = [float(c / n) if n else 0.0 for c, n in zip(correct, count)]
        m["all_anchors_accuracy"] = acc
        m["all_anchors_cumulative"] = [float(x) for x in np.cumprod(acc)] if acc else []

    if rows and all(r.get("wall_s") is not None for r in rows):
        wall = float(sum(r["wall_s"] for r in rows))
        target_wall = float(sum(r.get("target_wall_s") or 0.0 for r in rows))
        online = {"wall_s": wall, "tokens_per_s": base["tokens"] / wall if wall else None}
        if target_wall:
            online.update(target_wall_s=target_wall, target_tokens_per_s=base["tokens"] / target_wall,
                          speedup=target_wall / wall if wall else None)
        if any("lossless" in r for r in rows):
            online["lossless"] = all(r.get("lossless", True) for r in rows)
        m["online"] = online
    return m


def _close(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-4, abs_tol=5e-4)
    except (TypeError, ValueError):
        return a == b


def summary_disagreements(computed: dict, summary: Optional[dict]) -> list[str]:
    """Where summary.json (written by the worker) disagrees with the recomputation from
    results.jsonl; also rows whose stored tau/tokens/cycles disagree with their lengths."""
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
        out.append(f"{computed['out_of_range_lengths']} acceptance length(s) outside 1..{computed['block_size']}")
    if summary is None:
        return out
    for key in ("prompts", "cycles", "tokens", "tau_macro", "tau_pooled", "block_size"):
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
    sd = summary.get("ddtree") or {}
    for b, v in sd.items():
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


def _fmt(x) -> str:
    return f"{x:.4f}" if isinstance(x, float) else str(x)


# --------------------------------------------------------------------------- paired statistics

@dataclass
class Interval:
    a: float                # value of the baseline run on the paired prompts
    b: float                # value of the other run
    diff: float             # b - a
    ci_low: float
    ci_high: float
    p_value: Optional[float] = None


@dataclass
class PairedResult:
    n: int
    resamples: int
    seed: int
    confidence: float
    macro: Interval
    pooled: Interval
    wins: int               # prompts where b's τ > a's τ
    ties: int
    losses: int
    test: str = "paired permutation test (random swap of the two runs within each prompt), two-sided"
    exact_test: bool = False
    ddtree: dict = field(default_factory=dict)   # budget -> Interval (macro τ)

    def to_dict(self) -> dict:
        return asdict(self)


def _weights(n: int, resamples: int, rng: np.random.Generator, chunk: int) -> Iterable[np.ndarray]:
    """Bootstrap resamples as count matrices (rows sum to n), in chunks to bound memory."""
    p = np.full(n, 1.0 / n)
    done = 0
    while done < resamples:
        k = min(chunk, resamples - done)
        yield rng.multinomial(n, p, size=k).astype(np.float64)
        done += k


def _percentile(x: np.ndarray, confidence: float) -> tuple[float, float]:
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(x, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def paired_bootstrap(tok_a, cyc_a, tok_b, cyc_b, *, resamples: int = 10000, seed: int = 0,
                     confidence: float = 0.95, chunk: int = 2000) -> tuple[Interval, Interval]:
    """Percentile bootstrap CIs on the differences (b − a) of tau_macro and tau_pooled,
    resampling prompts (the same resample for both runs). Inputs are per-prompt token and cycle
    counts, aligned by prompt."""
    ta, ca, tb, cb = (np.asarray(x, dtype=np.float64) for x in (tok_a, cyc_a, tok_b, cyc_b))
    n = len(ta)
    if n == 0:
        raise ValueError("no paired prompts")
    tau_a, tau_b = ta / ca, tb / cb
    d = tau_b - tau_a
    macro_obs = float(d.mean())
    pooled_a, pooled_b = float(ta.sum() / ca.sum()), float(tb.sum() / cb.sum())
    rng = np.random.default_rng(seed)
    macro, pooled = [], []
    for w in _weights(n, resamples, rng, chunk):
        macro.append(w @ d / n)
        pooled.append((w @ tb) / (w @ cb) - (w @ ta) / (w @ ca))
    macro_s, pooled_s = np.concatenate(macro), np.concatenate(pooled)
    if np.all(d == 0):
        macro_s[:] = 0.0
    if np.array_equal(ta, tb) and np.array_equal(ca, cb):
        pooled_s[:] = 0.0
    return (Interval(float(tau_a.mean()), float(tau_b.mean()), macro_obs, *_percentile(macro_s, confidence)),
            Interval(pooled_a, pooled_b, pooled_b - pooled_a, *_percentile(pooled_s, confidence)))


def paired_permutation_test(tok_a, cyc_a, tok_b, cyc_b, *, resamples: int = 10000, seed: int = 0,
                            chunk: int = 4000) -> tuple[float, float, bool]:
    """Two-sided p-values (macro, pooled) for H0 "the two runs are exchangeable within each
    prompt": each resample swaps the runs' values on a random subset of prompts (for the macro
    τ this is the sign-flip test on per-prompt differences). Exact enumeration when 2^n ≤
    resamples. Returns (p_macro, p_pooled, exact)."""
    ta, ca, tb, cb = (np.asarray(x, dtype=np.float64) for x in (tok_a, cyc_a, tok_b, cyc_b))
    n = len(ta)
    d = tb / cb - ta / ca
    dt, dc = tb - ta, cb - ca
    sum_ta, sum_ca = ta.sum(), ca.sum()
    sum_tb, sum_cb = tb.sum(), cb.sum()
    obs_macro = abs(d.mean())
    obs_pooled = abs(sum_tb / sum_cb - sum_ta / sum_ca)
    if n == 0 or (np.all(d == 0) and np.all(dt == 0) and np.all(dc == 0)):
        return 1.0, 1.0, True
    eps = 1e-12 * max(1.0, obs_macro, obs_pooled)

    def stats(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # s: (k, n) of 0/1, 1 = swapped
        macro = np.abs((d * (1.0 - 2.0 * s)).sum(axis=1) / n)
        a_t, a_c = sum_ta + s @ dt, sum_ca + s @ dc
        b_t, b_c = sum_tb - s @ dt, sum_cb - s @ dc
        return macro, np.abs(b_t / b_c - a_t / a_c)

    exact = n <= 30 and 2 ** n <= resamples
    hits_m = hits_p = 0
    if exact:
        total = 2 ** n
        for start in range(0, total, chunk):
            codes = np.arange(start, min(total, start + chunk), dtype=np.int64)
            s = ((codes[:, None] >> np.arange(n)) & 1).astype(np.float64)
            m, p = stats(s)
            hits_m += int((m >= obs_macro - eps).sum())
            hits_p += int((p >= obs_pooled - eps).sum())
        return hits_m / total, hits_p / total, True
    rng = np.random.default_rng(seed + 1)
    done = 0
    while done < resamples:
        k = min(chunk, resamples - done)
        s = rng.integers(0, 2, size=(k, n)).astype(np.float64)
        m, p = stats(s)
        hits_m += int((m >= obs_macro - eps).sum())
        hits_p += int((p >= obs_pooled - eps).sum())
        done += k
    return (hits_m + 1) / (resamples + 1), (hits_p + 1) / (resamples + 1), False


def win_tie_loss(tau_a, tau_b, tol: float = TIE_TOL) -> tuple[int, int, int]:
    d = np.asarray(tau_b, dtype=np.float64) - np.asarray(tau_a, dtype=np.float64)
    return int((d > tol).sum()), int((np.abs(d) <= tol).sum()), int((d < -tol).sum())


def paired_compare(tok_a, cyc_a, tok_b, cyc_b, *, resamples: int = 10000, seed: int = 0,
                   confidence: float = 0.95) -> PairedResult:
    """Bootstrap CIs, permutation p-values and win/tie/loss for run b against baseline a."""
    macro, pooled = paired_bootstrap(tok_a, cyc_a, tok_b, cyc_b, resamples=resamples, seed=seed,
                                     confidence=confidence)
    p_m, p_p, exact = paired_permutation_test(tok_a, cyc_a, tok_b, cyc_b, resamples=resamples, seed=seed)
    macro.p_value, pooled.p_value = p_m, p_p
    ta, ca, tb, cb = (np.asarray(x, dtype=np.float64) for x in (tok_a, cyc_a, tok_b, cyc_b))
    w, t, l = win_tie_loss(ta / ca, tb / cb)
    return PairedResult(n=len(ta), resamples=resamples, seed=seed, confidence=confidence, macro=macro,
                        pooled=pooled, wins=w, ties=t, losses=l, exact_test=exact)
