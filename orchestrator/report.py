"""Per-run reports: `report.md` and a self-contained `report.html` (inline CSS, PNG plots as data
URIs) written into the run folder. Every number is recomputed from results.jsonl; where
summary.json disagrees, the report carries a warning.

matplotlib is imported inside the plotting functions (Agg, no pyplot), never at module load.
"""
from __future__ import annotations

import base64
import html
import io
import math
import re
from pathlib import Path
from typing import Optional, Sequence

from .runs import Run, load_run

REPORT_MD, REPORT_HTML = "report.md", "report.html"


# --------------------------------------------------------------------------- formatting

def fnum(x, digits: int = 4) -> str:
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        return f"{x:.{digits}f}"
    return str(x)


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


# --------------------------------------------------------------------------- plots

def _figure(w: float = 7.0, h: float = 3.6):
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=100)
    return fig, fig.add_subplot(111)


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def plot_per_position(series: Sequence[tuple[str, dict]], with_anchors: bool = True) -> Optional[bytes]:
    series = [(l, m) for l, m in series if m.get("per_position_acceptance")]
    if not series:
        return None
    fig, ax = _figure()
    for i, (label, m) in enumerate(series):
        ppa = m["per_position_acceptance"]
        ax.plot(range(1, len(ppa) + 1), ppa, marker="o", ms=3, color=f"C{i}",
                label=f"{label} (greedy walk)" if with_anchors and m.get("all_anchors_accuracy") else label)
        if with_anchors and m.get("all_anchors_accuracy"):
            acc = m["all_anchors_accuracy"]
            ax.plot(range(1, len(acc) + 1), acc, ls="--", color=f"C{i}", alpha=0.7,
                    label=f"{label} (teacher-forced, all anchors)")
    ax.set_xlabel("block position k")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1.02)
    ax.set_title("per-position acceptance")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig)


def plot_histogram(series: Sequence[tuple[str, dict]]) -> Optional[bytes]:
    series = [(l, m) for l, m in series if m.get("cycles")]
    if not series:
        return None
    fig, ax = _figure()
    width = 0.8 / len(series)
    for i, (label, m) in enumerate(series):
        h = m["acceptance_histogram"]
        ks = sorted(h, key=int)
        total = sum(h.values()) or 1
        xs = [int(k) + (i - (len(series) - 1) / 2) * width for k in ks]
        ax.bar(xs, [h[k] / total for k in ks], width=width, color=f"C{i}", label=label)
    ax.set_xlabel("acceptance length (tokens per cycle, bonus included)")
    ax.set_ylabel("share of cycles")
    ax.set_title("acceptance-length histogram")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return _png(fig)


def plot_categories(series: Sequence[tuple[str, dict]]) -> Optional[bytes]:
    series = [(l, m) for l, m in series if m.get("categories")]
    if not series:
        return None
    cats = sorted({c for _, m in series for c in m["categories"]})
    fig, ax = _figure()
    width = 0.8 / len(series)
    for i, (label, m) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(cats))]
        ys = [(m["categories"].get(c) or {}).get("tau_macro") or 0.0 for c in cats]
        ax.bar(xs, ys, width=width, color=f"C{i}", label=label)
    ax.set_xticks(range(len(cats)))
    ax.set_xticklabels(cats, rotation=20 if len(cats) > 6 else 0)
    ax.set_ylabel("τ (macro)")
    ax.set_title("τ per prompt category")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return _png(fig)


def plot_ddtree(series: Sequence[tuple[str, dict]]) -> Optional[bytes]:
    series = [(l, m) for l, m in series if m.get("ddtree")]
    if not series:
        return None
    fig, ax = _figure()
    for i, (label, m) in enumerate(series):
        bs = sorted(m["ddtree"], key=int)
        ax.plot([int(b) for b in bs], [m["ddtree"][b]["tau_macro"] for b in bs], marker="o", color=f"C{i}",
                label=f"{label} DDTree")
        if m.get("tau_macro") is not None:
            ax.axhline(m["tau_macro"], color=f"C{i}", ls=":", alpha=0.8, label=f"{label} DFlash (no tree)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("DDTree node budget N")
    ax.set_ylabel("τ (macro)")
    ax.set_title("DDTree τ vs node budget")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig)


# --------------------------------------------------------------------------- tables

