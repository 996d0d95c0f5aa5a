"""`dflash-ops runs`, `show` and `compare`: eval run folders, a run's report, runs side by side."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.panel import Panel

from . import console
from .console import safe
from .context import RUNS_DIR_HELP
from .context import names as context_names


def runs_cmd(
    ctx: typer.Context,
    drafter: Optional[str] = typer.Option(None, "--drafter", help="Only runs of this drafter (LABEL or LABEL:CKPT)."),
    suite: Optional[str] = typer.Option(None, "--suite", help="Only runs of this suite."),
    host: Optional[str] = typer.Option(None, "--host", help="Only runs on this host."),
    status: Optional[str] = typer.Option(None, "--status", help="Only runs with this status (done, failed, running)."),
    as_json: bool = typer.Option(False, "--json", help="Print the list as JSON."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir", metavar="DIR", help=RUNS_DIR_HELP),
):
    """List runs: id, drafter:checkpoint, target, mode, suite, prompts, decoding settings, τ (offline
    at T > 0: the expected τ, an estimate, so marked), host, date, status."""
    from ..runs.folders import readable, run_rows, select_runs

    names = context_names(ctx, runs_dir=runs_dir)
    d = names.runs_root
    listed = readable(select_runs(names.runs_of(drafter, host), suite=suite, status=status))
    say_skipped(names.runs.skipped + listed.skipped)
    rows = run_rows(listed)
    if as_json:
        console.print_json(rows)
        return
    if not rows:
        filtered = " matching the filters" if any((drafter, suite, host, status)) else ""
        console.err().print(f"no runs in {safe(str(d))}{filtered}")
        return
    colors = {"done": "green", "failed": "red", "running": "yellow"}
    table_rows = []
    for row in rows:
        n = "-" if row["prompts"] is None else str(row["prompts"])
        if row["prompts_planned"] and row["prompts_planned"] != row["prompts"]:
            n += f"/{row['prompts_planned']}"
        tau = f"{row['tau_macro']:.3f}" if row["tau_macro"] is not None else \
            f"{row['expected_tau_macro']:.3f} expected" if row["expected_tau_macro"] is not None else "-"
        table_rows.append([safe(row["id"]), *(safe(str(row[k] or "-")) for k in ("label", "target", "mode", "suite")),
                           n, safe(row["settings"]), tau,
                           safe(str(row["host"] or "-")), safe(row["created_at"][:16].replace("T", " ")),
                           f"[{colors.get(row['status'], 'white')}]{safe(row['status'])}[/]"])
    console.out().print(console.table(f"runs ({d})", ["id", "drafter", "target", "mode", "suite", "prompts", "settings",
                                                     "τ macro", "host", "date", "status"], table_rows,
                                      right=("prompts", "τ macro"), markup=True))


def say_skipped(skipped: list[str]) -> None:
    """The run folders a listing left out, one warning line each saying why."""
    for why in skipped:
        console.warning_line(f"skipped a run folder that cannot be read: {why}")


def show_cmd(
    ctx: typer.Context,
    run: str = typer.Argument(..., help="A run id (or a unique prefix), a drafter label or LABEL:CKPT (its newest "
                                        "run), or latest."),
    rewrite: bool = typer.Option(False, "--rewrite", help="Rewrite report.md/report.html even if current."),
    as_json: bool = typer.Option(False, "--json", help="Print the run's metrics and report paths as JSON."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir", metavar="DIR", help=RUNS_DIR_HELP),
):
    """Print a run's verdict, its summary and the paths of its report (written if missing or stale)."""
    from ..reports.report import category_table, current_report, ddtree_table, report_verdict, run_warnings, summary_rows
    r = context_names(ctx, runs_dir=runs_dir).eval_run(run).check()    # a damaged folder: one line, nothing written
    md_path, html_path = current_report(r, rewrite)
    m = r.metrics
    warnings = run_warnings(r)
    verdict = report_verdict(r)
    if as_json:
        console.print_json({"id": r.id, "path": str(r.path), "run": r.record.to_dict() if r.record else None,
                            "verdict": verdict, "metrics": {
            k: v for k, v in m.items() if k != "per_prompt"}, "warnings": warnings,
            "report": {"md": str(md_path), "html": str(html_path)}})
        return
    out = console.out()
    out.print(f"[bold]{safe(verdict)}[/]")
    out.print(console.table(f"run {r.id}", ["metric", "value"], summary_rows(r, m), show_header=False,
                            wrap=("value",)))
    dd = ddtree_table(m)
    if dd:
        out.print(console.table("DDTree", *dd, right=dd[0][1:]))
    categories = category_table(m)
    if categories:
        out.print(console.table(*categories, right=categories[1][1:]))
    if warnings:
        out.print(Panel("\n".join(f"• {safe(w)}" for w in warnings), title="warnings", border_style="yellow"))
    out.print(f"report: {safe(str(md_path))}\n        {safe(str(html_path))}")


