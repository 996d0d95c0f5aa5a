"""`dflash-ops clean`: what the hosts' workdirs, the eval hosts' checkpoint copies and this machine's
runs folder hold that dflash-ops made and no run needs any more, and its removal.

Reclaimable, each with the reason it is shown with:

* on a host, a worker code folder (``<workdir>/code/<digest>``, its pre-flight cache inside) that a
  ship installed (marked complete), that is not the worker this dflash-ops ships, that no run folder
  kept on the host was started from (its ``cmd.json``), that no live run here and no live lease there
  names, and that was not shipped or used in the last hour;
* on a host, the run folder (``<workdir>/runs/<id>``) of a run that is ``done`` here with every
  shard of that host fetched (its files here read back whole): a failed or cancelled run keeps its
  folder (``eval --resume`` continues from it), and a folder no run here knows is another runs
  folder's;
* on an eval host (not also a training host), a checkpoint copy (``<checkpoints>/<run>/<ckpt>``)
  that a sync made there (its record names that very folder and its manifest: one copied in by
  hand is never a candidate), that the training host no longer has by positive evidence (it
  answered, and the run's folder there holds checkpoints: a missing, empty or unreadable one proves
  nothing), and that nothing uses, links resolved on the host: no catalog drafter (``path``,
  ``default``), no unfinished point of a `watch`, no live run here, no live lease of a run started
  from any machine (remote/host/clean.py: from before its pre-flight until its jobs there end, a
  queued Slurm task included), no running job there, no sync of it;
* here, a run folder claimed by an eval that was stopped in its pre-flight (nothing in it but its
  locks, unlocked, claimed over an hour ago).

A job running on a host keeps its run folder and its code folder whatever this machine knows. The
host side scans without following links and removes only what it is given, one item at a time as
this machine sends them (an interrupt here stops the removal after the item at hand), each under
the lease lock eval takes to write a lease and, for a copy, the sync's checkpoint lock, checking
again at that moment that nothing uses it.
"""
from __future__ import annotations

import json
import os
import posixpath
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from remote.contract.locks import held
from remote.contract.states import State

from .config.catalog import Catalog, same_checkpoint, split_label
from .config.inventory import Host, Inventory, InventoryError
from .errors import DflashOpsError
from .eval.jobs import CODE_DIR, LOGS, log_removed, partial_log
from .eval.lease import host_tool
from .runs.folders import RunList, RunError, load_runs
from .runs.record import LOCK_FILE, RESUME_LOCK, RunRecord
from .transport import TransportError, runner_for

HERE = "here"
GRACE = 3600.0          # s: a code folder shipped or used, a claimed run folder, more recently is kept
CLAIM_FILES = {LOCK_FILE, RESUME_LOCK}
FINISHED_POINTS = {"done", "gave_up", "gone", "superseded"}     # a watch point whose checkpoint it needs no more
_RUN_ID = re.compile(r"\d{8}-\d{6}-")       # runs/record.py's run_id: a claimed folder's name


@dataclass
class Item:
    """One thing clean would remove: ``rel`` under ``root`` on a host (``op``: remote/host/clean.py's
    kind), or the folder ``path`` here."""
    kind: str
    path: str
    size: int
    why: str
    op: str = ""
    root: str = ""
    rel: str = ""
    check: dict = field(default_factory=dict, repr=False)    # a copy's: what the host checks again (judge item)
    run: object = field(default=None, repr=False)            # a run folder's: the run here (its fetched logs)

    @property
    def shown(self) -> str:
        """The path under its place's root (:attr:`Place.roots`)."""
        return self.rel or Path(self.path).name


@dataclass
class Place:
    """A host (or here, :data:`HERE`): what would go, what was kept and why, or why it was skipped."""
    name: str
    items: list[Item] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: str | None = None
    host: Host | None = None        # its paths expanded there
    runner: object = None
    named: bool = False             # asked for by --host: a skip is a failure
    deleted: "Deleted | None" = None     # what a removal interrupted had done

    @property
    def size(self) -> int:
        return sum(i.size for i in self.items)

    @property
    def roots(self) -> str:
        """Where its items' paths start: ``workdir W``, ``checkpoints C``, ``runs folder R``."""
        if self.name == HERE:
            return f"runs folder {self.items[0].path.rpartition('/')[0]}" if self.items else ""
        ops = {i.op for i in self.items}
        return ", ".join(f"{what} {root}" for what, root, op in (
            ("workdir", self.host.workdir, {"run", "code"}), ("checkpoints", self.host.checkpoints, {"ckpt"}))
            if ops & op)