def summary_rows(run: Run, m: dict) -> list[tuple[str, str]]:
    env = run.env
    rows = [("run", run.id), ("drafter", run.label), ("target", str(run.target or "—")),
            ("suite", str(run.suite or "—")), ("host", str(run.host or "—")), ("status", run.status),
            ("mode", str(m.get("mode") or run.mode or "—")), ("block size", str(m["block_size"])),
            ("prompts", fnum(m["prompts"])), ("cycles", fnum(m["cycles"])), ("tokens", fnum(m["tokens"])),
            ("tau_macro", fnum(m["tau_macro"])), ("tau_pooled", fnum(m["tau_pooled"]))]
    for b, v in sorted((m.get("ddtree") or {}).items(), key=lambda kv: int(kv[0])):
        rows.append((f"DDTree-{b} tau_macro", fnum(v["tau_macro"])))
        rows.append((f"DDTree-{b} tau_pooled", fnum(v["tau_pooled"])))
    on = m.get("online")
    if on:
        rows.append(("online tokens/s", fnum(on.get("tokens_per_s"), 2)))
        if on.get("target_tokens_per_s") is not None:
            rows.append(("target greedy tokens/s", fnum(on.get("target_tokens_per_s"), 2)))
            rows.append(("speedup", fnum(on.get("speedup"), 3)))
        if "lossless" in on:
            rows.append(("lossless (output == target greedy)", fnum(on["lossless"])))
    s = run.settings
    rows += [("device", str(env.get("device") or "—")), ("GPU", str(env.get("gpu") or "—")),
             ("dtype", str(env.get("dtype") or "—")), ("kernel path", str(env.get("kernel_path") or "—")),
             ("versions", versions_text(env)), ("drafter sha256", short_sha(env.get("drafter") or {})),
             ("drafter format", str((env.get("drafter") or {}).get("format") or "—")),
             ("settings", ", ".join(f"{k}={s[k]}" for k in ("max_new_tokens", "max_blocks", "enable_thinking",
                                                           "reference") if k in s) or "—"),
             ("created", run.created_at or "—")]
    return rows


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def cell(x):
        return str(x).replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


_NUMERIC = re.compile(r"^[+\-−<]?\d[\d.]*( \[.*\])?$|^\d+ / \d+ / \d+$|^\d+/\d+/\d+$")


def _html_table(header: Sequence[str], rows: Sequence[Sequence[str]], cls: str = "") -> str:
    e = html.escape
    head = "".join(f"<th>{e(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(
        f'<td class="num">{e(str(c))}</td>' if _NUMERIC.match(str(c)) else f"<td>{e(str(c))}</td>" for c in r)
        + "</tr>" for r in rows)
    return f'<table class="{e(cls)}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1100px;
