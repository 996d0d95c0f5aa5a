"""`dflash-ops eval`, `attach`, `cancel` and `parity`."""
from __future__ import annotations

import sys
from typing import List, Optional

import typer

from remote.contract import events
from remote.contract.settings import EvalSettings
from remote.contract.states import State

from . import console
from .console import safe
from .context import CATALOG_HELP, RUNS_DIR_HELP
from .context import names as context_names
from .guard import INTERRUPTED
from .options import with_settings


class _Progress:
    """One progress line per unfinished shard: its host, the phase it is in (pre-flight, waiting
    for the worker, loading target, drafting, finished), prompts done, and the τ the summary
    leads with (τ macro: the mean of per-prompt τ; offline at T > 0 the expected τ macro, so named)."""

    def __init__(self, record, out):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        from rich.table import Column

        self.record = record
        # the prompt just finished comes last, in what width is left: on a narrow terminal it is cut
        last = Column(max_width=max(10, out.width - 58), no_wrap=True, overflow="ellipsis")
        self.bars = Progress(TextColumn("[bold]{task.fields[host]}[/] {task.fields[phase]:<14}"), BarColumn(bar_width=12),
                             MofNCompleteColumn(), TextColumn("{task.fields[measure]} {task.fields[tau]}"),
                             TimeElapsedColumn(),
                             TextColumn("{task.fields[last]}", table_column=last), console=out, transient=False)
        self.tasks = {s.index: self.bars.add_task("", total=None, host=safe(s.label), phase="waiting", tau="-",
                                                  measure="τ macro", last="") for s in record.shards if not s.fetched}
        self.taus: dict[int, list[float]] = {i: [] for i in self.tasks}
        self.done: dict[int, int] = {i: 0 for i in self.tasks}
        self.ended: set[int] = set()     # the worker wrote its summary (it is finishing or finished)
        self.errors: dict[int, str] = {}

    def on_event(self, i: int, ev: dict) -> None:
        """Show a worker event: a host's data, so every text in it is shown :func:`console.safe`
        (markup escaped, control characters stripped) and a malformed event is skipped, never the
        end of the display."""
        try:
            self._show(i, ev)
        except (KeyError, TypeError, ValueError):
            pass

    def _show(self, i: int, ev: dict) -> None:
        kind, task = ev.get(events.KEY), self.tasks[i]
        if kind == events.PHASE:
            self.bars.update(task, phase=safe(ev.get("phase", "")))
        elif kind == events.START:
            self.done[i] = int(ev.get("done", 0))
            self.bars.update(task, total=int(ev["prompts"]), completed=self.done[i], phase="drafting")
        elif kind == events.PROMPT:
            expected = ev.get("tau") is None and "expected_tau" in ev      # offline at T > 0: an estimate
            tau = ev.get("expected_tau") if expected else ev.get("tau")
            shown = "-" if tau is None else f"{float(tau):.2f}"
            done = int(ev["done"])
            if tau is not None:
                self.taus[i].append(float(tau))
            self.done[i] = done
            macro = sum(self.taus[i]) / len(self.taus[i]) if self.taus[i] else None
            last = (f"{ev['id']}: {ev.get('anchors', '?')} anchors, expected τ {shown}" if expected
                    else f"{ev['id']}: {ev['cycles']} blocks, τ {shown}")
            self.bars.update(task, completed=done, tau="-" if macro is None else f"{macro:.2f}",
                             measure="expected τ macro" if expected else "τ macro", last=safe(last))
        elif kind == events.END:
            self.ended.add(i)
            self.bars.update(task, phase="finished")
        elif kind == events.EXIT:
            self.ended.add(i)
            self.bars.update(task, phase="finished" if ev.get("state") == "done" else safe(ev.get("state")))
        elif kind == events.ERROR:
            self.errors[i] = str(ev.get("message", ""))
        elif kind == events.SCHEDULER:          # a Slurm task: queued (with Slurm's reason), then on a node
            label = safe(self.record.shards[i].label)
            if ev.get("state") == "queued":
                self.bars.update(task, phase="queued", last=safe(str(ev.get("why") or "")))
                self.bars.console.print(f"{label}: job {safe(str(ev.get('job')))} {safe(str(ev.get('why') or 'queued'))}",
                                        highlight=False)
            elif ev.get("state") == "running":
                where = f"job {safe(str(ev.get('job')))} on {safe(str(ev.get('node') or '?'))}"
                self.bars.update(task, phase="running", last=where)
                self.bars.console.print(f"{label}: running, {where}", highlight=False)
            else:                               # unknown: Slurm does not answer (said, then waited for)
                why = safe(str(ev.get("why") or ev.get("state")))
                self.bars.update(task, phase=safe(str(ev.get("state"))), last=why)
                self.bars.console.print(f"{label}: job {safe(str(ev.get('job')))} {why}", highlight=False)

    def interrupted(self) -> str:
        """What is true when the user presses Ctrl-C: which workers still run, which finished."""
        rid, shards = safe(self.record.id), self.record.shards
        running = [s for s in shards if not s.fetched and s.index not in self.ended]
        unfetched = [s for s in shards if not s.fetched and s.index in self.ended]
        if running:
            done = {s.index: self.done.get(s.index, 0) for s in running}
            where = ", ".join(f"{safe(s.label)} ({done[s.index]} prompt{'' if done[s.index] == 1 else 's'} done)"
                              for s in running)
            return (f"Detached. The worker keeps running on {where}. Re-attach with: [bold]dflash-ops attach {rid}[/]"
                    f"  (cancel with: dflash-ops cancel {rid})")
        if unfetched:
            return (f"Detached. The worker on {', '.join(safe(s.label) for s in unfetched)} had already finished; "
                    f"its results are not fetched yet: [bold]dflash-ops attach {rid}[/] fetches them and writes the "
                    f"report.")
        return (f"Interrupted after the results were fetched into {safe(self.record.folder)}; the report may be "
                f"missing: [bold]dflash-ops show {rid}[/] writes it.")


