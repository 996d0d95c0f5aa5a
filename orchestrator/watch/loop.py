"""`dflash-ops watch RUN`: poll the training host, pick the new complete checkpoints, sync each
to an eval host, evaluate it with the same settings every time, and append it to the trajectory.

One pass (``--once``) = list the run's checkpoints (with the completeness rule, sync/complete.py)
→ select (every new one, or one per ``--every N`` steps; newest first) → one worker thread per eval
host takes the next checkpoint: sync (resumable) → eval (detached worker, followed) → record →
trajectory report. The state (state.py) is written before each step starts, so a killed watch
resumes where it stopped; a failure is recorded with its reason and retried on later passes, at
most ``max_attempts`` times. What is no checkpoint's fault costs no attempt: a host that does not
answer (the pass goes on with the hosts that do; the next pass tries it again), a training host
whose listing fails, a checkpoint the trainer deleted before it was synced (``gone``). A done
checkpoint whose weights change on the training host is evaluated again (its old point kept as
superseded), and a copy this watch synced of it is replaced.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..config.catalog import Catalog, CatalogError, TrainingRun
from ..errors import DflashOpsError, OperationFailed
from remote.contract import events
from remote.contract.settings import EvalSettings
from remote.contract.states import State

from ..reports.confidence import headline as confidence_headline
from ..runs.record import RunRecord
from .state import MAX_ATTEMPTS, Point, RunLock, WatchState

if TYPE_CHECKING:
    from ..names import Resolver

Say = Callable[[str, str], None]  # (level: info|warn|alarm, message)

class WatchAlarm(OperationFailed):
    """Eval τ departs from the training run's own τ metric by more than --alarm-ratio."""

    exit_code = 6


class PassFailed(OperationFailed):
    """Some checkpoint of the pass failed (recorded in the state; retried on a later pass)."""


@dataclass
class WatchOptions:
    run: str                          # training run (or a drafter label that names one)
    hosts: list[str]                  # eval hosts; one eval at a time on each
    settings: EvalSettings            # the same for every point of the trajectory
    sglang: str = "auto"              # reference completions, as `eval --sglang`
    every: int | None = None          # one checkpoint per N training steps (None: every one)
    baseline: str | None = None       # a drafter label evaluated once with the same settings
    alarm_ratio: float | None = None  # eval τ vs the training metric, either way
    max_attempts: int = MAX_ATTEMPTS
    redo: bool = False                # evaluate again even where a run with the same settings exists
    src: str | None = None            # training host (default: by role)
    log_to: list[str] = field(default_factory=list)  # experiment trackers (orchestrator/reports/tracking.py)


@dataclass
class PassResult:
    evaluated: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    waiting: list[tuple[str, str]] = field(default_factory=list)   # (checkpoint, why not now)
    gone: list[str] = field(default_factory=list)                  # deleted on the training host before their sync
    unreachable: dict[str, str] = field(default_factory=dict)      # host -> why it did not answer
    left: list[str] = field(default_factory=list)                  # checkpoints no host that answered took
    unlisted: str | None = None                                    # why the training host could not be listed
    alarms: list[str] = field(default_factory=list)

    def raise_for_outcome(self, report: Path) -> None:
        """``--once``'s exit: the alarm (6) first, then failed checkpoints, a failed listing, or
        checkpoints left for want of a host that answers (1)."""
        if self.alarms:
            raise WatchAlarm(f"{self.alarms[-1]}; see {report}")
        if self.failed:
            raise PassFailed(f"failed this pass (recorded, retried later): {', '.join(self.failed)}; see {report}")
        if self.unlisted:
            raise PassFailed(f"{self.unlisted}; see {report}")
        if self.left:
            raise PassFailed(f"waiting for {', '.join(self.unreachable)}: {', '.join(self.left)} left for a later "
                             f"pass; see {report}")