@dataclass
class Deleted:
    place: str
    freed: int = 0
    removed: int = 0
    failed: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)       # not tried: the removal was interrupted before them
    at_hand: str | None = None      # being removed when the removal was interrupted: maybe gone, maybe not


def _norm(path: str | None) -> str | None:
    return posixpath.normpath(path) if path else None


def live(record: RunRecord) -> bool:
    """Does the run still need its hosts' folders and code: running or preparing, or a shard not fetched?"""
    return not record.status.is_terminal() or any(not s.fetched for s in record.shards)


class Survey:
    """What every place is judged against: the runs here, the catalog, the watches, the worker this
    dflash-ops ships, the training host's listing (asked once, on first need)."""

    def __init__(self, inventory: Inventory, catalog: Catalog, runs_root: Path):
        from .eval.ship import bundle

        self.inventory, self.catalog, self.runs_root = inventory, catalog, Path(runs_root)
        self.runs: RunList = load_runs(self.runs_root)
        self.records = {r.id: r for r in self.runs if r.record is not None}
        self.current = bundle()[0]
        self._listing_lock = threading.Lock()
        self._listing: tuple[Host, dict] | str | None = None

    def live_shards(self, host: str):
        return [s for r in self.records.values() if live(r.record) for s in r.record.shards if s.host == host]

    def live_run_paths(self, host: Host) -> list[tuple[str, str]]:
        """(drafter folder on ``host``, who) of the live runs here that have a shard there."""
        out = []
        for r in self.records.values():
            req = r.record.request
            if not live(r.record) or host.name not in r.record.hosts:
                continue
            paths = {s.drafter_path for s in r.record.shards if s.host == host.name and s.drafter_path}
            if req.drafter_run and req.checkpoint and host.checkpoints:
                paths.add(f"{host.checkpoints.rstrip('/')}/{req.drafter_run}/{req.checkpoint}")
            out += [(p, f"run {r.id} here ({r.record.status})") for p in sorted(paths)]
        return out

    def reclaimable_run(self, rid: str, host: str, workdir: str) -> str | None:
        """Why run ``rid``'s folder on ``host`` may go (done, fetched, its files here whole), else None."""
        run = self.records.get(rid)
        if run is None or run.record.status != State.DONE:
            return None
        shards = [s for s in run.record.shards if s.host == host]
        if not shards or not all(s.fetched and s.state == State.DONE and
                                 (s.run_dir == f"{workdir}/runs/{rid}" or s.run_dir.startswith(f"{workdir}/runs/{rid}/"))
                                 for s in shards):
            return None
        try:
            run.check()
            whole = run.summary is not None and run.results
        except RunError:
            return None
        if not whole:
            return None
        partial = [where for s in shards for log in self.logs(run, s) if (where := partial_log(log))]
        return "the run is done; its files are fetched here" + (
            f" (its log{'s' if len(partial) > 1 else ''} only in part: the whole "
            f"{'ones exist' if len(partial) > 1 else 'one exists'} only there, {', '.join(partial)})" if partial else "")

    @staticmethod
    def logs(run, shard) -> list[Path]:
        """The logs of ``shard`` of ``run`` fetched here."""
        return [shard.local_dir(run.path) / name for name in LOGS]

    def watched(self, run: str) -> tuple[set[str], str | None]:
        """The checkpoints a `watch` of training run ``run`` has not finished with, or why it cannot tell."""
        from .watch.state import WatchState, WatchStateError

        folder = self.runs_root / f"watch-{run}"
        try:
            state = WatchState.open(folder, run, {})
        except WatchStateError as e:
            return set(), str(e)
        return {p.name for p in state.points.values() if p.status not in FINISHED_POINTS}, None

    def source_listing(self) -> tuple[Host, dict] | str:
        """The training host and its listing of the catalog's training runs, or why there is none."""
        from .sync.listing import host_checkpoints

        with self._listing_lock:
            if self._listing is None:
                trains = [h.name for h in self.inventory.with_role("train")]
                try:
                    src = self.inventory.pick("train")
                except InventoryError:
                    self._listing = (f"the inventory has {len(trains)} training hosts ({', '.join(trains) or 'none'}); "
                                     f"copies are judged against one")
                    return self._listing
                try:
                    src.refuse_example()
                    with runner_for(src, self.inventory) as srun:
                        src = src.on_host(srun.expand_home)
                        runs = list(self.catalog.runs.values())
                        self._listing = src, host_checkpoints(srun, src, runs, lambda r: r.source_dir(src.checkpoints))
                except DflashOpsError as e:
                    self._listing = f"the training host cannot be listed ({e})"
            return self._listing


