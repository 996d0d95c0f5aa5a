"""`dflash-ops eval`, `attach`, `cancel` (registered on the main typer app by cli.py)."""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import List, Optional

import typer

from .evaluate import EMBEDDED, EvalError, EvalRequest, RunRecord, Shard

RUNS_DIR_HELP = "Runs folder (default: $DFLASH_OPS_RUNS, else ./runs)."


def runs_root(opt: str | None) -> Path:
    return Path(opt or os.environ.get("DFLASH_OPS_RUNS") or "runs")


def _cli():
    from . import cli
    return cli


def resolver(inv, req: EvalRequest, label: str, ckpt: str | None):
    """Returns ``resolve(host, runner, code_dir) -> (drafter_path, target_path)`` on that host."""
    from .evaluate import embedded_models

    def resolve(host, runner, code_dir):
        if label == EMBEDDED or req.target == EMBEDDED:
            drafter, target = embedded_models(host, runner, code_dir)
            return (drafter if label == EMBEDDED else label), (target if req.target in (None, EMBEDDED) else req.target)
        from .evaluate import catalog_paths
        return catalog_paths(host, runner, label, ckpt, req.target)

    return resolve


def _follow(record: RunRecord, run_dir: Path, jobs: dict, console) -> None:
    """Follow every unfinished shard with a progress bar; Ctrl-C detaches, leaving the jobs running."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .evaluate import finish_shard

    progress = Progress(TextColumn("[bold]{task.fields[host]}[/]"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("prompts  τ {task.fields[tau]}  {task.fields[last]}"), TimeElapsedColumn(),
                        console=console, transient=False)
    errors: dict[int, str] = {}

    def follow_one(i: int, task) -> None:
        shard, job = record.shards[i], jobs[i]
        try:
            for ev in job.follow():
                kind = ev.get("event")
                if kind == "start":
                    progress.update(task, total=ev["prompts"], completed=ev.get("done", 0))
                elif kind == "prompt":
                    progress.update(task, completed=ev["done"], tau=f"{ev['tau_running']:.2f}",
                                    last=f"{ev['id']}: {ev['cycles']} blocks, τ {ev['tau']:.2f}")
                elif kind == "error":
                    errors[i] = ev.get("message", "")
                elif kind == "exit":
                    finish_shard(job, run_dir, shard, ev)
        except Exception as e:  # noqa: BLE001 — reported below, the job itself keeps running
            errors[i] = f"lost contact with {shard.host}: {e}"

    threads = []
    with progress:
        for i, shard in enumerate(record.shards):
            if shard.fetched:
                continue
            task = progress.add_task("", total=None, host=shard.host, tau="-", last="")
            t = threading.Thread(target=follow_one, args=(i, task), daemon=True)
            t.start()
            threads.append(t)
        try:
            for t in threads:
                while t.is_alive():
                    t.join(0.2)
        except KeyboardInterrupt:
            record.save(run_dir)
            progress.stop()
            console.print(f"\n[yellow]Detached. The run continues on {record.host}.[/] "
                          f"Re-attach with: [bold]dflash-ops attach {record.id}[/]  "
                          f"(cancel with: dflash-ops cancel {record.id})")
            raise typer.Exit(130)
    for i, msg in errors.items():   # a shard we lost contact with stays unfetched: _finish says how to re-attach
        console.print(f"[red]{record.shards[i].host}: {msg}[/]")


def _finish(record: RunRecord, run_dir: Path, jobs: dict, console) -> None:
    from rich.markup import escape

    from .evaluate import merge_shards

    if not all(s.fetched for s in record.shards):
        record.status = "running"
        record.save(run_dir)
        console.print(f"[yellow]Not all shards finished; the workers keep running. "
                      f"Re-attach with: dflash-ops attach {record.id}[/]")
        raise typer.Exit(4)
    failed = [s for s in record.shards if s.state != "done"]
    if failed:
        record.status = "failed"
        record.save(run_dir)
        for s in failed:
            console.print(f"[bold red]worker on {s.host} failed (state {s.state}, exit code {s.exit_code}).[/] "
                          f"Last lines of its log:")
            log = run_dir / ("worker.log" if s.count == 1 else f"shard-{s.index}/worker.log")
            tail = "\n".join(log.read_text().splitlines()[-25:]) if log.exists() else jobs[s.index].log_tail()
            console.print(escape(tail or "(no log)"))
        console.print(f"Finished prompts are kept: [bold]dflash-ops eval --resume {record.id}[/]")
        raise typer.Exit(1)
    summary = merge_shards(run_dir, record.shards)
    record.status = "done"
    record.save(run_dir)
    report_paths = None
    try:
        from .report import write_report
        report_paths = write_report(run_dir)
    except ImportError:
        pass
    _print_summary(console, record, summary, run_dir, report_paths)


def _print_summary(console, record, summary, run_dir, report_paths) -> None:
    from rich.table import Table

    table = Table(title=f"run {record.id}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    fmt = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
    for key in ("mode", "prompts", "cycles", "tokens", "tau_macro", "tau_pooled"):
        table.add_row(key, fmt(summary.get(key)))
    for budget, t in (summary.get("ddtree") or {}).items():
        table.add_row(f"DDTree-{budget} τ (macro)", fmt(t.get("tau_macro")))
    online = summary.get("online")
    if online:
        table.add_row("tokens/s", fmt(online.get("tokens_per_s")))
        table.add_row("speedup vs target", fmt(online.get("speedup")))
        table.add_row("lossless", str(online.get("lossless")))
    acc = summary.get("per_position_acceptance") or []
    if acc:
        table.add_row("acceptance @1..4", " ".join(f"{a:.2f}" for a in acc[:4]))
    console.print(table)
    console.print(f"results: {run_dir}")
    if report_paths:
        console.print(f"report:  {report_paths[1]}")


def _jobs_for(record: RunRecord, inv) -> dict:
    from .jobs import HostJob
    from .transport import runner_for

    return {s.index: HostJob(runner_for(inv.get(s.host), inv), s.python, s.code_dir, s.run_dir)
            for s in record.shards}


def eval_cmd(
    ctx: typer.Context,
    host: List[str] = typer.Option(["local"], "--host", "-H", help="Eval host(s); several shard the prompts."),
    drafter: Optional[str] = typer.Option(None, "--drafter", "-d",
                                          help="LABEL[:CKPT] from configs/drafters.yaml, a folder on the host, "
                                               "or 'embedded' (default on `local`)."),
    target: Optional[str] = typer.Option(None, "--target", "-t", help="Target label or folder on the host."),
    suite: str = typer.Option("default", "--suite", help="Built-in suite name or a JSONL path on the host."),
    prompts: Optional[int] = typer.Option(2, "--prompts", "-n", help="First N prompts (0 = all)."),
    mode: str = typer.Option("offline", "--mode", help="offline (walk the reference) or online (real spec decoding)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens"),
    max_blocks: Optional[int] = typer.Option(None, "--max-blocks", help="Offline: at most N blocks per prompt."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda; cpu on `local`)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32 | bfloat16 (default: bf16 on CUDA, fp32 on CPU)."),
    sglang: str = typer.Option("auto", "--sglang", help="Reference completions: auto (the host's SGLang in offline "
                                                         "mode), off (local greedy), or a URL as seen from the host."),
    thinking: str = typer.Option("default", "--thinking", help="Chat template thinking: default | on | off."),
    ddtree: str = typer.Option("8,16,32,64", "--ddtree", help="DDTree budgets ('' to skip)."),
    all_anchors: bool = typer.Option(False, "--all-anchors", help="Also every completion position as an anchor."),
    resume: Optional[str] = typer.Option(None, "--resume", metavar="RUN", help="Continue a cut-off run."),
    detach: bool = typer.Option(False, "--detach", help="Start and return; follow later with `attach`."),
    verify_weights: bool = typer.Option(False, "--verify-weights",
                                        help="Pre-flight: check the weights' sha256 against the sync manifest."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir", metavar="DIR", help=RUNS_DIR_HELP),
):
    """Evaluate a drafter on eval host(s): pre-flight, ship the worker, run it detached, follow,
    fetch the results into runs/<run-id>/ and write the report."""
    from rich.console import Console

    from .evaluate import parallel, prepare_shard, run_id, split_drafter, worker_args, now_iso
    from .jobs import HostJob

    cli = _cli()
    console = Console(stderr=False, highlight=False)
    inv = cli._inventory(ctx)
    root = runs_root(runs_dir)
    if mode not in ("offline", "online"):
        raise cli.fail(f"--mode must be offline or online, not {mode!r}")
    with cli.user_errors():
        hosts = [inv.get(h) for h in host]
    if resume:
        run_dir = root / resume
        if not (run_dir / "run.json").exists():
            raise cli.fail(f"no run {resume!r} in {root}")
        record = RunRecord.load(run_dir)
        req = EvalRequest(**record.request)
        hosts = [inv.get(s.host) for s in record.shards]
    else:
        label, ckpt = split_drafter(drafter or (EMBEDDED if hosts[0].is_local else None))
        if label is None:
            raise cli.fail("name a drafter: --drafter LABEL[:CKPT] (configs/drafters.yaml) or a folder on the host")
        req = EvalRequest(hosts=[h.name for h in hosts], drafter=label if ckpt is None else f"{label}:{ckpt}",
                          target=target, suite=suite, prompts=prompts or None, mode=mode,
                          max_new_tokens=max_new_tokens, max_blocks=max_blocks, device=device, dtype=dtype,
                          sglang=sglang, thinking=thinking, ddtree_budgets=ddtree, all_anchors=all_anchors,
                          verify_weights=verify_weights)
        rid = run_id(label, ckpt, "+".join(h.name for h in hosts))
        run_dir = root / rid
        record = RunRecord(id=rid, drafter=label, checkpoint=ckpt, target=target or "default", suite=suite,
                           host=",".join(h.name for h in hosts), mode=mode, prompts=req.prompts,
                           created_at=now_iso(), status="preparing", request=req.__dict__.copy(),
                           shards=[Shard(host=h.name, index=i, count=len(hosts)) for i, h in enumerate(hosts)])
    label, ckpt = split_drafter(req.drafter)
    resolve = resolver(inv, req, label, ckpt)

    def prepare(i: int) -> HostJob:
        shard = record.shards[i]
        with console.status(f"pre-flight on {shard.host} ..."):
            return prepare_shard(hosts[i], inv, req, shard, record.id, resolve)

    try:
        with cli.user_errors():
            prepared = parallel(prepare, list(range(len(record.shards))))
    except EvalError as e:
        raise cli.fail(str(e), code=1)
    jobs = {i: job for i, job in enumerate(prepared)}
    if not req.target:        # show what was resolved (the drafter's catalog target or the embedded one)
        record.target = EMBEDDED if label == EMBEDDED else record.shards[0].target_path
    for i, job in jobs.items():
        shard = record.shards[i]
        shard.fetched, shard.state = False, "running"
        job.start(worker_args(req, shard, hosts[i], resume=bool(resume)))
    record.status = "running"
    record.save(run_dir)
    console.print(f"run [bold]{record.id}[/] started on {record.host}")
    if detach:
        console.print(f"follow with: dflash-ops attach {record.id}")
        return
    _follow(record, run_dir, jobs, console)
    _finish(record, run_dir, jobs, console)


def _open_run(ctx, run: str, runs_dir: str | None):
    """(cli, console, local run folder, its RunRecord, inventory) for a command on an existing run."""
    from rich.console import Console

    cli = _cli()
    run_dir = runs_root(runs_dir) / run
    if not (run_dir / "run.json").exists():
        raise cli.fail(f"no run {run!r} in {runs_root(runs_dir)}")
    return cli, Console(highlight=False), run_dir, RunRecord.load(run_dir), cli._inventory(ctx)


def attach_cmd(ctx: typer.Context, run: str = typer.Argument(..., help="Run id."),
               runs_dir: Optional[str] = typer.Option(None, "--runs-dir", metavar="DIR", help=RUNS_DIR_HELP)):
    """Follow a running (or finished but not yet fetched) run again, then fetch and report it."""
    cli, console, run_dir, record, inv = _open_run(ctx, run, runs_dir)
    with cli.user_errors():
        jobs = _jobs_for(record, inv)
        for s in record.shards:
            s.fetched = False
        _follow(record, run_dir, jobs, console)
    _finish(record, run_dir, jobs, console)


def cancel_cmd(ctx: typer.Context, run: str = typer.Argument(..., help="Run id."),
               runs_dir: Optional[str] = typer.Option(None, "--runs-dir", metavar="DIR", help=RUNS_DIR_HELP)):
    """Stop a run's workers (finished prompts stay on the host; `eval --resume RUN` continues)."""
    cli, console, run_dir, record, inv = _open_run(ctx, run, runs_dir)
    with cli.user_errors():
        for i, job in _jobs_for(record, inv).items():
            st = job.cancel()
            record.shards[i].state = st.get("state", "unknown")
            console.print(f"{record.shards[i].host}: {json.dumps(st)}")
    record.status = "cancelled"
    record.save(run_dir)