def drafter_for(catalog: Catalog, name: str) -> tuple[TrainingRun, str]:
    """(training run, drafter label) for RUN: a training run with a drafter entry, or a drafter label."""
    if name in catalog.drafters and catalog.drafters[name].run:
        return catalog.run(catalog.drafters[name].run), name
    run = catalog.run(name)
    labels = [d.label for d in catalog.drafters.values() if d.run == run.name]
    if not labels:
        raise CatalogError(f"run {run.name} has no drafter in the catalog (add `drafters: {run.name}: "
                           f"{{run: {run.name}, format: ..., target: ...}}`); watch evaluates it through one")
    return run, (run.name if run.name in labels else labels[0])


def select(checkpoints: list[dict], state: WatchState, every: int | None) -> list[dict]:
    """The listed checkpoints to work on, newest first: complete, not done or given up, and with
    ``every`` only the first checkpoint at or after each multiple of N steps."""
    stepped = [c for c in checkpoints if c["step"] is not None]
    if every:
        first: dict[int, int] = {}
        for c in stepped:
            b = c["step"] // every
            first[b] = min(first.get(b, c["step"]), c["step"])
        stepped = [c for c in stepped if first[c["step"] // every] == c["step"]]
    todo = [c for c in stepped if c["verdict"].complete and
            state.points.get(c["name"], Point(c["name"], c["step"])).status not in ("done", "gave_up")]
    return sorted(todo, key=lambda c: -c["step"])


def headline(summary: dict) -> dict:
    """What the trajectory keeps of an eval's summary. Offline at T > 0 there is no walk: its τ and
    per-position acceptance are the expected ones (``measure``: ``expected``)."""
    keys = ("prompts", "tau_macro", "tau_pooled", "per_position_acceptance", "mode")
    expected = summary.get("expected")
    out = {k: (expected if expected and k.startswith(("tau", "per_position")) else summary).get(k) for k in keys}
    if expected:
        out["measure"] = "expected"
    out["ddtree"] = {str(b): (t or {}).get("tau_macro") for b, t in (summary.get("ddtree") or {}).items()}
    engine = summary.get("engine")      # watch --engine: the serving engine's own τ and speedup
    if engine:
        out["engine"] = {k: engine.get(k) for k in ("kind", "tau_macro", "tau_pooled", "speedup")}
    out["confidence"] = confidence_headline(summary.get("confidence"))     # None: the drafter has no confidence head
    return out


class Watcher:
    def __init__(self, names: "Resolver", opts: WatchOptions, say: Say,
                 on_event: Callable[[str, dict], None] | None = None, sync_kw: dict | None = None):
        self.names = names    # the resolver `eval` uses: the eval of each point is named like one typed by hand
        self.inv, self.catalog, self.opts, self.say = names.inventory, names.catalog, opts, say
        runs_root = names.runs_root
        self.run, self.label = drafter_for(self.catalog, opts.run)
        self.runs_root = Path(runs_root)
        self.folder = self.runs_root / f"watch-{self.run.name}"
        self.on_event = on_event or (lambda host, ev: None)
        self.sync_kw = sync_kw or {}
        self.lock = threading.Lock()  # guards the state across host threads
        self.state: WatchState | None = None
        self.train_series: dict = {}
        self.src_dir: str | None = None     # the run's folder on the training host, as its listing says

    # --- one pass ----------------------------------------------------------------------------

    def run_pass(self) -> PassResult:
        from ..sync.complete import judge_listed
        from ..transport import runner_for

        result = PassResult()
        src = self.inv.pick("train", self.opts.src)
        try:
            with runner_for(src, self.inv) as srun:
                info = self._listing(srun, src)
                self.src_dir = info["dir"]
                self.train_series = self._training_metrics(srun, src)
        except OperationFailed as e:    # a host that does not answer, a listing that failed: the next pass
            result.unlisted = f"cannot list run {self.run.name} on training host {src.name}: {e}"
            self.say("warn", f"{result.unlisted}; tried again next pass")
            return result
        if not info.get("exists", True):
            self.say("warn", f"run {self.run.name}: {info['dir']} does not exist on {src.name} (yet)")
        for c in info["checkpoints"]:
            c["verdict"] = judge_listed(c, info["now"], self.run)
            if c["step"] is not None and not c["verdict"].complete:
                result.waiting.append((c["name"], c["verdict"].reason))
        for name, why in result.waiting:
            self.say("info", f"{name}: not complete yet ({why}); later")
        if info.get("exists", True):
            self._review({c["name"]: c for c in info["checkpoints"]})
        b = self.state.baseline
        if self.opts.baseline and b.get("status") != "done" and b.get("attempts", 0) < self.opts.max_attempts:
            self._baseline()
        todo = select(info["checkpoints"], self.state, self.opts.every)
        if todo:
            self.say("info", f"to evaluate (newest first): {', '.join(c['name'] for c in todo)}")
        work: queue.Queue = queue.Queue()
        for c in todo:
            work.put(c)

        def host_worker(host: str) -> None:
            why = None if work.empty() else self._unreachable(host)
            if why:
                with self.lock:
                    result.unreachable[host] = why
                self.say("warn", f"waiting for {host}: {why}; its share goes to the hosts that answer, "
                                 f"and it is tried again next pass")
                return
            while True:
                try:
                    c = work.get_nowait()
                except queue.Empty:
                    return
                name = c["name"]
                outcome = self._checkpoint(name, c["step"], host, c.get("ident"))
                with self.lock:
                    why = self.state.points[name].reason or ""
                    if outcome == "unreachable":        # left to the other hosts, or to the next pass
                        result.unreachable[host] = why
                        work.put(c)
                        return
                    if outcome == "unlisted":
                        result.unreachable[src.name] = why
                        result.left.append(name)
                    elif outcome == "waiting":
                        result.waiting.append((name, why))
                    elif outcome == "gone":
                        result.gone.append(name)
                    else:
                        (result.evaluated if outcome == "done" else result.failed).append(name)

        threads = [threading.Thread(target=host_worker, args=(h,), daemon=True) for h in self.opts.hosts]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.2)
        while not work.empty():
            result.left.append(work.get_nowait()["name"])
        result.alarms = self.alarms()
        for a in result.alarms:
            self.say("alarm", a)
        self.write_report()
        return result

    def _listing(self, srun, src) -> dict:
        """The training host's listing of the watched run (``exists``, ``dir``, ``checkpoints``, ``now``)."""
        from ..sync.listing import host_checkpoints

        return host_checkpoints(srun, src, [self.run], lambda r: r.source_dir(src.checkpoints))[self.run.name]

    def _still_listed(self, name: str) -> bool:
        """Whether the training host lists checkpoint ``name`` now (True when the run's folder
        itself is missing: that says nothing of one checkpoint). Raises when it cannot be listed."""
        from ..transport import runner_for

        src = self.inv.pick("train", self.opts.src)
        with runner_for(src, self.inv) as srun:
            info = self._listing(srun, src)
        return not info.get("exists", True) or any(c["name"] == name for c in info["checkpoints"])

    def _review(self, listed: dict[str, dict]) -> None:
        """Before the pass: a point the training host no longer lists is ``gone`` (unless its eval
        runs on); a done one whose files changed there is checked (:meth:`_recheck`); a given-up one
        is tried again when ``--max-attempts`` was raised past the limit it was given up under, else
        named with how to try it again."""
        for p in sorted(self.state.points.values(), key=lambda p: p.step):
            if p.name not in listed:
                if p.status not in ("done", "gone") and not (p.status == "evaluating" and p.eval_run):
                    self._gone(p)
            elif p.status == "done":
                entry = listed[p.name]
                if entry.get("ident") != p.ident and entry["verdict"].complete:
                    self._recheck(p, entry["ident"])
            elif p.status == "gave_up":
                limit = p.limit or p.attempts
                if self.opts.max_attempts > limit:
                    self.say("info", f"{p.name}: given up under --max-attempts {limit}; tried again under "
                                     f"--max-attempts {self.opts.max_attempts}")
                    with self.lock:
                        self.state.mark(p, "failed")
                else:
                    self.say("warn", f"{p.name}: given up after {p.attempts} attempt(s) ({p.reason}); "
                                     f"--max-attempts {limit + 1} tries it again")

    def _recheck(self, p: Point, ident: str) -> None:
        """Done point ``p``'s checkpoint lists other files (path, size, mtime) than it was evaluated
        from: hashed on the training host against the weights its eval run measured (env.json).
        Changed: the point is superseded (kept, marked) and the checkpoint evaluated anew; touched
        only, or nothing recorded to compare with: the new listing is kept."""
        from ..sync.fresh import describe

        measured = self._measured(p.eval_run)
        if measured:
            try:
                src, now = self._weights_now(p.name)
            except OperationFailed as e:
                self.say("warn", f"{p.name}: its files changed on the training host, and could not be hashed there "
                                 f"({e}); checked again next pass")
                return
            changed = sorted(f for f, h in measured.items() if now.get(f) != h)
            if changed:
                why = f"saved again on {src} since it was evaluated ({describe(changed)} changed)"
                with self.lock:
                    self.state.supersede(p, why)
                self.say("info", f"{p.name}: {why}; evaluated again, its old point kept as superseded")
                return
        with self.lock:
            p.ident = ident
            self.state.save()

    def _measured(self, eval_run: str | None) -> dict[str, str]:
        """{file: sha256} of the weights eval run ``eval_run`` measured (its env.json); {} when unknown."""
        from ..runs.folders import RunError, load_run, run_folder

        if not eval_run:
            return {}
        try:
            env = load_run(run_folder(self.runs_root, eval_run)).env or {}
        except (RunError, OSError):
            return {}
        return (env.get("drafter") or {}).get("sha256") or {}

    def _gone(self, p: Point) -> None:
        with self.lock:
            self.state.mark(p, "gone", reason=f"gone from the training host (deleted before it was synced; "
                                              f"was {p.status})")
        self.say("info", f"{p.name}: {p.reason}; skipped")

    def _unreachable(self, host: str) -> str | None:
        """Why eval host ``host`` does not answer now (None: it does, or it has no SSH connection
        to try: ``local``, a Ray cluster)."""
        from ..transport import runner_for

        h = self.inv.get(host)
        if h.is_local or h.is_ray:
            return None
        try:
            with runner_for(h, self.inv) as r:
                r.connect()
        except DflashOpsError as e:
            return str(e)
        return None

    def _training_metrics(self, srun, src) -> dict:
        from .trainlog import TrainLogError, fetch_series

        try:
            return fetch_series(srun, src, self.run)
        except TrainLogError as e:
            self.say("warn", str(e))
            return {}

    # --- one checkpoint ------------------------------------------------------------------------

    def _checkpoint(self, name: str, step: int, host: str, ident: str | None = None) -> str:
        """Sync, evaluate and record one checkpoint on ``host`` (``ident``: the listing of its files
        this pass): done, failed, gone, waiting, unreachable (``host`` stopped answering) or
        unlisted (the training host did). A copy this watch synced to ``host`` before, of files
        that changed since, is replaced; a copy made otherwise is refused by the sync."""
        from ..sync import sync_checkpoint
        from ..sync.complete import IncompleteCheckpoint
        from ..sync.tool import SyncBusy

        with self.lock:
            p = self.state.point(name, step)
        syncing = False
        try:
            summary = self._resume_eval(p)
            if summary is None and not self.opts.redo:
                summary = self._reuse(p)
                if summary is not None:
                    p.ident = ident             # the run's weights are the checkpoint's files now
            if summary is None:
                with self.lock:                 # the files the point stands for: the ones listed when it was synced
                    self.state.mark(p, "syncing", host=host, ident=ident)
                self.say("info", f"{name}: syncing to {host}")
                self.on_event(host, {events.KEY: events.SYNC, "checkpoint": name})
                syncing = True
                synced = sync_checkpoint(self.inv, self.catalog, name, run=self.run.name, src_name=self.opts.src,
                                         dst_name=host, replace_own_copy=self.state.copies.get(host, {}).get(name),
                                         **self.sync_kw)
                syncing = False
                if synced.copy_digest:
                    with self.lock:
                        self.state.copies.setdefault(host, {})[name] = synced.copy_digest
                        self.state.save()
                summary = self._evaluate(p, f"{self.label}:{name}", host, lambda rid: self._mark(p, "evaluating",
                                                                                                 eval_run=rid))
        except (IncompleteCheckpoint, SyncBusy) as e:      # not complete yet, or another sync of it: later
            self.say("info", f"{name}: {e}")
            with self.lock:
                self.state.mark(p, "waiting", reason=str(e))
            return "waiting"
        except DflashOpsError as e:
            return self._failed(p, host, e, syncing)
        head = headline(summary)
        with self.lock:
            self.state.mark(p, "done", summary=head, reason=None)
        self._track(p.eval_run, step)
        tau, measure = head["tau_macro"], "expected τ" if head.get("measure") else "τ"
        self.say("info", f"{name} (step {step}): {measure} {tau:.3f}" if tau is not None else f"{name}: done")
        self.write_report()
        return "done"

    def _failed(self, p: Point, host: str, e: DflashOpsError, syncing: bool) -> str:
        """A failure of ``p`` on ``host`` is an attempt only when it is the checkpoint's: not when
        the eval host stops answering (``unreachable``: the point goes back to the queue), nor, in
        its sync, when the training host does (``unlisted``) or no longer lists it (``gone``)."""
        from ..eval.pipeline import InvalidRun

        why, outcome, who = self._unreachable(host), "unreachable", host
        if why is None and syncing:
            try:
                if not self._still_listed(p.name):
                    self._gone(p)
                    return "gone"
            except OperationFailed as le:
                why, outcome, who = str(le), "unlisted", self.inv.pick("train", self.opts.src).name
        if why is not None:
            with self.lock:
                self.state.mark(p, "waiting", reason=f"waiting for {who}: {why}")
            self.say("warn", f"{p.name}: {p.reason} (not counted as an attempt; tried again next pass)")
            return outcome
        with self.lock:   # an invalid run is not retried: the same host decodes the same way again
            self.state.failed(p, str(e), self.opts.max_attempts, final=isinstance(e, InvalidRun))
        self.say("warn", f"{p.name}: failed (attempt {p.attempts} of {self.opts.max_attempts}): {e}")
        return "failed"

    def _track(self, eval_run: str | None, step: int) -> None:
        """The point's eval run into the experiment trackers (a failure there is a warning)."""
        if not self.opts.log_to or not eval_run:
            return
        from ..reports import tracking
        from ..runs.folders import run_folder

        try:
            folder = run_folder(self.runs_root, eval_run)
            for where in tracking.log_run(self.opts.log_to, folder, self.runs_root, step=step, group=self.run.name):
                self.say("info", f"logged {eval_run} to {where}")
        except Exception as e:  # noqa: BLE001 — a tracker's own failure must not lose the point
            self.say("warn", f"logging {eval_run} to {', '.join(self.opts.log_to)} failed: {e}")

    def _mark(self, p: Point, status: str, **fields) -> None:
        with self.lock:
            self.state.mark(p, status, **fields)

    def _weights_now(self, name: str) -> tuple[str, dict[str, str]]:
        """(training host, {file: sha256}) of checkpoint ``name``'s files there now."""
        from ..sync.tool import run_tool
        from ..transport import runner_for

        src = self.inv.pick("train", self.opts.src)
        with runner_for(src, self.inv) as srun:
            folder = f"{self.src_dir or self._listing(srun, src)['dir']}/{name}"
            files = run_tool(srun, src, "manifest", folder, "--hash", timeout=3600)["files"]
        return src.name, {f["path"]: f["sha256"] for f in files}

    def _reuse(self, p: Point) -> dict | None:
        """The summary of a finished, valid eval run of this checkpoint with exactly the watch's
        settings (an `eval` typed by hand, or an earlier watch), which then stands for the point:
        only when the weights it recorded (env.json's ``drafter.sha256``) are the checkpoint's now."""
        from ..runs.folders import RunError, load_runs

        current = None      # (training host, {file: sha256}), hashed there once a run could stand for the point
        for run in reversed(load_runs(self.runs_root)):
            rec = run.record
            if rec is None or rec.status != State.DONE or rec.drafter != self.label or rec.checkpoint != p.name:
                continue
            if rec.settings != self.opts.settings or rec.request.sglang != self.opts.sglang:
                continue
            try:
                if run.check().invalid or run.summary is None:
                    continue
            except RunError as e:       # a damaged folder stands for nothing
                self.say("warn", f"{p.name}: run {rec.id} not reused: {e}")
                continue
            recorded = (run.env.get("drafter") or {}).get("sha256") or {}
            try:
                current = current or self._weights_now(p.name)
            except OperationFailed:         # the sync that follows meets the same and says so
                return None
            src, now = current
            changed = sorted(f for f, h in recorded.items() if now.get(f) != h)
            if not recorded or changed:
                self.say("info", f"{p.name}: run {rec.id} not reused: the weights it measured "
                                 f"({', '.join(changed) or 'no sha256 recorded'}) are not the checkpoint's on {src} now")
                continue
            self.say("info", f"{p.name}: run {rec.id} has these settings already: reused (--redo evaluates again)")
            with self.lock:
                self.state.mark(p, "evaluating", eval_run=rec.id)
            return run.summary
        return None

    def _resume_eval(self, p: Point) -> dict | None:
        """The summary of ``p``'s eval run when it finished, or after re-attaching to it when its
        worker still runs (a watch killed mid-eval); None when it must be (re)started."""
        from ..runs.folders import load_run, run_folder

        if not p.eval_run or not (run_folder(self.runs_root, p.eval_run) / "run.json").exists():
            return None
        record = RunRecord.load(run_folder(self.runs_root, p.eval_run))
        if record.status == State.DONE:
            summary = load_run(record.folder).summary
            if summary is not None:
                return summary
        if record.status == State.PREPARING and not record.being_resumed():
            # the watch stopped while this run was being prepared (run.json is written before any worker
            # starts): resumed as `eval --resume` would, a worker already started followed, not started twice
            from ..eval.pipeline import start

            self.say("info", f"{p.name}: resuming eval run {record.id} (stopped while it was being prepared)")
            return self._follow(record, start(record, self.inv, resume=True))
        if record.status != State.RUNNING:
            return None
        self.say("info", f"{p.name}: re-attaching to eval run {record.id}")
        from ..eval.pipeline import jobs_of

        record.following()
        return self._follow(record, jobs_of(record, self.inv))

    def _evaluate(self, p: Point | None, drafter: str, host: str, on_id: Callable[[str], None]) -> dict:
        """Evaluate checkpoint ``p`` of the watched run (or, with ``p`` None, the drafter named
        ``drafter``: the baseline) on ``host``, its names resolved the way `eval` resolves them."""
        from ..eval.pipeline import new_run, start

        eval_host = self.inv.get(host)
        choice = self.names.drafter(drafter, eval_host)
        if choice.run is not None and p is None:
            choice = self.names.locate_checkpoint(choice, eval_host)
        if p is not None:
            choice = replace(choice, checkpoint=p.name, step=p.step)
        record = new_run(self.runs_root, [host], choice, self.opts.settings, sglang=self.opts.sglang)
        on_id(record.id)
        self.say("info", f"{drafter}: evaluating on {host} (run {record.id})")
        jobs = start(record, self.inv)
        return self._follow(record, jobs)

    def _follow(self, record: RunRecord, jobs) -> dict:
        """Follow an eval run to its end; a worker that makes no progress for its host's
        ``stall_minutes`` ends it with RunStalled: a failed attempt of the point (its worker left
        running, the line says how to attach or cancel), and the watch goes on."""
        from ..eval.pipeline import complete, stall_limits

        summary, _ = complete(record, jobs, lambda i, ev: self.on_event(record.shards[i].host, ev),
                              stall_limits(record, self.inv))
        return summary

    def _baseline(self) -> None:
        b = self.state.baseline
        label = self.opts.baseline
        try:
            from ..runs.folders import load_run, run_folder

            done = b.get("eval_run") and (run_folder(self.runs_root, b["eval_run"]) / "summary.json").exists()
            if done:
                summary = load_run(run_folder(self.runs_root, b["eval_run"])).summary
                if summary.get("invalid"):
                    raise DflashOpsError(f"baseline run {b['eval_run']} is invalid: {summary['invalid'].get('message')}")
            else:
                summary = self._evaluate(None, label, self.opts.hosts[0],
                                         lambda rid: self._set_baseline(label=label, status="evaluating", eval_run=rid))
        except DflashOpsError as e:
            why = self._unreachable(self.opts.hosts[0])
            if why is not None:
                self._set_baseline(label=label, status="waiting", reason=f"waiting for {self.opts.hosts[0]}: {why}")
                self.say("warn", f"baseline {label}: {b['reason']} (not counted as an attempt; tried again next pass)")
                return
            self._set_baseline(label=label, status="failed", reason=str(e), attempts=b.get("attempts", 0) + 1)
            self.say("warn", f"baseline {label}: failed: {e}")
            return
        self._set_baseline(label=label, status="done", summary=headline(summary), reason=None)

    def _set_baseline(self, **fields) -> None:
        with self.lock:
            self.state.baseline.update(fields)
            self.state.save()

    # --- alarms and the report ---------------------------------------------------------------

    def alarms(self) -> list[str]:
        """Eval τ vs the training run's own τ metric at the same step, for the newest point."""
        from .trainlog import value_at

        ratio, tag = self.opts.alarm_ratio, self.run.tau_metric
        series = self.train_series.get(tag) if tag else None
        done = self.state.done_points()
        if not ratio or not series or not done:
            return []
        p = done[-1]
        train, tau = value_at(series, p.step), p.summary.get("tau_macro")
        if train is None or not tau or train <= 0:
            return []
        if max(train / tau, tau / train) > ratio:
            return [f"ALARM {p.name} (step {p.step}): eval {'expected ' * bool(p.summary.get('measure'))}τ {tau:.3f} vs training {tag} {train:.3f} — "
                    f"{max(train / tau, tau / train):.1f}× apart (limit {ratio:g}×)"]
        return []

    def write_report(self) -> tuple[Path, Path]:
        from .trajectory import write_trajectory

        with self.lock:
            return write_trajectory(self.folder, self.state, self.runs_root, self.train_series,
                                    self.run.tau_metric, self.alarms())

    # --- the command ---------------------------------------------------------------------------

    def watch(self, once: bool, every_s: float, stop: threading.Event | None = None) -> PassResult:
        """One pass (``once``) or passes every ``every_s`` seconds until ``stop``; holds the run's lock."""
        stop = stop or threading.Event()
        settings = {**self.opts.settings.to_dict(), "sglang": self.opts.sglang, "every": self.opts.every,
                    "baseline": self.opts.baseline}
        with RunLock(self.folder, self.run.name):
            self.state = WatchState.open(self.folder, self.run.name, settings)
            self.state.save()
            if self.state.points:
                self.write_report()  # as the state says, whatever stopped the last watch
            while True:
                result = self.run_pass()
                if once or stop.wait(every_s):
                    return result
