"""`dflash-ops eval`, `attach`, `cancel` and `parity`."""
from __future__ import annotations

from typing import List, Optional

import typer
from rich.markup import escape

from . import console
from .context import RUNS_DIR_HELP, inventory
from .guard import INTERRUPTED


def _tau_text(tau) -> str:
    return "-" if tau is None else f"{tau:.2f}"


def _follow(record, jobs, out) -> None:
    """Follow the run with one progress bar per unfinished shard; Ctrl-C detaches (exit 130)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..evaluate import follow

    progress = Progress(TextColumn("[bold]{task.fields[host]}[/]"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("prompts  τ {task.fields[tau]}  {task.fields[last]}"), TimeElapsedColumn(),
                        console=out, transient=False)
    bars = {i: progress.add_task("", total=None, host=s.label, tau="-", last="")
            for i, s in enumerate(record.shards) if not s.fetched}
    errors: dict[int, str] = {}

    def on_event(i: int, ev: dict) -> None:
        kind = ev.get("event")
        if kind == "start":
            progress.update(bars[i], total=ev["prompts"], completed=ev.get("done", 0))
        elif kind == "prompt":   # tau is null offline at T > 0 (expected_tau then) and for one-token completions
            tau, est = ev.get("tau"), ev.get("expected_tau")
            progress.update(bars[i], completed=ev["done"], tau=_tau_text(ev.get("tau_running")),
                            last=f"{ev['id']}: {ev['cycles']} blocks, " + (f"expected τ {_tau_text(est)} (estimate)"
                                                                           if est is not None else f"τ {_tau_text(tau)}"))
        elif kind == "error":
            errors[i] = ev.get("message", "")

    try:
        with progress:
            errors.update(follow(record, jobs, on_event))
    except KeyboardInterrupt:
        record.detached()
        out.print(f"\n[yellow]Detached. The run continues on {record.host}.[/] Re-attach with: "
                  f"[bold]dflash-ops attach {record.id}[/]  (cancel with: dflash-ops cancel {record.id})")
        raise typer.Exit(INTERRUPTED) from None
    for i, msg in errors.items():
        out.print(f"[red]{escape(record.shards[i].label)}: {escape(msg)}[/]")


def _finish(record, jobs, out) -> None:
    """Merge, report and summarize a followed run (the failed shards' logs first when it failed)."""
    from ..evaluate import EvalError, failed_logs, finish

    try:
        summary, (_, html_path) = finish(record)
    except EvalError:
        for host, tail in failed_logs(record, jobs).items():
            out.print(f"[bold red]worker {escape(host)} failed.[/] Last lines of its log:")
            out.print(escape(tail or "(no log)"))
        raise
    fmt = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
    rows = [[key, fmt(summary.get(key))] for key in ("mode", "prompts", "cycles", "tokens", "tau_macro",
                                                      "tau_macro_turns", "tau_pooled", "tau_sglang")]
    if summary.get("expected"):
        rows.append(["expected τ (offline T > 0: estimate)", fmt(summary["expected"].get("tau"))])
    rows += [[f"DDTree-{b} τ (macro)", fmt(t.get("tau_macro"))] for b, t in (summary.get("ddtree") or {}).items()]
    online = summary.get("online")
    if online:
        rows += [["tokens/s", fmt(online.get("tokens_per_s"))], ["speedup vs target", fmt(online.get("speedup"))],
                 ["lossless", "n/a (sampled)" if online.get("lossless") is None else str(online["lossless"])]]
    acc = summary.get("per_position_acceptance") or []
    if acc:
        rows.append(["acceptance @1..4", " ".join(f"{a:.2f}" for a in acc[:4])])
    out.print(console.table(f"run {record.id}", ["metric", "value"], rows, right=("value",)))
    out.print(f"results: {escape(str(record.folder))}")
    out.print(f"report:  {escape(str(html_path))}")


def _open_run(run: str, runs_dir: str | None, need: str = "run.json"):
    from ..runrecord import RunRecord
    from ..runs import RunError, runs_dir as find_runs_dir

    root = find_runs_dir(runs_dir)
    if not (root / run / need).exists() or not (root / run / "run.json").exists():
        raise RunError(f"no {'finished ' if need != 'run.json' else ''}run {run!r} in {root}")
    return RunRecord.load(root / run)


def eval_cmd(
    ctx: typer.Context,
    host: List[str] = typer.Option(["local"], "--host", "-H", help="Eval host(s); several shard the prompts."),
    gpus: Optional[str] = typer.Option(None, "--gpus", metavar="all|N|IDS",
                                       help="One worker per GPU of each host (all, a count, or ids 0,2,5), "
                                            "the prompts sharded across them; on CPU the ids name CPU workers."),
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
    thinking: str = typer.Option("off", "--thinking", help="Chat template thinking: off (as z-lab's published runs) "
                                                            "| on | default (the template's own)."),
    ddtree: Optional[str] = typer.Option(None, "--ddtree", help="Offline DDTree node budgets, each 1..1024 ('' to "
                                                                "skip; default 8,16,32,64 greedy, none at T > 0)."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy; > 0 samples (online: lossless "
                                                                 "speculative sampling; offline: expected τ, an estimate)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (1 = off)."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = off)."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed (each prompt's seed derives from it and the prompt id)."),
    all_anchors: bool = typer.Option(False, "--all-anchors", help="Also every completion position as an anchor."),
    target_devices: Optional[str] = typer.Option(None, "--target-devices", metavar="N|auto",
                                                 help="Split the target over N GPUs per worker (device_map); "
                                                      "auto: every GPU of the host."),
    max_memory: Optional[float] = typer.Option(None, "--max-memory", metavar="GIB",
                                               help="Use at most this many GiB per device (memory pre-flight, device_map)."),
    resume: Optional[str] = typer.Option(None, "--resume", metavar="RUN", help="Continue a cut-off run."),
    detach: bool = typer.Option(False, "--detach", help="Start and return; follow later with `attach`."),
    as_json: bool = typer.Option(False, "--json", help="With --detach: print the started run as JSON."),
    verify_weights: bool = typer.Option(False, "--verify-weights",
                                        help="Pre-flight: check the weights' sha256 against the sync manifest."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir", metavar="DIR", help=RUNS_DIR_HELP),
):
    """Evaluate a drafter on eval host(s): pre-flight, ship the worker, run it detached, follow,
    fetch the results into runs/<run-id>/ and write the report."""
    from ..errors import InputError
    from ..evaluate import EMBEDDED, check_request, split_drafter, start
    from ..placement import parse_gpus
    from ..runrecord import EvalRequest, RunRecord
    from ..runs import runs_dir as find_runs_dir

    out = console.out()
    inv = inventory(ctx)
    if mode not in ("offline", "online"):
        raise InputError(f"--mode must be offline or online, not {mode!r}")
    if as_json and not detach:
        raise InputError("--json goes with --detach (a followed run prints its progress)")
    parse_gpus(gpus)        # bad --gpus / --target-devices: one red line before any host is contacted
    if target_devices is not None and target_devices != "auto" and not (target_devices.isdigit() and int(target_devices) >= 1):
        raise InputError(f"--target-devices must be a count >= 1 or auto, not {target_devices!r}")
    if max_memory is not None and max_memory <= 0:
        raise InputError("--max-memory must be > 0 (GiB per device)")
    if resume:
        record = _open_run(resume, runs_dir)
    else:
        hosts = [inv.get(h) for h in host]
        label, ckpt = split_drafter(drafter or (EMBEDDED if hosts[0].is_local else None))
        if label is None:
            raise InputError("name a drafter: --drafter LABEL[:CKPT] (configs/drafters.yaml) or a folder on the host")
        req = EvalRequest(hosts=[h.name for h in hosts], drafter=label if ckpt is None else f"{label}:{ckpt}",
                          target=target, suite=suite, prompts=prompts or None, mode=mode,
                          max_new_tokens=max_new_tokens, max_blocks=max_blocks, device=device, dtype=dtype,
                          sglang=sglang, thinking=thinking, ddtree_budgets=ddtree, all_anchors=all_anchors,
                          verify_weights=verify_weights, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                          gpus=gpus, target_devices=target_devices, max_memory_gb=max_memory)
        check_request(req)
        record = RunRecord.create(find_runs_dir(runs_dir), req, label, ckpt)
    status = console.err().status("pre-flight ...") if not as_json else None
    if status:
        status.start()
    try:
        jobs = start(record, inv, resume=bool(resume),
                     on_preflight=lambda h: status.update(f"pre-flight on {h} ...") if status else None)
    finally:
        if status:
            status.stop()
    if detach:
        if as_json:
            console.print_json({"id": record.id, "hosts": [s.host for s in record.shards], "folder": str(record.folder),
                                "status": record.status, "attach": f"dflash-ops attach {record.id}"})
        else:
            out.print(f"run [bold]{record.id}[/] started on {record.host}")
            out.print(f"follow with: dflash-ops attach {record.id}")
        return
    out.print(f"run [bold]{record.id}[/] started on {record.host}")
    _follow(record, jobs, out)
    _finish(record, jobs, out)


def attach_cmd(ctx: typer.Context, run: str = typer.Argument(..., help="Run id."),
               runs_dir: Optional[str] = typer.Option(None, "--runs-dir", metavar="DIR", help=RUNS_DIR_HELP)):
    """Follow a running (or finished but not yet fetched) run again, then fetch and report it."""
    from ..evaluate import jobs_of

    record = _open_run(run, runs_dir)
    jobs = jobs_of(record, inventory(ctx))
    record.following()
    out = console.out()
    _follow(record, jobs, out)
    _finish(record, jobs, out)


def cancel_cmd(ctx: typer.Context, run: str = typer.Argument(..., help="Run id."),
               runs_dir: Optional[str] = typer.Option(None, "--runs-dir", metavar="DIR", help=RUNS_DIR_HELP)):
    """Stop a run's workers (finished prompts stay on the host; `eval --resume RUN` continues)."""
    import json

    from ..evaluate import cancel

    for host, state in cancel(_open_run(run, runs_dir), inventory(ctx)).items():
        console.out().print(f"{escape(host)}: {escape(json.dumps(state))}")


def parity_cmd(ctx: typer.Context, run: str = typer.Argument(..., help="Run id."),
               max_anchors: int = typer.Option(2000, "--max-anchors", help="Anchors to check (from the run's completions)."),
               runs_dir: Optional[str] = typer.Option(None, "--runs-dir", metavar="DIR", help=RUNS_DIR_HELP)):
    """Teacher-forced per-position accuracy of the run's checkpoint computed the training way
    (batched anchor mask) and the eval way (per anchor), side by side, on the run's own completions."""
    from ..parity import ParityError, run_parity

    record = _open_run(run, runs_dir, need="results.jsonl")
    out = console.out()
    with console.err().status(f"parity on {record.shards[0].host} ..."):
        report = run_parity(record, inventory(ctx), max_anchors)
    paths = ("training", "eval", "eval_ctx_plus_one")
    acc, tau = report["accuracy"], report["tau_estimate"]
    rows = [[str(k + 1), *(f"{acc[m][k]:.3f}" for m in paths)] for k in range(len(acc["training"]))]
    rows.append(["τ est.", *(f"{tau[m]:.2f}" for m in paths)])
    head = ["slot k", "training (batched mask)", "eval (per anchor, ctx [:p])", "ctx [:p+1] (seed bug)"]
    out.print(console.table(f"parity {run}: teacher-forced accuracy over {report['anchors']} anchors", head, rows,
                            right=head))
    if not report["agree"]:
        raise ParityError(f"training and eval paths disagree on {report['draft_disagreements']} draft tokens")
    out.print("[green]training and eval paths agree draft for draft[/] "
              "([:p+1] reads the anchor's own target features, which do not exist yet at inference)")


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_cmd)
    app.command("attach")(attach_cmd)
    app.command("cancel")(cancel_cmd)
    app.command("parity")(parity_cmd)