def parity_cmd(ctx: typer.Context, run: str = typer.Argument(..., help="Run id."),
               max_anchors: int = typer.Option(2000, "--max-anchors", help="Anchors to check (from the run's completions)."),
               runs_dir: Optional[str] = typer.Option(None, "--runs-dir", metavar="DIR", help=RUNS_DIR_HELP)):
    """Teacher-forced per-position accuracy of the run's checkpoint computed the training way
    (batched anchor mask) and the eval way (per anchor), side by side, on the run's own completions."""
    from rich.console import Console
    from rich.table import Table

    from .ship import ship
    from .transport import runner_for

    cli = _cli()
    console = Console(highlight=False)
    run_dir = runs_root(runs_dir) / run
    if not (run_dir / "results.jsonl").exists() or not (run_dir / "run.json").exists():
        raise cli.fail(f"no finished run {run!r} in {runs_root(runs_dir)}")
    record = RunRecord.load(run_dir)
    shard = record.shards[0]
    inv = cli._inventory(ctx)
    with cli.user_errors():
        host = inv.get(shard.host)
        runner = runner_for(host, inv)
        code_dir = ship(runner, host.python, host.workdir)
        remote_in, remote_out = f"{shard.run_dir}/parity-input.jsonl", f"{shard.run_dir}/parity.json"
        runner.put_file(run_dir / "results.jsonl", remote_in)
        device = record.request.get("device") or ("cpu" if host.is_local else None)
        argv = [host.python, "-m", "remote.parity", "--target", shard.target_path, "--drafter", shard.drafter_path,
                "--results", remote_in, "--out", remote_out, "--max-anchors", str(max_anchors)]
        argv += ["--device", device] if device else []
        with console.status(f"parity on {host.name} ..."):
            res = runner.run(argv, timeout=3600, env={"PYTHONPATH": code_dir}, cwd=code_dir)
        if not res.ok:
            raise cli.fail(f"parity failed on {host.name}: {res.stderr.strip()[-1500:]}", code=1)
        runner.get_file(remote_out, run_dir / "parity.json")
    report = json.loads((run_dir / "parity.json").read_text())
    table = Table(title=f"parity {run}: teacher-forced accuracy over {report['anchors']} anchors")
    table.add_column("slot k", justify="right")
    for name in ("training (batched mask)", "eval (per anchor, ctx [:p])", "ctx [:p+1] (seed bug)"):
        table.add_column(name, justify="right")
    acc = report["accuracy"]
    for k in range(len(acc["training"])):
        table.add_row(str(k + 1), *(f"{acc[m][k]:.3f}" for m in ("training", "eval", "eval_ctx_plus_one")))
    tau = report["tau_estimate"]
    table.add_row("τ est.", *(f"{tau[m]:.2f}" for m in ("training", "eval", "eval_ctx_plus_one")))
    console.print(table)
    if report["agree"]:
        console.print("[green]training and eval paths agree draft for draft[/] "
                      "([:p+1] reads the anchor's own target features, which do not exist yet at inference)")
    else:
        console.print(f"[bold red]training and eval paths disagree on {report['draft_disagreements']} draft tokens[/]")
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_cmd)
    app.command("attach")(attach_cmd)
    app.command("cancel")(cancel_cmd)
    app.command("parity")(parity_cmd)
