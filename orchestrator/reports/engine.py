"""The serving engine's own τ beside ours (`eval --engine`), for every report: the per-prompt
columns, the verdict's clause, the report's section, and the words for each cause of a difference.

A cause is named only where the worker's checks showed it (remote/engines/phase.py ``explain``:
the prompt the engine rendered, its output, its draft length, sampling, dtype, how it counts the
prefill's token and the drafts past the end, the cut last blocks, its drafter recomputed as vLLM's
CPU kernel computes it); the numbers in the sentences come from the same checks.
"""
from __future__ import annotations

from typing import Optional

from remote.contract.engines import CAUSES, ENGINES

from ..runs.folders import EvalRun
from .render import Document, fnum

# cause -> (a few words for a table cell, the sentence a report says)
CAUSE_TEXT = {
    "template": ("template", "thinking/template: the engine's chat template rendered the prompt differently from ours "
                             "(the run's thinking setting and template must match), so it decoded another prompt"),
    "num_draft_tokens": ("num draft tokens", "num draft tokens: the engine drafts another number of tokens per step "
                                             "than the drafter's block implies"),
    "temperature": ("temperature", "temperature: sampled decoding (T > 0): the engine and we draw our own tokens, so "
                                   "the counts differ by chance"),
    "dtype": ("dtype", "dtype: the engine computes in another dtype than ours"),
    "divergence": ("output divergence", "output divergence: the engine's output leaves ours (kernels or dtype), "
                                        "so it decoded other text from there"),
    "prefill_token": ("prefill token", "prefill token: the engine's τ counts the prefill's token among the tokens "
                                       "of its verify steps (completion tokens / verify steps), ours does not"),
    "stop_overshoot": ("stop token", "stop tokens: the engine's last step counted matched drafts past the stop "
                                     "token, then cut them from the output"),
    "length_overshoot": ("overshoot", "last-cycle counting (overshoot): the engine's last step counted matched "
                                      "drafts past max new tokens, then cut them from the output"),
    "last_cycles": ("last cycles", "last-cycle drafting: once fewer than B−1 tokens are left our last cycles draft a "
                                   "cut block (as z-lab's dflash_generate), the engine a full one, so they accept "
                                   "differently"),
    "kernel_quirk": ("kernel quirk", "the kernel quirk: vLLM's CPU rms_norm norms every drafter layer's context keys "
                                     "with layer 0's k_norm; our decoding with that one change reproduces the "
                                     "engine's count at every full-block step"),
    "drafter_differs": ("drafter differs", "the engine's drafter drafts other tokens from the same context, and no "
                                           "known cause reproduces it (kernels, dtype)"),
    "unexplained": ("unexplained", "the counts differ and no check explains it"),
}
assert set(CAUSE_TEXT) == set(CAUSES)


def engine_rows(run: EvalRun) -> list[dict]:
    """The ``engine`` objects of the run's rows that have one."""
    return [r["engine"] for r in run.results if r.get("engine")]


def engine_name(run: EvalRun) -> str:
    """``vLLM 0.32.0`` (from env.json's ``engine``), or the kind alone."""
    env = run.env.get("engine") or (run.env.get("shards") or [{}])[0].get("engine") or {}
    kind = env.get("kind") or next((e.get("kind") for e in engine_rows(run)), None)
    version = env.get("version")
    return " ".join(x for x in ((ENGINES[kind].name if kind in ENGINES else kind or "engine"), version) if x)


def _tau(e: dict) -> Optional[float]:
    return e["tokens"] / e["cycles"] if e.get("cycles") else None


def _causes_cell(e: dict) -> Optional[str]:
    causes = e.get("causes")
    if causes is None:
        return None
    return ", ".join(CAUSE_TEXT[c][0] for c in causes if c in CAUSE_TEXT) or "same"


# The per-prompt table's engine columns (reports/report.py ENGINE_COLUMNS): heading, cell of a row.
PROMPT_CELLS = [
    ("engine τ", lambda r: fnum(_tau(r["engine"]), 3) if r.get("engine") else None),
    ("engine speedup", lambda r: fnum(r["engine"]["speedup"], 2)
     if (r.get("engine") or {}).get("speedup") is not None else None),
    ("engine vs ours", lambda r: _causes_cell(r["engine"]) if r.get("engine") else None),
]


def causes_text(causes: dict[str, int], prompts: int) -> str:
    """``last-cycle drafting (4 of 4 prompts), the kernel quirk (3)``."""
    order = [c for c in CAUSES if causes.get(c)]
    return ", ".join(f"{CAUSE_TEXT[c][0]} ({causes[c]}{f' of {prompts} prompts' if i == 0 else ''})"
                     for i, c in enumerate(order))


def verdict_clause(run: EvalRun) -> Optional[str]:
    """``vLLM 0.32.0 counts τ 1.72 [1.45, 2.01] on the same prompts (ours 1.79), 0.54× its speed
    without the drafter; why they differ: …``; None when the run has no engine rows."""
    rows = [e for e in engine_rows(run) if e.get("cycles")]
    if not rows:
        return None
    from .stats import bootstrap_tau

    s = run.metrics.get("engine") or {}
    (lo, hi), _ = bootstrap_tau([e["tokens"] for e in rows], [e["cycles"] for e in rows], resamples=2000, seed=0)
    tau = sum(_tau(e) for e in rows) / len(rows)
    text = f"{engine_name(run)} counts τ {tau:.2f} [{lo:.2f}, {hi:.2f}]"
    if s.get("our_tau_macro") is not None:
        text += f" (ours {s['our_tau_macro']:.2f} on the same prompts)"
    if s.get("speedup") is not None:
        text += f", {s['speedup']:.2f}× its speed without the drafter"
    causes = s.get("causes") or {}
    if causes:
        text += f"; the difference: {causes_text(causes, s.get('prompts') or len(rows))}"
    elif s.get("our_tau_macro") is not None:
        text += "; the same count as ours"
    return text


