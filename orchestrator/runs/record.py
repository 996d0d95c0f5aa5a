"""``runs/<id>/run.json``: an eval run's record, and the one owner of its state.

Everything that changes a run's state is a method here; the eval flow (evaluate.py) and the
commands (eval, attach, cancel) call them and never set fields themselves. From the start of
the workers on, each transition writes run.json (atomically), so an interrupted command leaves
a record another can pick up; a run whose pre-flight failed leaves nothing.

Run status:   preparing -> running -> done | failed | cancelled
              (running stays running when the user detaches or contact is lost: `attach`; a
              cancel stays: a save or settle of a record read before it keeps the run cancelled)
Shard state:  pending -> running -> the worker's exit state (done, failed, ...) | cancelled;
              ``fetched`` once its files are back here.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from itertools import count
from pathlib import Path

from ..config.catalog import parse_step, step_name
from ..errors import InputError

RUN_FILE = "run.json"
LOCK_FILE = ".lock"
RESUME_LOCK = ".resume.lock"


class RunRecordError(InputError):
    """A run.json that cannot be read as a run record (the message names the file)."""


@dataclass
class EvalRequest:
    """What the user asked for, with every name resolved (kept in run.json so `eval --resume`
    repeats it without the catalog): the drafter is ``drafter_path`` on every host, or checkpoint
    folder ``checkpoint`` of training run ``drafter_run`` under each host's ``checkpoints`` root,
    or the embedded demo; the target is ``target_path`` (or the embedded demo's)."""
    hosts: list[str]
    drafter: str | None = None      # what it resolved to, as a user would type it (v5:step_20000)
    target: str | None = None       # the target's label (catalog), `embedded`, or its folder
    suite: str = "default"
    prompts: int | None = 2
    mode: str = "offline"
    max_new_tokens: int = 256
    max_blocks: int | None = None
    device: str | None = None
    dtype: str | None = None
    sglang: str = "auto"            # auto (the host's, offline mode) | off | URL
    thinking: str = "off"           # off | on | default (the chat template's own); the worker's default
    ddtree_budgets: str | None = None   # None: the worker's default (8,16,32,64 greedy, none at T > 0)
    temperature: float = 0.0        # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    all_anchors: bool = False
    min_free_gb: float = 1.0
    verify_weights: bool = False    # sha256 of the weights vs the sync manifest (slow on 17 GB)
    drafter_path: str | None = None
    drafter_run: str | None = None
    checkpoint: str | None = None
    target_path: str | None = None
    gpus: str | None = None         # --gpus all|N|0,2,5: one shard per GPU of each host (placement.py)
    target_devices: str | None = None   # N | auto: GPUs one worker splits the target over
    max_memory_gb: float | None = None  # per device, for the memory plan and the device_map


@dataclass
class Shard:
    """One worker's part of a run (``--shard index/count`` of the prompts): a host, or one GPU of it."""
    host: str
    index: int
    count: int
    gpu: str | None = None          # its worker's CUDA_VISIBLE_DEVICES, "0" or "0,1" (a label only on CPU)
    run_dir: str = ""               # on the host: <workdir>/runs/<run id>[/shard-<index>]
    code_dir: str = ""
    python: str = ""
    drafter_path: str = ""
    target_path: str = ""
    fetched: bool = False
    state: str = "pending"
    exit_code: int | None = None
    why: str | None = None          # the host's reason for that state (a full disk, a lost job), if any
    ray: dict | None = None         # a Ray host's shard: its actor, job, node (backends/ray.py)

    @property
    def label(self) -> str:
        """``host`` or ``host:gpuN``: how progress and errors name the shard."""
        return self.host if self.gpu is None else f"{self.host}:gpu{self.gpu}"

    def local_dir(self, run_dir: Path) -> Path:
        """Where its files land here."""
        return run_dir if self.count == 1 else run_dir / f"shard-{self.index}"


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


_TYPES = {"str": str, "int": int, "float": (int, float), "bool": bool, "dict": dict, "list": list}


def _of_type(value, annotation: str) -> bool:
    """Does a JSON value fit a field annotation (``int | None``, ``list[str]``, ``list[Shard]``)?"""
    for kind in (a.strip() for a in annotation.split("|")):
        if kind == "None":
            if value is None:
                return True
            continue
        base, _, item = kind.partition("[")
        want = _TYPES.get(base)
        if want is None or not isinstance(value, want) or (isinstance(value, bool) and base != "bool"):
            continue
        if base == "list" and item:
            item = item.rstrip("]")
            if not all(_of_type(v, item) if item in _TYPES else isinstance(v, dict) for v in value):
                continue
        return True
    return False


def check_types(cls, raw, where: str) -> None:
    """Refuse a run.json object whose fields are not those of ``cls`` with their types: a run
    folder is input like any other (it may come from another machine), never trusted blindly."""
    if not isinstance(raw, dict):
        raise TypeError(f"'{where.rstrip('.') or 'run.json'}' is not a JSON object")
    for f in fields(cls):
        if f.name in raw and f.name != "folder" and not _of_type(raw[f.name], str(f.type)):
            shown = json.dumps(raw[f.name])
            raise TypeError(f"field '{where}{f.name}' must be {f.type}, not {shown if len(shown) <= 40 else shown[:37] + '...'}")


def claim_run_folder(runs_dir: Path, rid: str) -> str:
    """``rid``, else ``rid-2``, ``rid-3``, ...: the first id whose folder under ``runs_dir`` this
    call creates itself (an atomic mkdir), so two evals started in the same second never share one."""
    Path(runs_dir).mkdir(parents=True, exist_ok=True)
    for n in count(1):
        candidate = rid if n == 1 else f"{rid}-{n}"
        try:
            (Path(runs_dir) / candidate).mkdir()
            return candidate
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def write_atomic(path: Path, text: str) -> None:
    """``path`` replaced by ``text`` at once, through a temporary file of its own (concurrent
    writers never share one)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def run_id(drafter: str, checkpoint: str | None, host: str, when: datetime | None = None) -> str:
    """``20261202-210130-v5-step20k-ct129`` (the checkpoint as its short step name)."""
    when = when or datetime.now()
    step = parse_step(checkpoint) if checkpoint else None
    parts = [when.strftime("%Y%m%d-%H%M%S"), drafter, step_name(step) if step is not None else checkpoint or "", host]
    return "-".join(re.sub(r"[^A-Za-z0-9._-]+", "_", p).strip("_") for p in parts if p)


@dataclass
class RunRecord:
    """Everything needed to follow, resume, cancel and report a run."""
    id: str
    drafter: str
    checkpoint: str | None
    target: str
    suite: str
    host: str
    mode: str
    prompts: int | None
    created_at: str
    status: str
    request: dict
    shards: list[Shard] = field(default_factory=list)
    step: int | None = None         # the checkpoint's training step (``checkpoint`` is its folder)
    cancels: int = 0                # times `cancel` stopped it (a resume that started meanwhile sees it)
    folder: Path | None = field(default=None, repr=False, compare=False)   # runs/<id>, not saved

    # --- creating, reading, writing ------------------------------------------------------------

    @classmethod
    def create(cls, runs_dir: Path, request: EvalRequest, label: str, checkpoint: str | None,
               step: int | None = None) -> "RunRecord":
        """A new run of drafter ``label`` at checkpoint folder ``checkpoint`` (training ``step``)."""
        hosts = request.hosts
        rid = claim_run_folder(Path(runs_dir), run_id(label, checkpoint, "+".join(hosts)))
        record = cls(id=rid, drafter=label, checkpoint=checkpoint, step=step, target=request.target or "default",
                     suite=request.suite, host=",".join(hosts), mode=request.mode, prompts=request.prompts,
                     created_at=now_iso(), status="preparing", request=asdict(request),
                     shards=[Shard(host=h, index=i, count=len(hosts)) for i, h in enumerate(hosts)],
                     folder=Path(runs_dir) / rid)
        return record

    @classmethod
    def load(cls, run_dir: Path) -> "RunRecord":
        path = Path(run_dir) / RUN_FILE
        try:
            raw = json.loads(path.read_bytes().decode("utf-8"))
            if not isinstance(raw, dict):
                raise TypeError(f"a JSON object was expected, not {type(raw).__name__}")
            check_types(cls, raw, "")
            for i, s in enumerate(raw.get("shards", [])):
                check_types(Shard, s, f"shards[{i}].")
            check_types(EvalRequest, raw.get("request", {}), "request.")
            raw["shards"] = [Shard(**s) for s in raw.get("shards", [])]
            record = cls(**raw, folder=Path(run_dir))
            record.eval_request
            if any(s.index != i or s.count != len(record.shards) for i, s in enumerate(record.shards)):
                raise ValueError("'shards' are not numbered 0..n-1 with count n")
        except OSError as e:
            raise RunRecordError(f"{path}: cannot read the run record: {e.strerror or e}") from None
        except (ValueError, TypeError) as e:   # JSON, UTF-8, missing, unknown or mistyped fields
            raise RunRecordError(f"{path}: not a valid run record ({e}); the run cannot be followed, cancelled "
                                 f"or resumed from it") from None
        return record

    def refresh(self) -> None:
        """Read run.json again: another command (cancel, a resume) may have moved the run on."""
        fresh = RunRecord.load(self.folder)
        for f in fields(self):
            if f.name != "folder":
                setattr(self, f.name, getattr(fresh, f.name))

    @contextmanager
    def lock(self, name: str = LOCK_FILE):
        """The run's own lock (``runs/<id>/.lock``): `cancel` and the start of workers never
        interleave, so a cancel either comes first (and the start sees it) or finds the workers
        started and stops them. ``RESUME_LOCK`` is held by `eval --resume` from its pre-flight on."""
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.folder / name, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def being_resumed(self) -> bool:
        """Is an `eval --resume` of this run preparing it right now (holding ``RESUME_LOCK``)?"""
        try:
            fd = os.open(self.folder / RESUME_LOCK, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def cancelled_meanwhile(self) -> bool:
        """Was the run cancelled after this record was read (run.json on disk says so)?"""
        if not (self.folder / RUN_FILE).exists():
            return False
        return RunRecord.load(self.folder).cancels > self.cancels

    def _adopt_cancel(self) -> None:
        """A `cancel` that came after this record was read stays: the run is cancelled."""
        try:
            if self.cancelled_meanwhile():
                self.cancels, self.status = RunRecord.load(self.folder).cancels, "cancelled"
        except RunRecordError:
            pass

    @property
    def eval_request(self) -> EvalRequest:
        return EvalRequest(**self.request)

    def save(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._adopt_cancel()
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "folder"}
        data["shards"] = [asdict(s) for s in self.shards]
        write_atomic(self.folder / RUN_FILE, json.dumps(data, indent=2))

    def abandon(self) -> None:
        """A run that never started (its pre-flight failed) gives its claimed folder back, when
        nothing was written into it."""
        if self.folder is not None and not (self.folder / RUN_FILE).exists():
            try:
                (self.folder / LOCK_FILE).unlink(missing_ok=True)
                self.folder.rmdir()
            except OSError:
                pass

    # --- transitions ---------------------------------------------------------------------------

    def place(self, placements: list[tuple[str, str | None]]) -> None:
        """Pre-flight resolved ``--gpus``: one shard per (host, GPU id or None)."""
        self.shards = [Shard(host=host, gpu=gpu, index=i, count=len(placements))
                       for i, (host, gpu) in enumerate(placements)]

    def prepared(self, index: int, *, run_dir: str, code_dir: str, python: str, drafter_path: str,
                 target_path: str) -> None:
        """Pre-flight passed on shard ``index``'s host: where its worker runs and what it loads."""
        s = self.shards[index]
        s.run_dir, s.code_dir, s.python = run_dir, code_dir, python
        s.drafter_path, s.target_path = drafter_path, target_path

    def placed(self, index: int, *, gpu: str | None, ray: dict) -> None:
        """A Ray cluster placed shard ``index``: the GPUs Ray assigned it, and its actor's ids."""
        self.shards[index].gpu, self.shards[index].ray = gpu, ray

    def started(self, shards: list[int] | None = None) -> None:
        """The workers of ``shards`` (default: all) were started, fresh or resumed; a resumed run
        keeps its finished shards as they are."""
        for s in self.shards:
            if shards is None or s.index in shards:
                s.fetched, s.state = False, "running"
        self.status = "running"
        self.save()

    def following(self) -> None:
        """`attach`: every shard is followed again and its files fetched again."""
        for s in self.shards:
            s.fetched = False

    def shard_exited(self, index: int, exit_event: dict) -> None:
        """The worker of shard ``index`` ended (its files are about to be fetched)."""
        s = self.shards[index]
        s.state = exit_event.get("state", "unknown")
        s.exit_code = exit_event.get("exit_code")
        s.why = exit_event.get("why")

    def shard_fetched(self, index: int) -> None:
        self.shards[index].fetched = True
        self.save()

    def detached(self) -> None:
        """The user stopped following; the workers keep running."""
        self.save()

    def settle(self) -> str:
        """After following: ``cancelled`` (a `cancel` stopped it meanwhile), ``unfinished`` (some
        shard not fetched: still running), ``failed`` (some worker failed) or ``done``; the status
        follows."""
        self._adopt_cancel()
        if self.status == "cancelled":
            outcome = "cancelled"
        elif not all(s.fetched for s in self.shards):
            self.status, outcome = "running", "unfinished"
        elif any(s.state != "done" for s in self.shards):
            self.status = outcome = "failed"
        else:
            self.status = outcome = "done"
        self.save()
        return outcome

    def cancelled(self, states: dict[int, str]) -> None:
        for index, state in states.items():
            self.shards[index].state = state
        self.status = "cancelled"
        self.cancels += 1
        self.save()
