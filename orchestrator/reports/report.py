"""Per-run reports: `report.md` and a self-contained `report.html` written into the run folder
(orchestrator/reports/render.py, plots from orchestrator/reports/plots.py). Every number is recomputed from
results.jsonl; where summary.json disagrees, the report carries a warning.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from remote.contract.metrics import TREE_STAGES, fastest_budget, online_summary
from remote.contract.settings import SEMANTICS_TEXT
from remote.contract.states import State

from . import engine as engine_report
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

EXPECTED = "offline, T > 0: an estimate"


def expected_rows(e: dict, digits: int = 4) -> list[tuple[str, str]]:
    """An offline run at T > 0 (no walk): its expected τ and per-position acceptance, labelled
    (summary.json's ``expected``, remote/contract/metrics.py ``expected_summary``)."""
    acc = e.get("per_position_acceptance")
    return [(f"expected tau_macro ({EXPECTED})", fnum(e.get("tau_macro"), digits)),
            (f"expected tau_pooled ({EXPECTED})", fnum(e.get("tau_pooled"), digits)),
            ("anchors", fnum(e.get("anchors"))),
            ("expected acceptance @1..4", " ".join(f"{a:.2f}" for a in acc[:4]) if acc else "—")]


def tau_rows(run: EvalRun, m: dict) -> list[tuple[str, str]]:
    """The run's τ in every convention (runs/metrics.py TAU_CONVENTIONS; per turn only where a
    prompt has several), or offline at T > 0 its expected τ, and its speed when online."""
    e = m.get("expected")
    rows = expected_rows(e) if e else [("tau_macro", fnum(m["tau_macro"])), ("tau_pooled", fnum(m["tau_pooled"]))]
    semantics = run.settings.get("semantics")
    if semantics:
        rows.append(("counted by", SEMANTICS_TEXT.get(semantics, semantics)))
    if multi_turn_note(m) and not e:
        rows.append(("tau_macro_turns", fnum(m.get("tau_macro_turns"))))
    if not e:
        rows.append(("tau_sglang", fnum(m.get("tau_sglang"))))
    on = m.get("online")
    if on:
        rows.append(("online tokens/s", fnum(on.get("tokens_per_s"), 2)))
        if on.get("target_tokens_per_s") is not None:
            rows.append(("plain decoding tokens/s", fnum(on.get("target_tokens_per_s"), 2)))
            rows.append(("speedup", fnum(on.get("speedup"), 3)))
        if on.get("lossless") is None and "lossless" in on:
            rows.append(("lossless", "not checked per prompt at T > 0 (a sample has no single right output)"))
        elif "lossless" in on:
            rows.append(("lossless (output == target greedy)", fnum(on["lossless"])))
    return rows + engine_report.summary_rows(run)


BUDGET_THRESHOLDS = (0.0, 1e-6, 0.1, 0.25, 0.5, 0.75, 0.9)


def confidence_tables(m: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """A confidence head judged (summary's ``confidence``, remote/contract/confidence.py): the
    calibration of its survival per drafted position and pooled, its predicted τ, and what a verify
    budget at a survival threshold would have given."""
    c = m.get("confidence")
    if not c:
        return []
    cal = c["calibration"]
    head = ["position", "n", "mean predicted", "observed", "ECE", "AUROC", "Brier"]
    row = lambda name, p: [name, str(p["n"]), fnum(p["mean_predicted"]), fnum(p["mean_observed"]),  # noqa: E731
                           fnum(p["ece"]), fnum(p["auroc"]), fnum(p["brier"])]
    calibration = [row(str(p["position"]), p) for p in cal["positions"]] + [row("pooled", cal["pooled"])]
    tau = c["tau"]
    points = [p for p in c["verify_budget"]["points"] if any(abs(p["threshold"] - t) < 1e-12 for t in BUDGET_THRESHOLDS)]
    return [("Confidence head: calibration of the survival (SGLang's definitions, 15 bins)", head, calibration),
            ("Confidence head: τ predicted (1 + Σ survival) vs measured", ["cycles", "predicted τ", "measured τ"],
             [[str(tau["cycles"]), fnum(tau["predicted_tau"]), fnum(tau["measured_tau"])]]),
            ("Verify budget: a cycle verifies only the drafts whose survival ≥ threshold",
             ["threshold", "τ", "verified tokens / cycle", "τ per verified token"],
             [[f"{p['threshold']:g}", fnum(p["tau"]), fnum(p["mean_verify_len"]), fnum(p["tau_per_verify_token"])]
              for p in points])]


def ddtree_table(m: dict) -> Optional[tuple[list[str], list[list[str]]]]:
    """DDTree's τ per node budget, beside the plain walk's (None when the run has no DDTree); online,
    what each budget costs: its tokens/s, its speedup over plain decoding and whether it was lossless."""
    if not m.get("ddtree"):
        return None
    head = ["DDTree budget N", "prompts", "tau_macro", "tau_pooled"]
    rows = [["none (DFlash)", str(m["prompts"]), fnum(m["tau_macro"]), fnum(m["tau_pooled"])]]
    rows += [[b, str(v["prompts"]), fnum(v["tau_macro"]), fnum(v["tau_pooled"])]
             for b, v in sorted(m["ddtree"].items(), key=lambda kv: int(kv[0]))]
    if fastest_budget(m["ddtree"]) is None:
        return head, rows
    on = m.get("online") or {}
    costs = [on] + [v for _, v in sorted(m["ddtree"].items(), key=lambda kv: int(kv[0]))]
    for row, c in zip(rows, costs):
        row += [fnum(c.get("tokens_per_s"), 2), fnum(c.get("speedup"), 3),
                "—" if "lossless" not in c else fnum(c["lossless"]) if c["lossless"] is not None else "not checked (T > 0)"]
    return head + ["tokens/s", "speedup over plain decoding", "lossless"], rows


STAGE_NOTE = ("Stages as DDTree's ddtree_generate times them: draft (the drafter's forward and its logits), "
              "tree build (top-k and the best-first tree), tree compile (the verify's inputs, positions and "
              "ancestor mask), verify (the target's forward over the tree), commit (the walk down the tree, the "
              "caches, the drafter's next context); every cycle counted, the first too (ddtree_generate counts "
              "the first cycle's draft as the drafter's prefill). On CUDA each stage ends with a synchronize.")


def ddtree_stage_table(m: dict) -> Optional[tuple[list[str], list[list[str]]]]:
    """Online, each budget's time per cycle split as ddtree_generate splits it (milliseconds: the
    cycle, then each stage), beside the linear DFlash decoding's (draft, verify, commit); None when
    no budget timed its stages."""
    dd = {b: v for b, v in (m.get("ddtree") or {}).items() if v.get("stage_s_per_cycle")}
    if not dd:
        return None
    head = ["decoding", "ms / cycle", *[f"{k.replace('_', ' ')} ms" for k in TREE_STAGES]]

    def row(name: str, c: dict) -> list[str]:
        stages = c.get("stage_s_per_cycle") or {}
        return [name, fnum(1e3 * c["s_per_cycle"] if c.get("s_per_cycle") is not None else None, 2),
                *[fnum(1e3 * stages[k], 2) if k in stages else "—" for k in TREE_STAGES]]
    on = m.get("online") or {}
    rows = [row("DFlash (no tree)", on)] if on.get("stage_s_per_cycle") else []
    return head, rows + [row(f"DDTree-{b}", v) for b, v in sorted(dd.items(), key=lambda kv: int(kv[0]))]


def ddtree_cost_notes(run: EvalRun, m: dict) -> list[str]:
    """The budget to serve (the fastest) and, on a CPU, that its timings say little of a GPU's."""
    best = fastest_budget(m.get("ddtree") or {})
    if best is None:
        return []
    v, on = m["ddtree"][best], m.get("online") or {}
    plain = on.get("target_tokens_per_s")
    notes = [f"Fastest DDTree budget: N = {best}, {fnum(v['tokens_per_s'], 2)} tokens/s"
             + (f", {fnum(v['speedup'], 2)}× plain decoding ({fnum(plain, 2)} tokens/s)" if v.get("speedup") else "")
             + (f"; linear DFlash {fnum(on['tokens_per_s'], 2)} tokens/s" if on.get("tokens_per_s") else "")
             + ". τ grows with N while each cycle verifies more nodes: the budget to serve is the fastest one on "
               "the serving hardware. Every budget decodes every prompt on its own, timed from the prompt's prefill "
               "to its last token; plain decoding is the target alone on the same prompts in the same run."]
    if str(run.env.get("device") or "").startswith("cpu"):
        notes.append(f"Measured on a CPU (device {run.env.get('device')}): CPU timings are not indicative of a GPU.")
    return notes


def run_rows(run: EvalRun, m: dict) -> list[tuple[str, str]]:
    """What was run: the drafter, target, suite, host and settings, and how much."""
    rows = [("run", run.id), ("drafter", run.label), ("target", str(run.target or "—")),
            ("suite", str(run.suite or "—")), ("host", str(run.host or "—")), ("status", run.status),
            ("mode", str(m.get("mode") or run.mode or "—")), ("block size", str(m["block_size"]))]
    if m.get("max_length", m["block_size"]) != m["block_size"]:
        rows.append(("longest acceptance (sample_from_anchor: B drafts + bonus)", str(m["max_length"])))
    s = run.settings
    rows += [("decoding", decoding_text(s)),
             ("settings", ", ".join(f"{k}={s[k]}" for k in ("max_new_tokens", "max_blocks", "reference") if k in s) or "—"),
             ("prompts", fnum(m["prompts"])),
             *([] if m.get("expected") else [("cycles", fnum(m["cycles"])), ("tokens", fnum(m["tokens"]))]),
             ("created", run.created_at or "—")]
    return rows


def environment_rows(run: EvalRun) -> list[tuple[str, str]]:
    """Where it ran and with what: what can change the numbers between two runs."""
    env = run.env
    drafter = env.get("drafter") or {}
    return [("device", str(env.get("device") or "—")), ("GPU", str(env.get("gpu") or "—")),
            ("dtype", str(env.get("dtype") or "—")), ("kernel path", str(env.get("kernel_path") or "—")),
            ("versions", versions_text(env)), ("drafter sha256", short_sha(drafter)),
            ("drafter format", str(drafter.get("format") or "—")),
            ("drafter variant", variant_text(drafter.get("variant")))]


def summary_rows(run: EvalRun, m: dict) -> list[tuple[str, str]]:
    """τ first, then what was run and where."""
    return tau_rows(run, m) + run_rows(run, m) + environment_rows(run)


@dataclass(frozen=True)
class PromptColumn:
    """A column of the per-prompt table: its heading, and its cell for one results.jsonl row
    (None: no value). A column with no value on any row is left out, so a column that only some
    runs have (a field the worker writes in some modes) costs nothing where it is absent."""
    heading: str
    cell: Callable[[dict], Optional[str]]


def _walk(row: dict):
    return row.get("acceptance_lengths") or []


def _ratio(a, b, digits: int = 2) -> Optional[str]:
    return fnum(a / b, digits) if a is not None and b else None


def _speedup(row: dict) -> Optional[str]:
    """An online row's speedup over plain decoding, as summary.json's ``online`` has it for the run."""
    speedup = online_summary([row]).get("speedup") if row.get("wall_s") else None
    return None if speedup is None else fnum(speedup, 2)


PROMPT_COLUMNS: list[PromptColumn] = [
    PromptColumn("prompt", lambda r: str(r.get("id"))),
    PromptColumn("category", lambda r: r.get("category")),
    PromptColumn("τ", lambda r: _ratio(sum(_walk(r)), len(_walk(r)), 3)),
    PromptColumn("cycles", lambda r: str(len(_walk(r))) if _walk(r) else None),
    PromptColumn("tokens", lambda r: str(sum(_walk(r))) if _walk(r) else None),
    PromptColumn("expected τ", lambda r: _ratio((r.get("expected") or {}).get("tau_sum"),
                                                (r.get("expected") or {}).get("anchors"), 3)),
    PromptColumn("turns", lambda r: str(len(r["turns"])) if len(r.get("turns") or []) > 1 else None),
    PromptColumn("speedup", _speedup),
]
# The serving engine's own τ for the same prompt (a run's optional per-prompt ``engine`` fields),
# beside ours (reports/engine.py).
ENGINE_COLUMNS: list[PromptColumn] = [PromptColumn(heading, cell) for heading, cell in engine_report.PROMPT_CELLS]


def prompt_table(rows: list[dict], columns: Optional[list[PromptColumn]] = None) -> tuple[list[str], list[list[str]]]:
    """The per-prompt table (suite order): the columns that have a value on some row."""
    columns = list(columns if columns is not None else PROMPT_COLUMNS + ENGINE_COLUMNS)
    cells = [[c.cell(r) for c in columns] for r in rows]
    keep = [i for i, c in enumerate(columns) if any(row[i] is not None for row in cells)]
    return ([columns[i].heading for i in keep],
            [["—" if row[i] is None else row[i] for i in keep] for row in cells])


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
    for f in run.env.get("forced") or []:
        w.append(f"resumed with --force ({f.get('at', '?')}) although the {f.get('what', '?')} of {f.get('shard', '?')} "
                 f"had changed since its finished prompts ({f.get('change', '?')}): its rows are not one measurement")
    return w


def report_plots(run: EvalRun) -> list[tuple[str, str, Optional[bytes]]]:
    from .plots import (plot_categories, plot_ddtree, plot_ddtree_costs, plot_ddtree_stages, plot_histogram,
                        plot_per_position, plot_reliability)

    m, label = run.metrics, run.label
    expected = f" (expected; {EXPECTED})" if m.get("expected") else ""
    return [("per-position", f"Per-position acceptance{expected}", plot_per_position([(label, m)])),
            ("histogram", "Acceptance-length histogram", plot_histogram([(label, m)])),
            ("categories", f"τ per prompt category{expected}", plot_categories([(label, m)])),
            ("ddtree", "DDTree τ vs budget", plot_ddtree([(label, m)])),
            ("ddtree-costs", "DDTree: τ and speed vs budget", plot_ddtree_costs(label, m)),
            ("ddtree-stages", "DDTree: time per cycle by stage vs budget", plot_ddtree_stages(label, m)),
            ("reliability", "Confidence head: reliability", plot_reliability([(label, m)]))]


def category_table(m: dict) -> Optional[tuple[str, list[str], list[list[str]]]]:
    """τ per prompt category (offline at T > 0: the expected τ); None without categories."""
    if not m.get("categories"):
        return None
    if m.get("expected"):
        return (f"Expected τ per category ({EXPECTED})", ["category", "prompts", "expected tau_macro",
                                                           "expected tau_pooled"],
                [[c, str(e["prompts"]), fnum(e["tau_macro"]), fnum(e["tau_pooled"])]
                 for c, e in ((c, v.get("expected") or {"prompts": 0, "tau_macro": None, "tau_pooled": None})
                              for c, v in m["categories"].items())])
    return ("τ per category", ["category", "prompts", "tau_macro", "tau_pooled"],
            [[c, str(v["prompts"]), fnum(v["tau_macro"]), fnum(v["tau_pooled"])] for c, v in m["categories"].items()])


def _detail_tables(m: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    out = []
    e = m.get("expected")
    acc = m.get("all_anchors_accuracy")
    cum = m.get("all_anchors_cumulative")
    anchors = ["teacher-forced accuracy", "cumulative"] if acc else []
    if e:
        alpha, ppa = e.get("alpha") or [], e.get("per_position_acceptance") or []
        out.append((f"Expected per-position acceptance ({EXPECTED}; expected tau_pooled = 1 + Σ)",
                    ["k", "expected acceptance", "α_k (mean over anchors with draft k)"] + anchors,
                    [[str(k), fnum(ppa[k - 1] if k <= len(ppa) else None), fnum(a)]
                     + ([fnum(acc[k - 1]), fnum(cum[k - 1])] if acc else []) for k, a in enumerate(alpha, 1)]))
    else:
        ppa = m["per_position_acceptance"]
        rows = [[str(k), fnum(ppa[k - 1])] + ([fnum(acc[k - 1]), fnum(cum[k - 1])] if acc else [])
                for k in range(1, len(ppa) + 1)]
        out.append(("Per-position acceptance (τ_pooled = 1 + Σ)", ["k", "acceptance"] + anchors, rows))
        h = m["acceptance_histogram"]
        out.append(("Acceptance-length histogram", ["length", "cycles", "share"],
                    [[k, str(h[k]), fnum(h[k] / m["cycles"] if m["cycles"] else 0.0)] for k in sorted(h, key=int)]))
    categories = category_table(m)
    if categories:
        out.append(categories)
    return out


def report_verdict(run: EvalRun) -> str:
    """The run's verdict line (reports/verdict.py), against the published number its suite names."""
    from .compare import published_for
    from .verdict import run_verdict

    published = published_for(run, None)[0] if run.results else None
    engine = engine_report.verdict_clause(run)
    return run_verdict(run, published, also=[engine] if engine else [])


def write_report(run_dir, out_dir=None) -> tuple[Path, Path]:
    """Write report.md and report.html for the run folder; return their paths. The verdict comes
    first, then τ, the plots, the prompts one by one, what was run and where, and the detail."""
    run = run_dir if isinstance(run_dir, EvalRun) else load_run(run_dir)
    m = run.metrics
    doc = Document(f"dflash-ops run {run.id}")
    doc.verdict([report_verdict(run)])
    doc.para(f"Drafter **{run.label}** on target `{run.target}`, suite `{run.suite}`, {decoding_text(run.settings)}, "
             f"{m.get('mode') or run.mode or '—'}. All numbers are recomputed from `results.jsonl`.")
    doc.warnings("Warnings", run_warnings(run))
    doc.table(["metric", "value"], tau_rows(run, m), heading="τ", cls="summary")
    dd = ddtree_table(m)
    if dd:
        doc.table(*dd, heading="DDTree", level=3)
        for note in ddtree_cost_notes(run, m):
            doc.para(note, cls="note")
        stages = ddtree_stage_table(m)
        if stages:
            doc.table(*stages, heading="DDTree: time per cycle by stage", level=3)
            doc.para(STAGE_NOTE, cls="note")
    for heading, head, rows in confidence_tables(m):
        doc.table(head, rows, heading=heading, level=3)
    for note in (multi_turn_note(m), m.get("expected") and "Expected τ and acceptance (offline, T > 0), an "
                 + m["expected"]["label"] + ".", TAU_CONVENTIONS):
        if note:
            doc.para(note, cls="note")
    for key, heading, svg in report_plots(run):
        doc.plot(key, heading, svg)
    doc.table(*prompt_table(run.results), heading="Per prompt")
    engine_report.report_section(doc, run)
    doc.table(["field", "value"], run_rows(run, m), heading="The run")
    doc.table(["field", "value"], environment_rows(run), heading="Environment", level=3)
    for heading, head, rows in _detail_tables(m):
        doc.table(head, rows, heading=heading, level=3)
    return doc.write(Path(out_dir) if out_dir is not None else run.path, "report")


def report_is_stale(run_dir) -> bool:
    d = Path(run_dir)
    html_p, md_p = d / REPORT_HTML, d / REPORT_MD
    if not (html_p.exists() and md_p.exists()) or not (html_p.stat().st_size and md_p.stat().st_size):
        return True         # missing, or left empty by an earlier write that failed
    t = min(html_p.stat().st_mtime, md_p.stat().st_mtime)
    return any((d / f).exists() and (d / f).stat().st_mtime > t
               for f in ("results.jsonl", "summary.json", "env.json", "run.json"))


def current_report(run: EvalRun, rewrite: bool = False) -> tuple[Path, Path]:
    """The run's report.md and report.html, (re)written when missing, stale or ``rewrite``."""
    if rewrite or report_is_stale(run.path):
        return write_report(run)
    return run.path / REPORT_MD, run.path / REPORT_HTML