def summary_rows(run: EvalRun) -> list[tuple[str, str]]:
    """The engine's numbers for the report's τ table and `show`."""
    s = run.metrics.get("engine")
    if not s:
        return []
    name = engine_name(run)
    rows = [(f"engine τ macro ({name}'s own count)", fnum(s.get("tau_macro"))),
            ("engine τ pooled", fnum(s.get("tau_pooled"))),
            ("our τ macro on the same prompts", fnum(s.get("our_tau_macro"))),
            ("engine output == ours", f"{s.get('same_output')} of {s.get('prompts')} prompts"),
            ("engine tokens/s", fnum(s.get("tokens_per_s"), 2))]
    if s.get("speedup") is not None:
        rows += [("engine tokens/s without the drafter", fnum(s.get("plain_tokens_per_s"), 2)),
                 ("engine speedup", fnum(s.get("speedup"), 3))]
    return rows


def _first(rows: list[dict], cause: str) -> Optional[dict]:
    return next((e for e in rows if cause in (e.get("causes") or [])), None)


def cause_detail(cause: str, rows: list[dict]) -> str:
    """What the checks found for ``cause``, with one prompt's numbers as an example."""
    e = _first(rows, cause)
    c = (e or {}).get("checks") or {}
    if cause == "num_draft_tokens":
        k = c.get("num_speculative_tokens") or {}
        return f"engine {k.get('engine')}, drafter {k.get('drafter')}"
    if cause == "temperature":
        return f"T = {c.get('temperature')}"
    if cause == "dtype":
        d = c.get("dtype") or {}
        return f"engine {d.get('engine')}, ours {d.get('ours')}"
    if cause == "template":
        d = c.get("prompt_difference") or {}
        return (f"first differing prompt token at {d.get('position')} ({d.get('engine_tokens')} engine tokens, "
                f"{d.get('our_tokens')} ours)")
    if cause == "divergence":
        d = c.get("output_difference") or {}
        return f"first at output token {d.get('position')}: engine {d.get('engine')}, ours {d.get('ours')}"
    if cause in ("stop_overshoot", "length_overshoot"):
        n = sum((x.get("checks") or {}).get("overshoot") or 0 for x in rows if cause in (x.get("causes") or []))
        return (f"{n} matched draft{'s' * (n != 1)} counted past the end (drafts + accepted − (output − 1)), "
                f"each within what the engine's last step accepted")
    if cause == "kernel_quirk":
        f = c.get("first_difference") or {}
        return f"unchanged, ours first differs at cycle {f.get('cycle')}; with the quirk, no full-block cycle differs"
    if cause == "drafter_differs":
        f = c.get("first_difference") or {}
        return f"first at cycle {f.get('cycle')} of a full block"
    if cause == "last_cycles":
        return "the per-step counts agree on every full-block cycle and differ after"
    if cause == "prefill_token":
        return "engine τ × verify steps = completion tokens"
    counts = c.get("counts") or {}
    return f"engine {counts.get('engine')}, ours {counts.get('ours')}"


def report_section(doc: Document, run: EvalRun) -> None:
    """The report's "Engine τ beside ours" section: why they differ, and the counts per prompt (the
    engine's τ itself is in the report's τ table, :func:`summary_rows`); nothing without engine rows."""
    rows = engine_rows(run)
    s = run.metrics.get("engine")
    if not rows or not s:
        return
    doc.heading(f"Engine τ beside ours ({engine_name(run)})")
    causes = s.get("causes") or {}
    if causes:
        doc.table(["why the engine's τ differs from ours", "prompts", "checked"],
                  [[CAUSE_TEXT[c][1], str(causes[c]), cause_detail(c, rows)] for c in CAUSES if causes.get(c)],
                  heading="Why they differ (a cause is named only where a check shows it)", level=3)
    else:
        doc.para("The engine's counts equal ours on every prompt.", cls="note")
    per_prompt = []
    for r in run.results:
        e = r.get("engine")
        if not e:
            continue
        c = e.get("checks") or {}
        counts = c.get("counts") or {}
        first = c.get("first_difference")
        per_prompt.append([str(r.get("id")), fnum((counts.get("engine") or {}).get("cycles")),
                           fnum((counts.get("engine") or {}).get("accepted")),
                           fnum((counts.get("ours") or {}).get("cycles")), fnum((counts.get("ours") or {}).get("accepted")),
                           fnum(c.get("overshoot")), "—" if not first else str(first.get("cycle")),
                           fnum(c.get("same_output")), _causes_cell(e) or "—"])
    doc.table(["prompt", "engine steps", "engine accepted", "our cycles", "our accepted", "overshoot",
               "first differing full-block cycle", "same output", "causes"], per_prompt,
              heading="Engine counts per prompt", level=3)
    doc.para("Engine τ is the engine's own count: vLLM 1 + accepted / steps (mean_acceptance_length; the prefill "
             "is no step), SGLang completion tokens / verify steps. Our τ counts the tokens one draft–verify cycle "
             "commits. Speedup: the engine's time for the prompt without the drafter over its time with it "
             "(client side, HTTP included).", cls="note")
