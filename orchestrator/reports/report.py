"""Per-run reports: `report.md` and a self-contained `report.html` written into the run folder
(orchestrator/reports/render.py, plots from orchestrator/reports/plots.py). Every number is recomputed from
results.jsonl; where summary.json disagrees, the report carries a warning.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from remote.states import State

from .render import Document, fnum
from ..runs.metrics import TAU_CONVENTIONS, multi_turn_note
from ..runs.folders import EvalRun, load_run

REPORT_MD, REPORT_HTML = "report.md", "report.html"


def short_sha(drafter_env: dict) -> str:
    sha = (drafter_env or {}).get("sha256")
    if isinstance(sha, str):
        return sha[:12]
    if isinstance(sha, dict) and sha:
        if len(sha) == 1:
            return str(next(iter(sha.values())))[:12]
        return ", ".join(f"{Path(k).name} {str(v)[:12]}" for k, v in sorted(sha.items()))
    return "—"


def versions_text(env: dict) -> str:
    v = env.get("versions") or {}
    return ", ".join(f"{k} {v[k]}" for k in v) if v else "—"


def variant_text(variant: dict | None) -> str:
    """The drafter variant the worker found (``python -m remote.inspect`` prints it in full)."""
    if not variant:
        return "—"
    parts = [str(variant.get("architecture", "?")), f"{variant.get('mask_rule', '?')} mask rule",
             f"{variant.get('drafts_per_block', '?')} drafts per block"]
    if variant.get("sample_from_anchor"):
        parts.append("sample_from_anchor")
    if str(variant.get("vocab", "")).startswith("reduced"):
        parts.append(str(variant["vocab"]).split(":")[0] + " vocabulary")
    return ", ".join(parts)


def decoding_text(settings: dict) -> str:
    """The decoding settings a run used (docs/run-format.md, env.json ``settings``)."""
    t = float(settings.get("temperature") or 0.0)
    parts = ["greedy (T=0)" if t == 0 else
             f"sampled: T={t:g}, top_p={settings.get('top_p', 1.0):g}, top_k={settings.get('top_k', 0)}, "
             f"seed={settings.get('seed', 0)}"]
    thinking = settings.get("enable_thinking")
    parts.append("thinking " + ("template default" if thinking is None else ("on" if thinking else "off")))
    if settings.get("stop_token_ids") is not None:
        parts.append(f"stop tokens {settings['stop_token_ids']}")
    return ", ".join(parts)


# --------------------------------------------------------------------------- tables

def summary_rows(run: EvalRun, m: dict) -> list[tuple[str, str]]:
    env = run.env
    rows = [("run", run.id), ("drafter", run.label), ("target", str(run.target or "—")),
            ("suite", str(run.suite or "—")), ("host", str(run.host or "—")), ("status", run.status),
            ("mode", str(m.get("mode") or run.mode or "—")), ("block size", str(m["block_size"]))]
    if m.get("max_length", m["block_size"]) != m["block_size"]:
        rows.append(("longest acceptance (sample_from_anchor: B drafts + bonus)", str(m["max_length"])))
    rows += [("decoding", decoding_text(run.settings)),
             ("prompts", fnum(m["prompts"])), ("cycles", fnum(m["cycles"])), ("tokens", fnum(m["tokens"])),
             ("tau_macro", fnum(m["tau_macro"])), ("tau_macro_turns", fnum(m.get("tau_macro_turns"))),
             ("tau_pooled", fnum(m["tau_pooled"])), ("tau_sglang", fnum(m.get("tau_sglang")))]
    if m.get("expected"):
        rows.append(("expected τ (offline, T > 0: an estimate)", fnum(m["expected"]["tau"])))
    for b, v in sorted((m.get("ddtree") or {}).items(), key=lambda kv: int(kv[0])):
        rows.append((f"DDTree-{b} tau_macro", fnum(v["tau_macro"])))
        rows.append((f"DDTree-{b} tau_pooled", fnum(v["tau_pooled"])))
    on = m.get("online")
    if on:
        rows.append(("online tokens/s", fnum(on.get("tokens_per_s"), 2)))
        if on.get("target_tokens_per_s") is not None:
            rows.append(("target greedy tokens/s", fnum(on.get("target_tokens_per_s"), 2)))
            rows.append(("speedup", fnum(on.get("speedup"), 3)))
        if on.get("lossless") is None and "lossless" in on:
            rows.append(("lossless", "not checked per prompt at T > 0 (a sample has no single right output)"))
        elif "lossless" in on:
            rows.append(("lossless (output == target greedy)", fnum(on["lossless"])))
    s = run.settings
    rows += [("device", str(env.get("device") or "—")), ("GPU", str(env.get("gpu") or "—")),
             ("dtype", str(env.get("dtype") or "—")), ("kernel path", str(env.get("kernel_path") or "—")),
             ("versions", versions_text(env)), ("drafter sha256", short_sha(env.get("drafter") or {})),
             ("drafter format", str((env.get("drafter") or {}).get("format") or "—")),
             ("drafter variant", variant_text((env.get("drafter") or {}).get("variant"))),
             ("settings", ", ".join(f"{k}={s[k]}" for k in ("max_new_tokens", "max_blocks", "reference") if k in s) or "—"),
             ("created", run.created_at or "—")]
    return rows


# --------------------------------------------------------------------------- report

def run_warnings(run: EvalRun) -> list[str]:
    from ..runs.metrics import summary_disagreements

    m = run.metrics
    w = []
    if not run.results:
        w.append("results.jsonl is missing or empty: nothing to report")
    if run.summary is None:
        w.append("summary.json is missing (the run is still running or failed); numbers are from results.jsonl")
    w += summary_disagreements(m, run.summary)
    if run.status != State.DONE:
        w.append(f"run status is '{run.status}': the numbers cover the {m['prompts']} prompt(s) written so far"
                 + (f" of {run.prompts_planned}" if run.prompts_planned else ""))
    if run.inferred:
        w.append("run.json is missing: drafter, target and suite were inferred from env.json")
    return w


def report_plots(run: EvalRun) -> list[tuple[str, str, Optional[bytes]]]:
    from .plots import plot_categories, plot_ddtree, plot_histogram, plot_per_position

    m, label = run.metrics, run.label
    return [("per-position", "Per-position acceptance", plot_per_position([(label, m)])),
            ("histogram", "Acceptance-length histogram", plot_histogram([(label, m)])),
            ("categories", "τ per prompt category", plot_categories([(label, m)])),
            ("ddtree", "DDTree τ vs budget", plot_ddtree([(label, m)]))]


def _detail_tables(m: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    out = []
    ppa = m["per_position_acceptance"]
    acc = m.get("all_anchors_accuracy")
    cum = m.get("all_anchors_cumulative")
    head = ["k", "acceptance"] + (["teacher-forced accuracy", "cumulative"] if acc else [])
    rows = [[str(k), fnum(ppa[k - 1])] + ([fnum(acc[k - 1]), fnum(cum[k - 1])] if acc else [])
            for k in range(1, len(ppa) + 1)]
    out.append(("Per-position acceptance (τ_pooled = 1 + Σ)", head, rows))
    if m.get("expected"):
        out.append(("Expected acceptance per draft (offline, T > 0: an estimate)", ["k", "mean α_k"],
                    [[str(k), fnum(a)] for k, a in enumerate(m["expected"]["alpha"], 1)]))
    h = m["acceptance_histogram"]
    out.append(("Acceptance-length histogram", ["length", "cycles", "share"],
                [[k, str(h[k]), fnum(h[k] / m["cycles"] if m["cycles"] else 0.0)] for k in sorted(h, key=int)]))
    if m.get("categories"):
        out.append(("τ per category", ["category", "prompts", "tau_macro", "tau_pooled"],
                    [[c, str(v["prompts"]), fnum(v["tau_macro"]), fnum(v["tau_pooled"])]
                     for c, v in m["categories"].items()]))
    if m.get("ddtree"):
        out.append(("DDTree", ["budget N", "prompts", "tau_macro", "tau_pooled"],
                    [[b, str(v["prompts"]), fnum(v["tau_macro"]), fnum(v["tau_pooled"])]
                     for b, v in sorted(m["ddtree"].items(), key=lambda kv: int(kv[0]))]))
    return out


def write_report(run_dir, out_dir=None) -> tuple[Path, Path]:
    """Write report.md and report.html for the run folder; return their paths."""
    run = run_dir if isinstance(run_dir, EvalRun) else load_run(run_dir)
    m = run.metrics
    doc = Document(f"dflash-ops run {run.id}")
    doc.para(f"Drafter **{run.label}** on target `{run.target}`, suite `{run.suite}`. "
             "All numbers are recomputed from `results.jsonl`.")
    doc.warnings("Warnings", run_warnings(run))
    doc.table(["metric", "value"], summary_rows(run, m), heading="Summary", cls="summary")
    for note in (multi_turn_note(m), m.get("expected") and "Expected τ: " + m["expected"]["label"] + ".",
                 TAU_CONVENTIONS):
        if note:
            doc.para(note, cls="note")
    for key, heading, png in report_plots(run):
        doc.plot(key, heading, png, missing="no data in this run")
    for heading, head, rows in _detail_tables(m):
        doc.table(head, rows, heading=heading, level=3)
    return doc.write(Path(out_dir) if out_dir is not None else run.path, "report")


def report_is_stale(run_dir) -> bool:
    d = Path(run_dir)
    html_p, md_p = d / REPORT_HTML, d / REPORT_MD
    if not (html_p.exists() and md_p.exists()):
        return True
    t = min(html_p.stat().st_mtime, md_p.stat().st_mtime)
    return any((d / f).exists() and (d / f).stat().st_mtime > t
               for f in ("results.jsonl", "summary.json", "env.json", "run.json"))


def current_report(run: EvalRun, rewrite: bool = False) -> tuple[Path, Path]:
    """The run's report.md and report.html, (re)written when missing, stale or ``rewrite``."""
    if rewrite or report_is_stale(run.path):
        return write_report(run)
    return run.path / REPORT_MD, run.path / REPORT_HTML