def _follow_and_finish(record, jobs, out, stall: dict | None = None) -> None:
    """Follow the run, then merge, report and summarize it; Ctrl-C detaches (exit 130) and says
    what is true at that moment. ``stall``: the stall limits (eval/pipeline.py stall_limits)."""
    from ..eval.pipeline import EvalError, complete, failed_logs

    progress = _Progress(record, out)
    try:
        try:
            with progress.bars:
                summary, (_, html_path) = complete(record, jobs, progress.on_event, stall)
        finally:
            for i, msg in progress.errors.items():
                out.print(f"[red]{safe(record.shards[i].label)}: {safe(msg)}[/]")
    except KeyboardInterrupt:
        record.detached()
        out.print(f"\n[yellow]{progress.interrupted()}[/]")
        raise typer.Exit(INTERRUPTED) from None
    except EvalError:
        for host, tail in failed_logs(record, jobs).items():
            out.print(f"[bold red]worker {safe(host)} failed.[/] Last lines of its log:")
            out.print(safe(tail or "(no log)"))
        raise
    from ..reports.report import expected_rows, report_verdict
    from ..runs.folders import load_run

    fmt = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
    expected = summary.get("expected")
    if expected:        # offline at T > 0: no walk, the expected acceptance (an estimate)
        rows = [[key, fmt(summary.get(key))] for key in ("mode", "prompts")]
        rows += [[name, value] for name, value in expected_rows(expected, 3)]
    else:
        rows = [[key, fmt(summary.get(key))] for key in ("tau_macro", "tau_macro_turns", "tau_pooled",
                                                          "tau_sglang", "mode", "prompts", "cycles", "tokens")]
    rows += [[f"DDTree-{b} τ (macro)", fmt(t.get("tau_macro"))] for b, t in (summary.get("ddtree") or {}).items()]
    online = summary.get("online")
    if online:
        rows += [["tokens/s", fmt(online.get("tokens_per_s"))], ["speedup vs target", fmt(online.get("speedup"))],
                 ["lossless", "n/a (sampled)" if online.get("lossless") is None else str(online["lossless"])]]
    acc = summary.get("per_position_acceptance") or []
    if acc and not expected:
        rows.append(["acceptance @1..4", " ".join(f"{a:.2f}" for a in acc[:4])])
    out.print(f"[bold]{safe(report_verdict(load_run(record.folder)))}[/]")
    out.print(console.table(f"run {record.id}", ["metric", "value"], rows, right=("value",)))
    out.print(f"results: {safe(str(record.folder))}")
    out.print(f"report:  {safe(str(html_path))}")