def compare_cmd(
    ctx: typer.Context,
    runs: List[str] = typer.Argument(..., help="Runs to compare: labels (LABEL, LABEL:CKPT: the newest runs that "
                                               "pair), ids or latest; the first is the baseline."),
    force: bool = typer.Option(False, "--force", help="Compare even when the runs do not pair (common prompts)."),
    resamples: int = typer.Option(10000, "--resamples", help="Bootstrap / permutation resamples."),
    seed: int = typer.Option(0, "--seed", help="Seed of the bootstrap and permutation test."),
    published: Optional[str] = typer.Option(None, "--published", metavar="BENCH",
                                            help="Show published numbers for BENCH (default: from the suite name)."),
    no_published: bool = typer.Option(False, "--no-published", help="Never show published numbers."),
    out: Optional[str] = typer.Option(None, "--out", metavar="DIR", help="Folder for compare.md/.html."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir", metavar="DIR", help=RUNS_DIR_HELP),
):
    """Pair runs prompt by prompt and compare them with the first: τ, per-position acceptance,
    DDTree, win/tie/loss, paired-bootstrap CIs and p-values. For a label, the newest runs that pair
    with the others are picked (and named, with why). Exit code 3 when no runs pair."""
    from ..reports.compare import (category_rows, compare_labels, difference_rows, env_warning_lines, per_position_rows,
                           refusal, side_by_side, stats_note)

    names = context_names(ctx, runs_dir=runs_dir)
    candidates = [names.eval_runs(label) for label in runs] if len(runs) > 1 else []
    result = compare_labels(runs, candidates, names.runs_root, force=force, resamples=resamples, seed=seed,
                            published=published, use_published=not no_published, out=Path(out) if out else None)
    say_skipped(list(dict.fromkeys(names.runs.skipped + result["skipped"])))
    if as_json:
        console.print_json(result)
    con = console.out()
    if not as_json:
        for line in result.get("verdict") or []:
            con.print(f"[bold]{safe(line)}[/]")
        for p in result["picked"]:
            con.print(safe(p["why"]))
    mismatches = "\n".join(f"• {safe(m['message'])}" for m in result["mismatches"])
    if result["refused"]:
        if not as_json:
            closest = "\n".join(f"• {safe(' + '.join(c['runs']))}: {safe(c['why'])}" for c in result["closest"])
            if closest:
                a, b = result["closest"][0]["runs"]
                closest += f"\nrun the eval that would pair, or compare a pair anyway: dflash-ops compare {a} {b} --force"
            console.err().print(Panel(mismatches, title="the newest runs do not pair", border_style="red"))
            if closest:
                console.err().print(Panel(closest, title="no runs of these labels pair; the closest candidates",
                                          border_style="yellow"))
        raise refusal(result)
    if as_json:
        return
    if result["mismatches"]:
        con.print(Panel(mismatches, title="FORCED: runs do not pair (--force)", border_style="red"))
    env_lines = env_warning_lines(result)
    if env_lines:
        con.print(Panel("\n".join(f"• {safe(x)}" for x in env_lines),
                        title="environment differences that can change the numbers", border_style="yellow"))
    for w in result["warnings"]:
        con.print(f"[yellow]! {safe(w)}[/]")
    pub = result.get("published")
    caption = (f"{pub['name']} at T={pub['temperature']:g}: {pub['label']} ({pub['source'].get('title')}, arXiv "
               f"{pub['source'].get('arxiv')})" + (f"; {pub['caveat']}" if pub.get("caveat") else "")) if pub else None
    if result.get("published_note"):
        con.print(f"[dim]{safe(result['published_note'])}[/]")
    tables = [("side by side", side_by_side(result), caption),
              ("difference vs baseline", difference_rows(result), stats_note(result)),
              ("per-position acceptance", per_position_rows(result), None)]
    if category_rows(result):
        tables.append(("per category (τ macro)", category_rows(result), None))
    for title, (head, rows), cap in tables:
        con.print(console.table(title, head, rows, right=head[1:], caption=cap, transpose=title == "side by side"))
    con.print(f"compare report:\n  {safe(result['outputs']['md'])}\n  {safe(result['outputs']['html'])}")


def register(app: typer.Typer) -> None:
    app.command("runs")(runs_cmd)
    app.command("show")(show_cmd)
    app.command("compare")(compare_cmd)
