"""`dflash-ops watch`: evaluate a training run's checkpoints as they appear (orchestrator/watch/)."""
from __future__ import annotations

from typing import List, Optional

import typer

from remote.contract import events
from remote.contract.settings import EvalSettings

from . import console
from .console import safe
from .context import CATALOG_HELP, RUNS_DIR_HELP
from .context import names as context_names
from .options import with_settings

COLOUR = {"info": "", "warn": "yellow", "alarm": "bold red"}


def _line(level: str, message: str) -> str:
    from datetime import datetime

    colour = COLOUR.get(level, "")
    text = f"{datetime.now():%H:%M:%S} {safe(message)}"
    return f"[{colour}]{text}[/]" if colour else text


def _say(level: str, message: str) -> None:
    console.err().print(_line(level, message))


class LiveView:
    """The terminal view while watching: what each eval host is doing (sync, eval progress with
    the running τ) and the newest points of the trajectory; log lines scroll above it."""

    def __init__(self, err):
        from rich.live import Live

        self.hosts: dict[str, str] = {}
        self.watcher = None
        self.live = Live(self.render(), console=err, refresh_per_second=4, transient=False)

    def render(self):
        from rich.console import Group

        hosts = console.table("eval hosts", ["host", "now"], [[h, a] for h, a in sorted(self.hosts.items())]
                              or [["-", "idle"]], markup=True)
        points = []
        state = self.watcher.state if self.watcher else None
        if state is not None:
            points = [[str(p.step), p.name, f"{p.summary.get('tau_macro') or 0:.3f}"] for p in state.done_points()[-5:]]
        return Group(hosts, console.table("newest points", ["step", "checkpoint", "τ macro"], points or [["-", "-", "-"]],
                                          right=("step", "τ macro")))

    def on_event(self, host: str, ev: dict) -> None:
        kind = ev.get(events.KEY)
        if kind == events.SYNC:
            self.hosts[host] = f"syncing {safe(ev['checkpoint'])}"
        elif kind == events.START:
            self.hosts[host] = f"eval: 0/{ev.get('prompts')} prompts"
        elif kind == events.PROMPT:
            tau = ev.get("tau_running")
            self.hosts[host] = (f"eval: {ev['done']}/{ev.get('prompts', '?')} prompts, "
                                f"τ {'-' if tau is None else f'{tau:.2f}'}")
        elif kind == events.EXIT:
            self.hosts[host] = "idle"
        self.live.update(self.render())

    def say(self, level: str, message: str) -> None:
        self.live.console.print(_line(level, message))
        self.live.update(self.render())


@with_settings
def watch_cmd(
    ctx: typer.Context,
    settings: EvalSettings,
    run: str = typer.Argument(..., help="Training run (configs/drafters.yaml), or a drafter label of one."),
    every: Optional[int] = typer.Option(None, "--every", metavar="STEPS", min=1,
                                        help="One checkpoint per STEPS training steps (default: every checkpoint)."),
    once: bool = typer.Option(False, "--once", help="One pass, then exit (for cron / systemd timers)."),
    interval: float = typer.Option(300.0, "--interval", metavar="S", min=1.0, help="Seconds between polls."),
    host: List[str] = typer.Option([], "--host", "-H", help="Eval host(s), one eval at a time each (default: by role)."),
    src: Optional[str] = typer.Option(None, "--from", metavar="HOST", help="Training host (default: by role)."),
    baseline: Optional[str] = typer.Option(None, "--baseline", metavar="LABEL",
                                           help="A drafter evaluated once with the same settings, drawn as a band."),
    alarm_ratio: Optional[float] = typer.Option(None, "--alarm-ratio", metavar="R", min=1.0,
                                                help="Alarm (exit 6 under --once) when eval τ and the training "
                                                     "run's tau_metric are more than R× apart."),
    max_attempts: int = typer.Option(3, "--max-attempts", min=1, help="Tries per checkpoint before giving up (raised, it "
                                                                       "tries given-up checkpoints again)."),
    redo: bool = typer.Option(False, "--redo", help="Evaluate a checkpoint again even when a finished run with "
                                                    "the same settings exists (default: that run is reused)."),
    sglang: str = typer.Option("auto", "--sglang", help="Reference completions, as `eval --sglang`."),
    log_to: List[str] = typer.Option([], "--log-to", help="Also log each point to mlflow | tensorboard | wandb "
                                                         "(optional extras; see docs/watch.md)."),
    catalog: Optional[str] = typer.Option(None, "--catalog", metavar="PATH", help=CATALOG_HELP),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir", metavar="DIR", help=RUNS_DIR_HELP),
):
    """Evaluate a training run as it trains: poll the training host, sync each new complete
    checkpoint, evaluate it with the same settings every time, append it to the trajectory
    (runs/watch-RUN/trajectory.html). With --ddtree N (online too) each point also has DDTree-N τ with
    its CI and, online, its speedup over plain decoding."""
    from ..eval.pipeline import check_sglang_option
    from ..reports.tracking import check_trackers
    from ..watch import WatchOptions, Watcher

    check_sglang_option(sglang)
    names = context_names(ctx, catalog=catalog, runs_dir=runs_dir)
    hosts = [names.host(h, role="eval").name for h in host] or [names.inventory.pick("eval", None).name]
    opts = WatchOptions(run=run, hosts=hosts, settings=settings, sglang=sglang, every=every, baseline=baseline,
                        alarm_ratio=alarm_ratio, max_attempts=max_attempts, redo=redo, src=src, log_to=check_trackers(log_to))
    err = console.err()
    view = LiveView(err) if err.is_terminal else None
    watcher = Watcher(names, opts, view.say if view else _say,
                      on_event=view.on_event if view else None)
    _say("info", f"watching run {watcher.run.name} (drafter {watcher.label}) → {', '.join(hosts)}; "
                 f"trajectory: {watcher.folder / 'trajectory.html'}")
    if view:
        view.watcher = watcher
        with view.live:
            result = watcher.watch(once=once, every_s=interval)
    else:
        result = watcher.watch(once=once, every_s=interval)
    out = console.out()
    out.print(f"trajectory: {safe(str(watcher.folder / 'trajectory.html'))}")
    result.raise_for_outcome(watcher.folder / "trajectory.html")


def register(app: typer.Typer) -> None:
    app.command("watch")(watch_cmd)