def _locate_or_sync(names, choice, host, sync: bool, out, err):
    """A training-run drafter's checkpoint on ``host``; one only on the training host is synced
    with ``--sync`` (or when the user says yes), else refused with the command that syncs it."""
    from ..names import NotSynced
    from .sync import run_sync

    with err.status(f"{host.name}: connecting, looking for the checkpoints of training run {choice.run.name} ..."):
        choice = names.locate_checkpoint(choice, host, from_source=sync)
    if choice.synced:
        return choice
    what, src = f"{choice.label}:{choice.checkpoint}", choice.source
    if not sync and sys.stdin.isatty() and err.is_terminal:
        sync = typer.confirm(f"{what} is on {src.name} but not on {host.name}. Sync it now?", default=True, err=True)
    if not sync:
        raise NotSynced(f"{what} is on {src.name} but not on {host.name}: add --sync to copy it first, or run "
                        f"`dflash-ops sync-ckpt {what} --to {host.name}`")
    run_sync(names, choice.checkpoint, run=choice.run.name, src=src.name, dst=host.name, typed=choice.typed or what)
    choice.synced, choice.source = True, None
    return choice


STALL_HELP = ("Stop following a worker that reports no progress for M minutes (it is left running; "
              "0: never; default: the host's `stall_minutes` in the inventory).")