# ----------------------------------------------------------------------------- here

def plan_here(survey: Survey, now: float | None = None) -> Place:
    """This machine's runs folder: run folders claimed by an eval stopped in its pre-flight."""
    place, now = Place(HERE), time.time() if now is None else now
    try:
        entries = list(os.scandir(survey.runs_root))
    except OSError:
        return place
    for e in sorted(entries, key=lambda e: e.name):
        if not e.is_dir(follow_symlinks=False):
            continue
        try:
            names = set(os.listdir(e.path))
            age = now - e.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue
        if _RUN_ID.match(e.name) and names <= CLAIM_FILES and age > GRACE and not _locked(Path(e.path), names):
            place.items.append(Item("empty run folder", e.path, 0, f"claimed {_ago(age)} ago, never written: an eval "
                                                                   f"stopped in its pre-flight"))
    return place


def _locked(folder: Path, names: set[str]) -> bool:
    return any(held(folder / name, follow=False) for name in names)


def _ago(seconds: float) -> str:
    return f"{seconds / 86400:.0f} d" if seconds >= 2 * 86400 else f"{seconds / 3600:.0f} h" \
        if seconds >= 7200 else f"{seconds / 60:.0f} min"


def delete_here(place: Place) -> Deleted:
    """Remove the claimed folders (checked again: nothing but unlocked locks in a real folder)."""
    out = Deleted(place.name)
    for item in place.items:
        folder = Path(item.path)
        try:
            if folder.is_symlink() or not folder.is_dir():
                raise OSError(f"{folder} is not a folder any more")
            names = set(os.listdir(folder))
            if not names <= CLAIM_FILES or _locked(folder, names):
                raise OSError(f"{folder} is in use now")
            for name in names:
                (folder / name).unlink(missing_ok=True)
            folder.rmdir()
            out.removed += 1
        except OSError as e:
            out.failed.append(f"{item.path}: {e.strerror or e}")
    return out


# ----------------------------------------------------------------------------- hosts

def plan_host(survey: Survey, host: Host, named: bool = False) -> Place:
    """One host's reclaimable folders; an unreachable host is skipped, saying why."""
    place = Place(host.name, host=host, named=named)
    if host.example:
        place.skipped = "an example host (`example: true`), never connected to" if named else ""
        return place
    if host.is_ray:
        place.skipped = "a Ray cluster: its workers' folders are on its nodes, not cleaned from here"
        return place
    try:
        runner = place.runner = runner_for(host, survey.inventory)
        host = place.host = host.on_host(runner.expand_home)
        if host.workdir:
            _plan_workdir(survey, place, runner, host)
    except DflashOpsError as e:
        place.skipped, place.items, place.notes = str(e), [], []
        return place
    if "eval" in host.roles and "train" not in host.roles and host.checkpoints and survey.catalog.runs:
        try:
            _plan_copies(survey, place, runner, host)
        except DflashOpsError as e:
            place.notes.append(f"checkpoint copies not judged: {e}")
    return place


def _scan(runner, host: Host, *args: str, timeout: float = 600):
    res = runner.run([host.python, "-c", host_tool(), *args], timeout=timeout)
    if not res.ok:
        tail = (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1]
        raise TransportError(f"{host.python} -c remote/host/clean.py {args[0]} failed: {tail}")
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise TransportError(f"{host.python} -c remote/host/clean.py {args[0]} printed no JSON") from None


