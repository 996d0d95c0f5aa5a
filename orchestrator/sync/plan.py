"""What a sync will do: the training run and checkpoint a name means, and per file whether to
send it, resume it from the ``.part`` already there, or skip it (verified on the destination).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Callable

from ..config.catalog import Catalog, CatalogError, TrainingRun, check_name, resolve_checkpoint
from ..config.inventory import Host
from .tool import SyncError


@dataclass
class FilePlan:
    path: str
    size: int
    mtime_ns: int
    sha256: str | None  # known on the source (cached manifest) or None: hashed in flight
    offset: int = 0
    action: str = "send"  # send | resume | skip
    ident: tuple = ()  # the source file's (inode, ctime_ns) as the manifest found it

    def changed(self, host: str) -> str:
        """What the user reads when the file changed on the training host while it was sent."""
        return (f"{self.path} changed on {host} while it was sent; it will be sent again: run the same command "
                f"again (once training has finished writing it)")

    @property
    def to_move(self) -> int:
        return 0 if self.action == "skip" else self.size - self.offset


@dataclass
class SyncPlan:
    run: str
    checkpoint: str
    src: Host
    dst: Host
    src_dir: str
    dst_rundir: str
    files: list[FilePlan] = field(default_factory=list)
    up_to_date: bool = False
    final_exists: bool = False
    free_bytes: int | None = None
    incomplete: str | None = None  # dry run: why the checkpoint is not complete yet (sync/complete.py)
    excluded: list[dict] = field(default_factory=list)  # the source's names not sent (path, why)

    @property
    def dst_final(self) -> str:
        return str(PurePosixPath(self.dst_rundir) / self.checkpoint)

    @property
    def total(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def to_move(self) -> int:
        return 0 if self.up_to_date else sum(f.to_move for f in self.files)


@dataclass
class SyncResult:
    plan: SyncPlan
    bytes_moved: int = 0
    seconds: float = 0.0
    verified: int = 0
    skipped: int = 0
    resent: list[str] = field(default_factory=list)
    dry_run: bool = False
    path: str = ""  # how the bytes moved: relay, tunnel or direct ("" when none moved)
    copy_digest: str | None = None  # the copy this sync put in place (None: it found one up to date)

    @property
    def rate(self) -> float:
        return self.bytes_moved / self.seconds if self.seconds > 0 else 0.0


def make_plan(plan: SyncPlan, src_files: list[dict], st: dict) -> None:
    plan.free_bytes = st.get("free_bytes")
    verified, parts = st.get("verified") or {}, st.get("parts") or {}
    for e in src_files:
        f = FilePlan(e["path"], e["size"], e["mtime_ns"], e.get("sha256"), ident=(e.get("ino"), e.get("ctime_ns")))
        v = verified.get(f.path)
        if v and v.get("size") == f.size and v.get("mtime_ns") == f.mtime_ns and \
                (f.sha256 is None or v.get("sha256") == f.sha256):
            f.action, f.offset, f.sha256 = "skip", f.size, v["sha256"]
        elif 0 < parts.get(f.path, 0) <= f.size:
            f.action, f.offset = "resume", parts[f.path]
        plan.files.append(f)


def same_manifest(a: list[dict] | None, b: list[dict]) -> bool:
    if not a:
        return False
    key = lambda e: (e["path"], e["size"], e.get("sha256"))  # noqa: E731
    return sorted(map(key, a)) == sorted(map(key, b))

def dest_rundir(dst: Host, run: TrainingRun) -> str:
    if not dst.checkpoints:
        raise SyncError(f"host {dst.name} has no `checkpoints` root in the inventory")
    return str(PurePosixPath(dst.checkpoints) / run.name)


def newest_run(listing: dict) -> str | None:
    """The training run whose newest checkpoint is the newest of all (a tool ``list`` answer)."""
    best, when = None, -1.0
    for name, info in listing.items():
        for c in info["checkpoints"]:
            if c["mtime"] > when:
                best, when = name, c["mtime"]
    return best


def pick_run(catalog: Catalog, run: str | None,
             listing_fn: Callable[[list[TrainingRun]], dict]) -> tuple[TrainingRun, dict]:
    """The named training run (default: the one with the newest checkpoint) and its listing."""
    if run:
        r = catalog.run(run)
        return r, listing_fn([r])[r.name]
    if not catalog.runs:
        raise catalog.no_runs()
    listing = listing_fn(list(catalog.runs.values()))
    name = newest_run(listing) or next(iter(catalog.runs))
    return catalog.runs[name], listing[name]


def resolve_name(name: str, r: TrainingRun, info: dict, src: Host) -> str:
    """The checkpoint folder ``name`` means in the run's listing on the training host."""
    folders = [c["name"] for c in info["checkpoints"]]
    if name in ("latest", "newest"):
        stepped = [c for c in info["checkpoints"] if c["step"] is not None]
        if not stepped:
            raise CatalogError(f"run {r.name} has no checkpoints on {src.name} ({info['dir']})")
        return max(stepped, key=lambda c: c["step"])["name"]
    if not info.get("exists", True):
        check_name(name)
        raise CatalogError(f"run {r.name}: folder {info['dir']} does not exist on host {src.name}")
    return resolve_checkpoint(name, r, folders)