@with_settings
def eval_cmd(
    ctx: typer.Context,
    settings: EvalSettings,
    host: List[str] = typer.Option(["local"], "--host", "-H", help="Eval host(s); several shard the prompts."),
    gpus: Optional[str] = typer.Option(None, "--gpus", metavar="all|N|IDS",
                                       help="One worker per GPU of each host (all, a count, or ids 0,2,5), "
                                            "the prompts sharded across them; on CPU the ids name CPU workers."),
    drafter: Optional[str] = typer.Option(None, "--drafter", "-d",
                                          help="LABEL[:CKPT] from the catalog, a folder on the host, or 'embedded' "
                                               "(default: the catalog's `default:`, else the newest synced "
                                               "checkpoint of its training run; 'embedded' on `local`)."),
    target: Optional[str] = typer.Option(None, "--target", "-t", help="Target label or folder on the host."),
    sglang: str = typer.Option("auto", "--sglang", help="Reference completions: auto (the host's SGLang in offline "
                                                         "mode), off (local greedy), or a URL as seen from the host."),
    sync: bool = typer.Option(False, "--sync", help="Copy the checkpoint from the training host first when the eval "
                                                    "host lacks it (no checkpoint named: the training host's newest)."),
    resume: Optional[str] = typer.Option(None, "--resume", metavar="RUN", help="Continue a cut-off run."),
    force: bool = typer.Option(False, "--force", help="With --resume: continue even though the drafter's weights, "
                                                      "the target or dflash-ops changed since its finished prompts "
                                                      "(recorded in the run and its report)."),
    stall_minutes: Optional[float] = typer.Option(None, "--stall-minutes", min=0, metavar="M",
                                                  help=STALL_HELP),
    detach: bool = typer.Option(False, "--detach", help="Start and return; follow later with `attach`."),
    as_json: bool = typer.Option(False, "--json", help="With --detach: print the started run as JSON."),
    verify_weights: bool = typer.Option(False, "--verify-weights",
                                        help="Pre-flight: check the weights' sha256 against the sync manifest."),
    catalog: Optional[str] = typer.Option(None, "--catalog", metavar="PATH", help=CATALOG_HELP),
    log_to: List[str] = typer.Option([], "--log-to", help="Also log the run to mlflow | tensorboard | wandb "
                                                         "(optional extras; see docs/watch.md)."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir", metavar="DIR", help=RUNS_DIR_HELP),
):
    """Evaluate a drafter on eval host(s): pre-flight, ship the worker, run it detached, follow,
    fetch the results into runs/<run-id>/ and write the report."""
    from ..errors import InputError
    from ..eval.pipeline import Notice, check_sglang_option, new_run, stall_limits, start
    from ..eval.placement import parse_gpus
    from ..reports.tracking import check_trackers

    out, err = console.out(), console.err()
    names = context_names(ctx, catalog=catalog, runs_dir=runs_dir)
    if as_json and not detach:
        raise InputError("--json goes with --detach (a followed run prints its progress)")
    if force and not resume:
        raise InputError("--force goes with --resume (it continues a run whose drafter, target or dflash-ops "
                         "changed)")
    trackers = check_trackers(log_to)
    check_sglang_option(sglang)
    parse_gpus(gpus)        # bad --gpus: one red line before any host is contacted
    if resume:
        record = names.run_record(resume, prefer=("running", "failed", "cancelled"))
        done, total = record.progress
        (err if as_json else out).print(
            f"resuming run {record.id} ({record.label} on {safe(', '.join(record.hosts))}): "
            + (f"{done} of {total} prompts were done when last heard from; " if total else "")
            + "a worker still running is followed, a stopped one restarts and skips its finished prompts")
    else:
        hosts = [names.host(h, role="eval") for h in host]
        choice = names.drafter(drafter, hosts[0], target)
        if choice.run:
            choice = _locate_or_sync(names, choice, hosts[0], sync, out, err)
        (err if as_json else out).print(safe(choice.statement(hosts[0].name)))
        record = new_run(names.runs_root, [h.name for h in hosts], choice, settings, sglang=sglang, gpus=gpus,
                         verify_weights=verify_weights)
        if record.request.suite_file:
            (err if as_json else out).print(f"suite {safe(record.request.suite_file)}: this machine's file, sent to "
                                            f"{safe(', '.join(record.hosts))}")
    status = err.status("pre-flight ...") if not as_json else None
    if status:
        status.start()

    def on_phase(h: str, phase: str) -> None:
        if status:
            status.update(f"{safe(h)}: {safe(phase)} ...")
        if isinstance(phase, Notice) and not err.is_terminal:     # no spinner shows it: a line of its own
            err.print(safe(f"{h}: {phase}"), highlight=False, soft_wrap=True)
    try:
        forced = len(record.forced)
        jobs = start(record, names.inventory, resume=bool(resume), on_phase=on_phase, force=force)
    finally:
        if status:
            status.stop()
    for change in record.forced[forced:]:
        err.print(f"[yellow]--force: resumed although the {safe(change['what'])} of {safe(change['shard'])} changed "
                  f"({safe(change['change'])}); recorded in the run[/]")
    where = ", ".join(record.hosts)
    if detach:
        if as_json:
            console.print_json({"id": record.id, "hosts": [s.host for s in record.shards], "folder": str(record.folder),
                                "status": str(record.status), "attach": f"dflash-ops attach {record.id}"})
        else:
            out.print(f"run [bold]{safe(record.id)}[/] started on {safe(where)}")
            out.print(f"follow with: dflash-ops attach {record.id}")
        return
    out.print(f"run [bold]{safe(record.id)}[/] started on {safe(where)}")
    _follow_and_finish(record, jobs, out, stall_limits(record, names.inventory, stall_minutes))
    if trackers:
        from ..reports.tracking import log_run

        for where in log_run(trackers, record.folder, record.folder.parent):
            out.print(f"logged to {safe(where)}")


RUN_HELP = "A run id (or a unique prefix), a drafter label or LABEL:CKPT (its newest run), or latest."


def attach_cmd(ctx: typer.Context, run: str = typer.Argument(..., help=RUN_HELP),
               stall_minutes: Optional[float] = typer.Option(None, "--stall-minutes", min=0, metavar="M",
                                                             help=STALL_HELP),
               runs_dir: Optional[str] = typer.Option(None, "--runs-dir", metavar="DIR", help=RUNS_DIR_HELP)):
    """Follow a running (or finished but not yet fetched) run again, then fetch and report it."""
    from ..eval.pipeline import jobs_of, reattach, stall_limits

    names = context_names(ctx, runs_dir=runs_dir)
    record = names.run_record(run, prefer=("running",))
    jobs = jobs_of(record, names.inventory)
    out = console.out()
    for line in reattach(record, jobs):
        out.print(safe(line))
    _follow_and_finish(record, jobs, out, stall_limits(record, names.inventory, stall_minutes))


def cancel_cmd(ctx: typer.Context, run: str = typer.Argument(..., help=RUN_HELP),
               runs_dir: Optional[str] = typer.Option(None, "--runs-dir", metavar="DIR", help=RUNS_DIR_HELP)):
    """Stop a run's workers (finished prompts stay on the host; `eval --resume RUN` continues)."""
    from ..eval.pipeline import cancel

    names = context_names(ctx, runs_dir=runs_dir)
    record = names.run_record(run, prefer=("running",))
    out = console.out()
    for host, st in cancel(record, names.inventory).items():
        out.print(safe(cancel_line(host, st)))
    if record.status == State.CANCELLED:
        out.print(f"`dflash-ops eval --resume {safe(record.id)}` finishes it; `dflash-ops show {safe(record.id)}` shows "
                  f"what is there")
    else:
        out.print(f"run {safe(record.id)}: {record.status} (nothing was running; nothing was cancelled)")


def cancel_line(host: str, st: dict) -> str:
    """What `cancel` did on one host, in words: ``cancelled on ct129 after 5 of 12 prompts``."""
    done, todo = st.get("done"), st.get("prompts")
    count = "" if done is None else f" after {done}" + (f" of {todo}" if todo else "") + \
        f" prompt{'' if (todo or done) == 1 else 's'}"
    state = st.get("state")
    if state == "cancelled":
        return f"cancelled on {host}{count}"
    if state in ("done", "failed", "lost"):
        return f"{host}: the worker had already ended ({state}){count}"
    return f"{host}: the worker is {state or 'in an unknown state'}{count}" + (f" ({st['why']})" if st.get("why") else "")


def parity_cmd(ctx: typer.Context, run: str = typer.Argument(..., help=RUN_HELP),
               max_anchors: int = typer.Option(2000, "--max-anchors", help="Anchors to check (from the run's completions)."),
               runs_dir: Optional[str] = typer.Option(None, "--runs-dir", metavar="DIR", help=RUNS_DIR_HELP)):
    """Teacher-forced per-position accuracy of the run's checkpoint computed the training way
    (batched anchor mask) and the eval way (per anchor), side by side, on the run's own completions;
    for a drafter SpecForge trains, SpecForge's own training-side numbers and the gaps to ours."""
    from ..eval.parity import ParityError, run_parity, specforge_rows, three_way

    names = context_names(ctx, runs_dir=runs_dir)
    record = names.run_record(run, prefer=("done",), need="results.jsonl")
    out = console.out()
    with console.err().status(f"parity of {record.id} on {record.shards[0].host} ..."):
        report = run_parity(record, names.inventory, max_anchors)
    paths = ("training", "eval", "eval_ctx_plus_one")
    acc, tau = report["accuracy"], report["tau_estimate"]
    rows = [[str(k + 1), *(f"{acc[m][k]:.3f}" for m in paths)] for k in range(len(acc["training"]))]
    rows.append(["τ est.", *(f"{tau[m]:.2f}" for m in paths)])
    head = ["slot k", "training (batched mask)", "eval (per anchor, ctx [:p])", "ctx [:p+1] (one token too many)"]
    out.print(console.table(f"parity {record.id}: teacher-forced accuracy over {report['anchors']} anchors", head, rows,
                            right=head))
    ways = three_way(record, report)
    out.print(console.table(f"τ of the same checkpoint on {record.id}'s prompts (pooled)", ["how", "τ", "counted as"],
                            [list(w) for w in ways], right=("τ",)))
    sf_rows = specforge_rows(report)
    if sf_rows:
        sf = report["specforge"]
        head = ["token scored", "from slot", "accuracy", "positions"]
        out.print(console.table(f"SpecForge's teacher-forced accuracy ({sf['family']})", head, sf_rows, right=head))
        for gap in report.get("gaps") or []:
            out.print(f"- {safe(gap)}")
    if not report["agree"]:
        raise ParityError(f"training and eval paths disagree on {report['draft_disagreements']} draft tokens")
    out.print("[green]training and eval paths agree draft for draft[/] "
              "([:p+1] reads the anchor's own target features, which do not exist yet at inference)")


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_cmd)
    app.command("attach")(attach_cmd)
    app.command("cancel")(cancel_cmd)
    app.command("parity")(parity_cmd)