def _plan_workdir(survey: Survey, place: Place, runner, host: Host) -> None:
    workdir = host.workdir.rstrip("/")
    found = _scan(runner, host, "scan", workdir)
    now = found.get("now") or time.time()
    place.notes += [f"not judged: {p}" for p in found.get("problems") or []]
    kept_code, unknown, resumable, live_runs, not_whole = set(), 0, 0, 0, 0
    for entry in sorted(found["runs"], key=lambda e: e["name"]):
        rid = entry["name"]
        running = any(j["running"] for j in entry["jobs"])
        why = None if running else survey.reclaimable_run(rid, host.name, workdir)
        if why:
            link = "; a link in place of the folder: removed as a link" if entry["kind"] == "link" else ""
            place.items.append(Item("run folder", f"{workdir}/runs/{rid}", entry["size"], f"{why}{link}",
                                    "run", workdir, f"runs/{rid}", run=survey.records[rid]))
            continue
        for j in entry["jobs"]:
            kept_code.add(j["code"])
            if j["cwd"] and posixpath.dirname(_norm(j["cwd"])) == f"{workdir}/code":
                kept_code.add(posixpath.basename(_norm(j["cwd"])))
        run = survey.records.get(rid)
        kept_code.update(posixpath.basename(_norm(s.code_dir)) for s in (run.record.shards if run else [])
                         if s.host == host.name and s.code_dir)
        if running or (run is not None and live(run.record)):
            live_runs += 1
        elif run is None:
            unknown += 1
        elif run.record.status == State.DONE:
            not_whole += 1
        else:
            resumable += 1
    for s in survey.live_shards(host.name):
        if s.code_dir and posixpath.dirname(_norm(s.code_dir)) == f"{workdir}/code":
            kept_code.add(posixpath.basename(_norm(s.code_dir)))
    leased = {le["code"]: le for le in found.get("leases") or [] if le.get("code")}
    if any(le.get("paths") is None for le in found.get("leases") or []):
        leased = {e["name"]: {"run": "?", "why": "an unreadable lease"} for e in found["code"]}
    recent = 0
    for entry in sorted(found["code"], key=lambda e: e["name"]):
        name = entry["name"]
        if not CODE_DIR.fullmatch(name) or name == survey.current or name in kept_code or not entry.get("shipped"):
            continue
        if name in leased:
            place.notes.append(f"kept worker code {workdir}/code/{name}: run {leased[name]['run']} uses it "
                               f"({leased[name]['why']})")
            continue
        if now - entry["mtime"] < GRACE:
            recent += 1
            continue
        link = "; a link in place of the folder: removed as a link" if entry["kind"] == "link" else ""
        place.items.append(Item("worker code", f"{workdir}/code/{name}", entry["size"],
                                f"an older worker with its pre-flight cache (this dflash-ops ships {survey.current}); no "
                                f"run kept there uses it{link}",
                                "code", workdir, f"code/{name}"))
    kept = [f"{n} {what}" for n, what in (
        (live_runs, "run folder(s) of live runs (running, preparing or not fetched)"),
        (resumable, "run folder(s) of failed or cancelled runs (`eval --resume` continues from them)"),
        (not_whole, "run folder(s) of done runs whose files here are not whole (`attach` fetches them again)"),
        (unknown, f"run folder(s) no run in {survey.runs_root} knows (another runs folder's, or removed here)"),
        (recent, "older worker code folder(s) shipped or used in the last hour")) if n]
    if kept:
        place.notes.append("kept: " + "; ".join(kept))


def _plan_copies(survey: Survey, place: Place, runner, host: Host) -> None:
    from .sync.listing import host_checkpoints
    from .sync.plan import dest_rundir

    source = survey.source_listing()
    if isinstance(source, str):
        place.notes.append(f"checkpoint copies not judged: {source}")
        return
    src, listing = source
    if src.name == host.name:
        return
    runs = list(survey.catalog.runs.values())
    there = host_checkpoints(runner, host, runs, lambda r: dest_rundir(host, r))
    default_base, default_ckpt = split_label(survey.catalog.default) if survey.catalog.default else (None, None)
    keep = [(runner.absolute(d.path), f"catalog drafter {d.label}") for d in survey.catalog.drafters.values()
            if d.path] + survey.live_run_paths(host)
    candidates = []
    for r in runs:
        rundir = dest_rundir(host, r).rstrip("/")
        copies = there.get(r.name, {}).get("checkpoints", [])
        unknown = _no_evidence(listing.get(r.name) or {}, src.name)
        if unknown:
            if copies:
                place.notes.append(f"copies of run {r.name} not judged (kept): {unknown}")
            continue
        have = {c["name"] for c in listing[r.name]["checkpoints"]}
        watched, watch_problem = survey.watched(r.name)
        run_keep = [(f"{rundir}/{n}", f"watch {r.name}") for n in sorted(watched)]
        if watch_problem:
            run_keep.append((rundir, f"maybe watch {r.name} ({watch_problem})"))
        if default_ckpt and survey.catalog.drafters.get(default_base) and \
                survey.catalog.drafters[default_base].run == r.name:
            run_keep += [(f"{rundir}/{c['name']}", f"the catalog's default ({survey.catalog.default})")
                         for c in copies if same_checkpoint(default_ckpt, c["name"], r.step_of(c["name"]))]
        hand = []
        for c in sorted(copies, key=lambda c: (c["step"] or -1, c["name"])):
            if c["name"] in have:
                continue
            if not c.get("synced"):
                hand.append(c["name"])
                continue
            path = f"{rundir}/{c['name']}"
            candidates.append((r, c, path, {"ino": c.get("ino"), "lock": c.get("lock"), "keep": keep + run_keep}))
        if hand:
            place.notes.append(f"kept {len(hand)} folder(s) of {rundir} that {src.name} does not have and no sync "
                               f"made here (placed by hand, or copied): {', '.join(hand)}")
    if not candidates:
        return
    root = host.checkpoints.rstrip("/")
    judged = _scan(runner, host, "judge", (host.workdir or "").rstrip("/"), root,
                   json.dumps([{**check, "rel": posixpath.relpath(path, root)} for _, _, path, check in candidates]))
    for (r, c, path, check), verdict in zip(candidates, judged):
        if verdict["users"]:
            place.notes.append(f"kept {path} (not on {src.name} any more): used by {'; '.join(verdict['users'])}")
            continue
        if not verdict["same"]:
            place.notes.append(f"kept {path}: it changed while it was judged")
            continue
        place.items.append(Item("checkpoint copy", path, c["size"],
                                f"a sync made it; {src.name} no longer has {r.name}/{c['name']}; nothing uses it",
                                "ckpt", root, posixpath.relpath(path, root), check=check))


