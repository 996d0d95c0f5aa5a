"""`dflash-ops clean`: what the hosts' workdirs, the eval hosts' checkpoint copies and this machine's
runs folder hold that no run needs any more, and its removal.

Reclaimable, each with the reason it is shown with:

* on a host, a worker code folder (``<workdir>/code/<digest>``, its pre-flight cache inside) that is
  not the worker this dflash-ops ships, that no run folder kept on the host was started from (its
  ``cmd.json``), that no live run here names, and that was not shipped or used in the last hour;
* on a host, the run folder (``<workdir>/runs/<id>``) of a run that is ``done`` here with every
  shard of that host fetched (its files here read back whole): a failed or cancelled run keeps its
  folder (``eval --resume`` continues from it), and a folder no run here knows is another runs
  folder's;
* on an eval host (not also a training host), a checkpoint copy (``<checkpoints>/<run>/<ckpt>``)
  that the training host no longer has, that no catalog drafter (``path``, ``default``), no
  unfinished point of a `watch` and no live run names, and that no running job there loads;
* here, a run folder claimed by an eval that was stopped in its pre-flight (nothing in it but its
  locks, unlocked, claimed over an hour ago).

A job running on a host keeps its run folder and its code folder whatever this machine knows. The
host side (remote/host/clean.py) scans without following links and removes only what it is given,
under the workdir or the checkpoints root, a link as a link, checking again that no job runs there.
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
from importlib import resources
from pathlib import Path

from remote.contract.locks import held
from remote.contract.states import State

from .config.catalog import Catalog, same_checkpoint, split_label
from .config.inventory import Host, Inventory, InventoryError
from .errors import DflashOpsError
from .eval.jobs import CODE_DIR
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
    running_drafters: set = field(default_factory=set)   # the drafter folders of the jobs running there

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


def host_tool() -> str:
    return resources.files("remote.host").joinpath("clean.py").read_text()


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

    def live_run_loads(self, host: str, path: str, run: str, checkpoint: str) -> bool:
        """Does a live run here load checkpoint folder ``path`` (``checkpoint`` of training run ``run``) on ``host``?"""
        for r in self.records.values():
            req = r.record.request
            if live(r.record) and host in r.record.hosts and (
                    any(s.host == host and _norm(s.drafter_path) == path for s in r.record.shards)
                    or (req.drafter_run == run and req.checkpoint == checkpoint)):
                return True
        return False

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
        return "the run is done; its files are fetched here" if whole else None

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
                                    "run", workdir, f"runs/{rid}"))
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
    recent = 0
    for entry in sorted(found["code"], key=lambda e: e["name"]):
        name = entry["name"]
        if not CODE_DIR.fullmatch(name) or name == survey.current or name in kept_code:
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
    place.running_drafters = {_norm(j["drafter"]) for e in found["runs"] for j in e["jobs"]
                              if j["running"] and j["drafter"]}


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
    for r in runs:
        src_info = listing.get(r.name) or {}
        if not src_info.get("exists", True):
            place.notes.append(f"copies of run {r.name} not judged: {src_info.get('dir')} does not exist on {src.name}")
            continue
        have = {c["name"] for c in src_info.get("checkpoints", [])}
        watched, watch_problem = survey.watched(r.name)
        rundir = dest_rundir(host, r).rstrip("/")
        for c in sorted(there.get(r.name, {}).get("checkpoints", []), key=lambda c: (c["step"] or -1, c["name"])):
            name, path = c["name"], f"{rundir}/{c['name']}"
            if name in have:
                continue
            users = [f"catalog drafter {d.label}" for d in survey.catalog.drafters.values()
                     if d.path and _within(_norm(runner.absolute(d.path)), path)]
            if default_ckpt and survey.catalog.drafters.get(default_base) and \
                    survey.catalog.drafters[default_base].run == r.name and \
                    same_checkpoint(default_ckpt, name, r.step_of(name)):
                users.append(f"the catalog's default ({survey.catalog.default})")
            if name in watched:
                users.append(f"watch {r.name}")
            elif watch_problem:
                users.append(f"maybe watch {r.name} ({watch_problem})")
            if survey.live_run_loads(host.name, path, r.name, name):
                users.append("a live run here")
            if any(_within(d, path) for d in place.running_drafters):
                users.append("a job running on the host")
            if users:
                place.notes.append(f"kept {path} (not on {src.name} any more): {', '.join(users)} uses it")
                continue
            place.items.append(Item("checkpoint copy", path, c["size"],
                                    f"{src.name} no longer has {r.name}/{name}; no catalog drafter or watch uses it",
                                    "ckpt", host.checkpoints.rstrip("/"), f"{r.name}/{name}"))


def _within(a: str | None, b: str) -> bool:
    """Is one of the folders ``a`` and ``b`` the other or inside it?"""
    return bool(a) and (a == b or a.startswith(b + "/") or b.startswith(a + "/"))


def delete_host(place: Place) -> Deleted:
    out = Deleted(place.name)
    host = place.host
    items = [[i.op, i.root, i.rel] for i in place.items]
    try:
        results = _scan(place.runner, host, "delete", (host.workdir or "").rstrip("/"), json.dumps(items),
                        timeout=3600)
    except DflashOpsError as e:
        out.failed.append(str(e))
        return out
    for item, res in zip(place.items, results):
        if res.get("ok"):
            out.removed += 1
            out.freed += item.size
        else:
            out.failed.append(f"{item.path}: {res.get('why')}")
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
    return delete_here(place) if place.name == HERE else delete_host(place)


def close(places: list[Place]) -> None:
    for p in places:
        if p.runner is not None:
            try:
                p.runner.close()
            except Exception:  # noqa: BLE001 — closing a connection that is gone
                pass
