"""The answer first: one line a person can read aloud, at the top of every report, comparison and
trajectory, and of `show` and `compare` on the terminal.

- one run: ``v5:step_20000: τ 3.73 [3.41, 4.05] over 20 prompts of gsm8k, below the published
  6.57 (GSM8K, …)``: τ macro with its 95% bootstrap CI over prompts, against the published number
  when the suite names a benchmark that has one at the run's temperature;
- two runs: ``v5 vs zlab: τ −0.42 [−0.61, −0.22], v5 worse on 17 of 20 prompts``: the paired
  difference of τ macro with its CI, and the prompts each way.

Numbers carry two decimals and a true minus sign; a CI that holds 0 says "no clear difference".
"""
from __future__ import annotations

from typing import Optional, Sequence

from ..runs.folders import EvalRun

VERDICT_RESAMPLES = 2000   # one run's CI: bootstrap resamples (seed 0: the same line every time)


def signed(x: float, digits: int = 2) -> str:
    """``+0.12`` / ``−0.42`` (a true minus sign, as read aloud)."""
    text = f"{abs(x):.{digits}f}"
    return ("−" if x < 0 and float(text) != 0 else "+") + text


def ci_text(lo: float, hi: float, sign: bool = False) -> str:
    f = signed if sign else (lambda v: f"{v:.2f}")
    return f"[{f(lo)}, {f(hi)}]"


def per_prompt_tau(run: EvalRun) -> tuple[list[float], list[float], str]:
    """Per prompt (tokens, cycles) of the run's walk, or, for an offline run at T > 0 (no walk),
    (Σ expected τ, anchors); and the measure's name (``τ`` or ``expected τ``)."""
    toks, cycs = [], []
    for row in run.results:
        lengths = row.get("acceptance_lengths") or []
        if lengths:
            toks.append(sum(lengths))
            cycs.append(len(lengths))
    if toks:
        return toks, cycs, "τ"
    for row in run.results:
        e = row.get("expected") or {}
        if e.get("anchors"):
            toks.append(e["tau_sum"])
            cycs.append(e["anchors"])
    return toks, cycs, "expected τ"


def _planned(run: EvalRun) -> Optional[int]:
    """The prompts asked for, or the workers' own count while they run."""
    if run.record and not run.status.is_terminal():
        total = run.record.progress[1]
        if total:
            return total
    return run.prompts_planned


def published_where(pub: dict) -> str:
    """``GSM8K, target Qwen3-8B, T=0; not measured here``: what a published number is of."""
    setup = pub.get("setup") or {}
    where = [pub.get("name"), setup.get("target") and f"target {setup['target']}", f"T={pub['temperature']:g}"]
    return ", ".join(x for x in where if x) + "; not measured here"


def published_clause(tau: float, ci: tuple[float, float] | None, pub: dict, per_turn: bool) -> str:
    """``below the published 6.57 (GSM8K, target Qwen3-8B, T=0; not measured here)``: the CI
    against the number when τ is per prompt; τ per turn (multi-turn suites) has no CI here."""
    value = float(pub["tau"])
    if ci is not None and not per_turn:
        side = "below" if ci[1] < value else "above" if ci[0] > value else "consistent with"
    else:
        side = "below" if tau < value else "above"
    what = f"τ per turn {tau:.2f}, " if per_turn else ""
    return f"{what}{side} the published {value:.2f} ({published_where(pub)})"


def run_verdict(run: EvalRun, published: Optional[dict] = None, also: Sequence[str] = ()) -> str:
    """The run's answer in one line. ``published``: the published row to set it beside
    (reports.compare.published_for); ``also``: further clauses, e.g. the serving engine's own τ
    for the same prompts, said after the run's τ."""
    name = run.label
    status = run.status
    planned = _planned(run)
    done = len(run.results)
    if status not in ("done", "unknown"):
        name += f" ({status}, {done}{f' of {planned}' if planned else ''} prompts so far)"
    why = run.invalid
    if why:
        return f"{name}: invalid, its τ is not a result: {why}"
    toks, cycs, measure = per_prompt_tau(run)
    if not toks:
        return f"{name}: no prompt finished yet, no τ"
    from .stats import bootstrap_tau

    (lo, hi), _ = bootstrap_tau(toks, cycs, resamples=VERDICT_RESAMPLES, seed=0)
    tau = sum(t / c for t, c in zip(toks, cycs)) / len(toks)
    suite = f" of {run.suite}" if run.suite else ""
    parts = [f"{name}: {measure} {tau:.2f} {ci_text(lo, hi)} over {len(toks)} prompt{'s' * (len(toks) != 1)}{suite}"]
    if measure == "expected τ":
        parts[0] += " (offline at T > 0: an estimate)"
    speedup = ((run.metrics.get("online") or {}).get("speedup"))
    if speedup:
        parts.append(f"{speedup:.2f}× the target's own decoding speed")
    parts += list(also)
    if published and published.get("tau") is not None and measure == "τ":
        m = run.metrics
        per_turn = bool(m.get("responses") and m["responses"] != m.get("prompts"))
        parts.append(published_clause(m["tau_macro_turns"] if per_turn else tau, (lo, hi), published, per_turn))
    return ", ".join(parts)


def published_line(pub: dict, taus: Sequence[tuple[str, Optional[float]]]) -> str:
    """``beside the published 6.57 (GSM8K, target Qwen3-8B, T=0; not measured here): zlab 4.02, v5 3.60``
    (each run's τ per turn, the average the published numbers use)."""
    ours = ", ".join(f"{name} {'—' if tau is None else f'{tau:.2f}'}" for name, tau in taus)
    return f"beside the published τ {float(pub['tau']):.2f} ({published_where(pub)}): {ours}"


def pair_verdict(name: str, base_name: str, comparison: dict, measure: str = "τ") -> str:
    """One compared run against the baseline, from a comparison of reports.compare
    (``macro`` interval, ``wins``/``ties``/``losses``, ``n``)."""
    iv, n = comparison["macro"], comparison["n"]
    w, t, l = comparison["wins"], comparison["ties"], comparison["losses"]
    head = f"{name} vs {base_name}: {measure} {signed(iv['diff'])} {ci_text(iv['ci_low'], iv['ci_high'], sign=True)}"
    if t == n:
        return f"{head}, the same {measure} on all {n} prompt{'s' * (n != 1)}"
    more, fewer = ("better", "worse") if w >= l else ("worse", "better")
    most, least = max(w, l), min(w, l)
    tail = f", {name} {more} on {most} of {n} prompts"
    if least:
        tail += f" ({fewer} on {least}" + (f", tied on {t})" if t else ")")
    elif t:
        tail += f" (tied on {t})"
    unclear = iv["ci_low"] <= 0 <= iv["ci_high"] and iv["diff"] != 0
    return head + tail + ("; no clear difference" if unclear else "")