color:#222;background:#fff;line-height:1.4}
h1{font-size:1.5em;margin-bottom:.2em}h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.6em 0;font-size:.92em}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f2f4f7}td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}
.warn{background:#fff4e5;border:2px solid #f0a020;padding:8px 14px;margin:12px 0;border-radius:4px}
.warn h3{margin:0 0 4px 0;color:#a05a00}.note{color:#666;font-size:.9em}
.published{font-style:italic;color:#555}
img.plot{max-width:100%;border:1px solid #eee;margin:6px 0;display:block}
"""


def html_page(title: str, body: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{html.escape(title)}</title><style>{CSS}</style></head>\n<body>\n{body}\n</body></html>\n")


def img_tag(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img class="plot" alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def warn_box_html(title: str, items: Sequence[str]) -> str:
    if not items:
        return ""
    lis = "".join(f"<li>{html.escape(x)}</li>" for x in items)
    return f'<div class="warn"><h3>{html.escape(title)}</h3><ul>{lis}</ul></div>'


# --------------------------------------------------------------------------- report

def run_warnings(run: Run) -> list[str]:
    from .run_metrics import summary_disagreements

    m = run.metrics
    w = []
    if not run.results:
        w.append("results.jsonl is missing or empty: nothing to report")
    if run.summary is None:
        w.append("summary.json is missing (the run is still running or failed); numbers are from results.jsonl")
    w += summary_disagreements(m, run.summary)
    if run.status != "done":
        w.append(f"run status is {run.status!r}: the numbers cover the {m['prompts']} prompt(s) written so far"
                 + (f" of {run.meta.get('prompts')}" if run.meta.get("prompts") else ""))
    if run.meta.get("inferred"):
        w.append("run.json is missing: drafter, target and suite were inferred from env.json")
    return w


def report_plots(run: Run) -> list[tuple[str, str, Optional[bytes]]]:
    m, label = run.metrics, run.label
    return [("per-position", "Per-position acceptance", plot_per_position([(label, m)])),
            ("histogram", "Acceptance-length histogram", plot_histogram([(label, m)])),
            ("categories", "τ per prompt category", plot_categories([(label, m)])),
            ("ddtree", "DDTree τ vs budget", plot_ddtree([(label, m)]))]


def _detail_tables(m: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    B = m["block_size"]
    out = []
    ppa = m["per_position_acceptance"]
    acc = m.get("all_anchors_accuracy")
    cum = m.get("all_anchors_cumulative")
    head = ["k", "acceptance"] + (["teacher-forced accuracy", "cumulative"] if acc else [])
    rows = [[str(k), fnum(ppa[k - 1])] + ([fnum(acc[k - 1]), fnum(cum[k - 1])] if acc else [])
            for k in range(1, B)]
    out.append(("Per-position acceptance (τ_pooled = 1 + Σ)", head, rows))
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
    run = run_dir if isinstance(run_dir, Run) else load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run.path
    out.mkdir(parents=True, exist_ok=True)
    m = run.metrics
    warnings = run_warnings(run)
    summary = summary_rows(run, m)
    plots = report_plots(run)
    details = _detail_tables(m)
    title = f"dflash-ops run {run.id}"

    plot_dir = out / "plots"
    md = [f"# {title}", "", f"Drafter **{run.label}** on target `{run.target}`, suite `{run.suite}`. "
          "All numbers are recomputed from `results.jsonl`.", ""]
    if warnings:
        md += ["> **Warnings**", ">"] + [f"> - {w}" for w in warnings] + [""]
    md += ["## Summary", "", _md_table(["metric", "value"], summary), ""]
    for key, heading, png in plots:
        md += [f"## {heading}", ""]
        if png is None:
            md += ["_(no data in this run)_", ""]
            continue
        plot_dir.mkdir(exist_ok=True)
        (plot_dir / f"{key}.png").write_bytes(png)
        md += [f"![{heading}](plots/{key}.png)", ""]
    for heading, head, rows in details:
        md += [f"### {heading}", "", _md_table(head, rows), ""]
    md_path = out / REPORT_MD
    md_path.write_text("\n".join(md), encoding="utf-8")

    e = html.escape
    body = [f"<h1>{e(title)}</h1>",
            f'<p>Drafter <b>{e(run.label)}</b> on target <code>{e(str(run.target))}</code>, suite '
            f'<code>{e(str(run.suite))}</code>. <span class="note">All numbers are recomputed from '
            f"results.jsonl.</span></p>", warn_box_html("Warnings", warnings),
            "<h2>Summary</h2>", _html_table(["metric", "value"], summary, "summary")]
    for key, heading, png in plots:
        body.append(f"<h2>{e(heading)}</h2>")
        body.append(img_tag(png, heading) if png else '<p class="note">(no data in this run)</p>')
    for heading, head, rows in details:
        body += [f"<h3>{e(heading)}</h3>", _html_table(head, rows)]
    html_path = out / REPORT_HTML
    html_path.write_text(html_page(title, "\n".join(body)), encoding="utf-8")
    return md_path, html_path


def report_is_stale(run_dir) -> bool:
    d = Path(run_dir)
    html_p, md_p = d / REPORT_HTML, d / REPORT_MD
    if not (html_p.exists() and md_p.exists()):
        return True
    t = min(html_p.stat().st_mtime, md_p.stat().st_mtime)
    return any((d / f).exists() and (d / f).stat().st_mtime > t
               for f in ("results.jsonl", "summary.json", "env.json", "run.json"))


# --------------------------------------------------------------------------- CLI body

def cli_show(label: str, runs_dir_opt=None, rewrite: bool = False) -> None:
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table

    from .cli import _console, fail
    from .runs import RunError, resolve, runs_dir

    try:
        run = resolve(label, runs_dir(runs_dir_opt))
        if rewrite or report_is_stale(run.path):
            md_path, html_path = write_report(run)
        else:
            md_path, html_path = run.path / REPORT_MD, run.path / REPORT_HTML
        m = run.metrics
        warnings = run_warnings(run)
    except RunError as e:
        raise fail(str(e)) from None
    out = _console()
    table = Table(title=f"run {run.id}", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value")
    for k, v in summary_rows(run, m):
        table.add_row(escape(k), escape(v))
    out.print(table)
    if m.get("categories"):
        ct = Table(title="τ per category")
        for col in ("category", "prompts", "tau_macro", "tau_pooled"):
            ct.add_column(col, justify="left" if col == "category" else "right")
        for c, v in m["categories"].items():
            ct.add_row(escape(c), str(v["prompts"]), fnum(v["tau_macro"]), fnum(v["tau_pooled"]))
        out.print(ct)
    if warnings:
        out.print(Panel("\n".join(f"• {escape(w)}" for w in warnings), title="warnings", border_style="yellow"))
    out.print(f"report: {escape(str(md_path))}\n        {escape(str(html_path))}")