def _no_evidence(src_info: dict, src: str) -> str | None:
    """Why the training host's listing of a run proves nothing about which checkpoints it dropped
    (None when it does: the run's folder is there, readable, and holds checkpoints)."""
    where = f"{src_info.get('dir')} on {src}"
    if not src_info:
        return f"{src} did not list it"
    if not src_info.get("exists", True):
        return f"{where} does not exist"
    if src_info.get("unreadable"):
        return f"{where} cannot be read ({src_info['unreadable']})"
    if not any(c.get("files") for c in src_info.get("checkpoints") or []):
        return f"{where} holds no checkpoint (an unmounted volume, a restarted run?)"
    return None


def delete_host(place: Place) -> Deleted:
    """Send the host's items one at a time, each removed (or refused, saying why) before the next
    goes. An interrupt stops sending (the host ends with its input, after the item at hand) and is
    raised again with :attr:`Place.deleted` saying what was removed, what not, and what was at hand."""
    out = place.deleted = Deleted(place.name)
    host = place.host
    try:
        handle = place.runner.open_exec([host.python, "-c", host_tool(), "delete", (host.workdir or "").rstrip("/")])
    except DflashOpsError as e:
        out.failed.append(str(e))
        return out
    done = 0
    try:
        for item in place.items:
            handle.stdin.write((json.dumps([item.op, item.root, item.rel, item.check]) + "\n").encode())
            handle.stdin.flush()
            out.at_hand = item.path
            line = handle.stdout.readline()
            out.at_hand = None
            done += 1
            if not line:
                err = handle.stderr.read().decode(errors="replace").strip().splitlines()
                out.failed.append(f"{item.path}: the removal on {place.name} ended early"
                                  + (f": {err[-1]}" if err else ""))
                break
            res = json.loads(line)
            if res.get("ok"):
                out.removed += 1
                out.freed += item.size
                if item.op == "run" and item.run is not None:
                    for shard in item.run.record.shards:
                        for log in Survey.logs(item.run, shard):
                            log_removed(log, time.strftime("%Y-%m-%d %H:%M"))
            else:
                out.failed.append(f"{item.path}: {res.get('why')}")
        handle.stdin.close()
        handle.wait(60)
    finally:
        out.left = [i.path for i in place.items[done:] if i.path != out.at_hand]
        handle.close()
    return out


# ----------------------------------------------------------------------------- the whole

def plan(inventory: Inventory, catalog: Catalog, runs_root: Path, hosts: list[Host], named: bool) -> list[Place]:
    """Every host of ``hosts`` (side by side), then here."""
    survey = Survey(inventory, catalog, runs_root)
    places = []
    with ThreadPoolExecutor(max_workers=max(1, len(hosts))) as pool:
        places = list(pool.map(lambda h: plan_host(survey, h, named), hosts))
    return places + [plan_here(survey)]


def delete(place: Place) -> Deleted:
    if place.name == HERE:
        place.deleted = delete_here(place)
        return place.deleted
    return delete_host(place)


def close(places: list[Place]) -> None:
    for p in places:
        if p.runner is not None:
            try:
                p.runner.close()
            except Exception:  # noqa: BLE001 — closing a connection that is gone
                pass
