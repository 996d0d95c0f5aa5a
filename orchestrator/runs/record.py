"""``runs/<id>/run.json``: an eval run's record, and the one owner of its state.

Everything that changes a run's state is a method here; the eval flow (eval/pipeline.py) and the
commands (eval, attach, cancel) call them and never set fields themselves. From the start of
the workers on, each transition writes run.json (atomically), so an interrupted command leaves
a record another can pick up; a run whose pre-flight failed leaves nothing.

Run status:   preparing -> running -> done | failed | cancelled     (remote/contract/states.py: State)
              (running stays running when the user detaches or contact is lost: `attach`; a
              cancel stays: a save or settle of a record read before it keeps the run cancelled)
Shard state:  pending -> running -> the worker's exit state (done, failed, lost, ...) | cancelled;
              ``fetched`` once its files are back here.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import threading
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from itertools import count
from pathlib import Path

from remote.contract.locks import held
from remote.contract import events, runfiles
from remote.contract.settings import EvalSettings
from remote.contract.states import State

from ..config.catalog import parse_step, step_name
from ..errors import InputError

RUN_FILE = "run.json"
_SAVING = threading.Lock()
LOCK_FILE = ".lock"
RESUME_LOCK = ".resume.lock"


class RunRecordError(InputError):
    """A run.json that cannot be read as a run record (the message names the file)."""


@dataclass
class EvalRequest:
    """What the user asked for, with every name resolved (kept in run.json so `eval --resume`
    repeats it without the catalog): the drafter is ``drafter_path`` on every host, or checkpoint
    folder ``checkpoint`` of training run ``drafter_run`` under each host's ``checkpoints`` root,
    or the embedded demo; the target is ``target_path`` (or the embedded demo's). How the worker
    decodes is ``settings`` (remote/contract/settings.py); the rest is where and how the run is placed."""
    hosts: list[str]
    settings: EvalSettings = field(default_factory=EvalSettings)
    drafter_ref: str | None = None  # what the drafter resolved to, as a user would type it (v5:step_20000)
    target: str | None = None       # the target's label (catalog), `embedded`, or its folder
    sglang: str = "auto"            # reference completions: auto (the host's, offline mode) | off | URL
    gpus: str | None = None         # --gpus all|N|0,2,5: one shard per GPU of each host (eval/placement.py)
    min_free_gb: float = 1.0
    verify_weights: bool = False    # sha256 of the weights vs the sync manifest (slow on 17 GB)
    drafter_path: str | None = None
    drafter_run: str | None = None
    checkpoint: str | None = None
    target_path: str | None = None
    suite_file: str | None = None   # the suite is this machine's file (settings.suite), sent to each host ...
    suite_sha256: str | None = None  # ... with these contents

    def to_dict(self) -> dict:
        return {**asdict(self), "settings": self.settings.to_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> "EvalRequest":
        """From :meth:`to_dict`, or from a flat request (run.json format 1: the settings beside the
        rest, ``drafter`` for ``drafter_ref``, ``ddtree_budgets``, ``max_memory_gb``)."""
        data = dict(data)
        if "settings" not in data:
            flat = {"ddtree_budgets": "ddtree", "max_memory_gb": "max_memory"}
            names = {f.name for f in fields(EvalSettings)}
            settings = {}
            for key in list(data):
                name = flat.get(key, key)
                if name in names:
                    settings[name] = data.pop(key)
            data["settings"] = settings
            if "drafter" in data:
                data["drafter_ref"] = data.pop("drafter")
        settings = data.pop("settings")
        if not isinstance(settings, dict):
            raise TypeError("'settings' is not an object")
        return cls(**data, settings=EvalSettings.from_dict(settings))


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
    state: State = State.PENDING
    exit_code: int | None = None
    done: int = 0                   # prompts its worker had finished when last heard from
    prompts: int | None = None      # prompts its worker has to do (None: not heard yet)
    why: str | None = None          # the host's reason for that state (a full disk, a lost job), if any
    ray: dict | None = None         # a Ray host's shard: its actor, job, node (eval/ray.py)
    slurm: dict | None = None       # a Slurm host's shard: its job array task, node, GPUs (eval/slurm.py)

    @property
    def label(self) -> str:
        """``host`` or ``host:gpuN``: how progress and errors name the shard."""
        return self.host if self.gpu is None else f"{self.host}:gpu{self.gpu}"

    def local_dir(self, run_dir: Path) -> Path:
        """Where its files land here."""
        return run_dir if self.count == 1 else run_dir / f"shard-{self.index}"


def plain_name(name) -> bool:
    """A name that is one folder under another and no more: no separator, not ``.``/``..``."""
    return (isinstance(name, str) and 0 < len(name) <= 255 and name not in (".", "..")
            and not any(c in name for c in "/\\\0"))


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


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


def write_atomic(path: Path, data: str | bytes) -> None:
    """``path`` replaced by ``data`` (text as UTF-8) at once, through a temporary file of its own
    (concurrent writers never share one, its mode is the umask's); a link at ``path`` is replaced,
    never written through."""
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
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
    drafter: str                    # the drafter's label (catalog), or its folder's name
    checkpoint: str | None          # the checkpoint's folder, for a training run's drafter
    target: str
    created_at: str
    status: State
    request: EvalRequest
    shards: list[Shard] = field(default_factory=list)
    step: int | None = None         # the checkpoint's training step
    cancels: int = 0                # times `cancel` stopped it (a resume that started meanwhile sees it)
    forced: list[dict] = field(default_factory=list)   # what `eval --resume --force` resumed despite: {at, shard, what, change}
    folder: Path | None = field(default=None, repr=False, compare=False)   # runs/<id>, not saved

    @property
    def hosts(self) -> list[str]:
        """The hosts its shards run on, in order, each once."""
        return list(dict.fromkeys(s.host for s in self.shards)) or list(self.request.hosts)

    @property
    def settings(self) -> EvalSettings:
        return self.request.settings

    @property
    def label(self) -> str:
        """``drafter:checkpoint`` (or the drafter alone): how lists and reports name the run's drafter."""
        return f"{self.drafter}:{self.checkpoint}" if self.checkpoint else self.drafter

    # --- creating, reading, writing ------------------------------------------------------------

    @classmethod
    def create(cls, runs_dir: Path, request: EvalRequest, label: str, checkpoint: str | None,
               step: int | None = None) -> "RunRecord":
        """A new run of drafter ``label`` at checkpoint folder ``checkpoint`` (training ``step``)."""
        hosts = request.hosts
        rid = claim_run_folder(Path(runs_dir), run_id(label, checkpoint, "+".join(hosts)))
        return cls(id=rid, drafter=label, checkpoint=checkpoint, step=step, target=request.target or "default",
                   created_at=now_iso(), status=State.PREPARING, request=request,
                   shards=[Shard(host=h, index=i, count=len(hosts)) for i, h in enumerate(hosts)],
                   folder=Path(runs_dir) / rid)

    @classmethod
    def from_dict(cls, raw: dict, folder: Path | None = None) -> "RunRecord":
        """From run.json's object; every field's type is checked (a run folder is untrusted input)."""
        if not isinstance(raw, dict):
            raise TypeError(f"a JSON object was expected, not {type(raw).__name__}")
        raw = {k: v for k, v in raw.items() if k not in ("host", "hosts", "suite", "mode", "prompts")}  # derived
        shards = raw.pop("shards", [])
        if not isinstance(shards, list) or not all(isinstance(s, dict) for s in shards):
            raise TypeError("'shards' is not a list of objects")
        request = raw.pop("request", None)
        if not isinstance(request, dict):
            raise TypeError("'request' is not an object")
        record = cls(**raw, request=EvalRequest.from_dict(request), shards=[Shard(**s) for s in shards],
                     folder=folder)
        record.status = State(record.status)
        for s in record.shards:
            s.state = State(s.state)
        _check_types(record)
        if any(s.index != i or s.count != len(record.shards) for i, s in enumerate(record.shards)):
            raise ValueError("'shards' are not numbered 0..n-1 with count n")
        return record

    @classmethod
    def load(cls, run_dir: Path) -> "RunRecord":
        """run.json of folder ``run_dir``, every field checked; its id must be the folder's name
        (the id names the folders and reports written for the run)."""
        path = Path(run_dir) / RUN_FILE
        try:
            record = cls.from_dict(runfiles.parse(path.read_bytes()), Path(run_dir))
        except OSError as e:
            raise RunRecordError(f"{path}: cannot read the run record: {e.strerror or e}") from None
        except (ValueError, TypeError) as e:   # JSON, UTF-8, nesting, missing or unknown fields, wrong types
            raise RunRecordError(f"{path}: not a valid run record ({e}); the run cannot be followed, cancelled "
                                 f"or resumed from it") from None
        folder = Path(os.path.abspath(run_dir)).name
        if record.id != folder or not plain_name(record.id):
            raise RunRecordError(f"{path}: the run id {record.id[:80]!r} is not its folder's name {folder!r}; "
                                 f"not a run record dflash-ops wrote")
        return record

    def to_dict(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "folder"}
        s = self.settings   # derived, for a reader of run.json (from_dict drops them)
        data.update(hosts=self.hosts, suite=s.suite, mode=s.mode, prompts=s.prompts,
                    status=str(self.status), request=self.request.to_dict(),
                    shards=[{**asdict(s), "state": str(s.state)} for s in self.shards])
        return data

    def save(self) -> None:
        """run.json, atomically; shards followed side by side save from their own threads."""
        with _SAVING:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._adopt_cancel()
            write_atomic(self.folder / RUN_FILE, json.dumps(self.to_dict(), indent=2))

    @property
    def progress(self) -> tuple[int, int | None]:
        """(prompts finished, prompts in all) as the workers last reported them."""
        todo = [s.prompts for s in self.shards]
        return sum(s.done for s in self.shards), (sum(todo) if all(t is not None for t in todo) else None)

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
        return held(self.folder / RESUME_LOCK)

    def cancelled_meanwhile(self) -> bool:
        """Was the run cancelled after this record was read (run.json on disk says so)?"""
        if not (self.folder / RUN_FILE).exists():
            return False
        return RunRecord.load(self.folder).cancels > self.cancels

    def _adopt_cancel(self) -> None:
        """A `cancel` that came after this record was read stays: the run is cancelled."""
        try:
            if self.cancelled_meanwhile():
                self.cancels, self.status = RunRecord.load(self.folder).cancels, State.CANCELLED
        except RunRecordError:
            pass

    def abandon(self, started: bool = True) -> None:
        """A run that never started gives its claimed folder back, when nothing was written into it
        (``started`` False: no worker of it runs, its run.json goes too)."""
        if self.folder is None:
            return
        if not started and self.status == State.PREPARING:
            (self.folder / RUN_FILE).unlink(missing_ok=True)
        if not (self.folder / RUN_FILE).exists():
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
                s.fetched, s.state = False, State.RUNNING
        self.status = State.RUNNING
        self.save()

    def following(self, keep: list[int] = ()) -> None:
        """`attach`: every shard but those of ``keep`` is followed again and its files fetched again."""
        for s in self.shards:
            if s.index not in keep:
                s.fetched = False

    def shard_progressed(self, index: int, event: dict) -> None:
        """A worker event with its progress (``start``: prompts to do and done; ``prompt``: done)."""
        s = self.shards[index]
        if event.get(events.KEY) == events.START:
            s.prompts, s.done = event.get("prompts"), event.get("done") or 0
        elif event.get(events.KEY) == events.PROMPT:
            s.done, s.prompts = event.get("done", s.done), event.get("prompts", s.prompts)
        elif event.get(events.KEY) == events.SCHEDULER and s.slurm is not None:
            s.state = _state(event.get("state"))
            s.slurm = {**s.slurm, "state": event.get("slurm_state"), **({"node": event["node"]} if event.get("node")
                                                                         else {})}
        else:
            return
        self.save()

    def shard_exited(self, index: int, exit_event: dict) -> None:
        """The worker of shard ``index`` ended (its files are about to be fetched)."""
        s = self.shards[index]
        s.state = _state(exit_event.get("state"))
        s.exit_code = exit_event.get("exit_code")
        s.why = exit_event.get("why")

    def shard_fetched(self, index: int) -> None:
        self.shards[index].fetched = True
        self.save()

    def detached(self) -> None:
        """The user stopped following; the workers keep running."""
        self.save()

    def settle(self, save: bool = True) -> str:
        """After following: ``cancelled`` (a `cancel` stopped it meanwhile), ``unfinished`` (some
        shard not fetched: still running), ``failed`` (some worker failed) or ``done``; the status
        follows (written now, or with ``save`` False by the caller's :meth:`save`: a run merged first)."""
        self._adopt_cancel()
        if self.status == State.CANCELLED:
            outcome = "cancelled"
        elif not all(s.fetched for s in self.shards):
            self.status, outcome = State.RUNNING, "unfinished"
        elif any(s.state != State.DONE for s in self.shards):
            self.status, outcome = State.FAILED, "failed"
        else:
            self.status, outcome = State.DONE, "done"
        if save:
            self.save()
        return outcome

    def unmergeable(self) -> None:
        """Its finished shards' results cannot be merged (a prompt id twice): failed; the files stay."""
        self.status = State.FAILED
        self.save()

    def forced_resume(self, changes: list[dict]) -> None:
        """`eval --resume --force` resumes although ``changes`` ({at, shard, what, change}: the drafter,
        the target or the worker code differ from the finished rows'); written with the start."""
        self.forced += changes

    def cancelled(self, stopped: list[int]) -> None:
        """`cancel` stopped the workers of shards ``stopped`` (a shard whose worker had ended by
        itself was fetched instead); the run is cancelled (also with none stopped: a resume that is
        preparing it then starts nothing)."""
        for index in stopped:
            self.shards[index].state = State.CANCELLED
        self.status = State.CANCELLED
        self.cancels += 1
        self.save()


def _state(value) -> State:
    """A state a host reported; anything else is ``unknown``."""
    try:
        return State(value)
    except ValueError:
        return State.UNKNOWN


_TYPES = {"id": str, "drafter": str, "checkpoint": (str, type(None)), "target": str, "created_at": str,
          "step": (int, type(None)), "cancels": int, "forced": list}
_SHARD_TYPES = {"host": str, "index": int, "count": int, "gpu": (str, type(None)), "run_dir": str, "code_dir": str,
                "python": str, "drafter_path": str, "target_path": str, "fetched": bool,
                "exit_code": (int, type(None)), "ray": (dict, type(None)), "slurm": (dict, type(None)), "done": int, "prompts": (int, type(None)),
                "why": (str, type(None))}


_REQUEST_TYPES = {"sglang": str, "gpus": (str, type(None)), "min_free_gb": (int, float), "verify_weights": bool}


def _check_types(record: RunRecord) -> None:
    req = record.request
    if not isinstance(req.hosts, list) or not all(isinstance(h, str) for h in req.hosts):
        raise TypeError("'request.hosts' is not a list of host names")
    for name, kind in _REQUEST_TYPES.items():
        if not isinstance(getattr(req, name), kind):
            raise TypeError(f"'request.{name}' has the wrong type ({type(getattr(req, name)).__name__})")
    for name in ("drafter_ref", "target", "drafter_path", "drafter_run", "checkpoint", "target_path", "suite_file",
                 "suite_sha256"):
        if not isinstance(getattr(req, name), (str, type(None))):
            raise TypeError(f"'request.{name}' has the wrong type ({type(getattr(req, name)).__name__})")
    for name, kind in _TYPES.items():
        if not isinstance(getattr(record, name), kind):
            raise TypeError(f"'{name}' has the wrong type ({type(getattr(record, name)).__name__})")
    if not all(isinstance(f, dict) and all(isinstance(v, str) for v in f.values()) for f in record.forced):
        raise TypeError("'forced' is not a list of objects of strings")
    for s in record.shards:
        for name, kind in _SHARD_TYPES.items():
            if not isinstance(getattr(s, name), kind) or (kind is int and isinstance(getattr(s, name), bool)):
                raise TypeError(f"shard {s.index}: '{name}' has the wrong type ({type(getattr(s, name)).__name__})")
