"""`dflash-ops eval`: plan → pre-flight → ship → start detached → follow → fetch → merge → report.

One run may shard its prompts over several eval hosts (``--host a --host b``): each host runs the
worker with ``--shard k/n`` in ``<workdir>/runs/<run id>/``; the results are merged locally into
``runs/<run id>/`` in suite order. Ctrl-C while following leaves the workers running
(``dflash-ops attach RUN`` picks them up again).
"""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from .inventory import Host, Inventory
from .jobs import HostJob
from .ship import ship
from .transport import TransportError, runner_for

EMBEDDED = "embedded"


class EvalError(Exception):
    """A clear, user-facing reason the eval cannot run (or failed)."""


@dataclass
class EvalRequest:
    hosts: list[str]
    drafter: str | None = None
    target: str | None = None
    suite: str = "default"
    prompts: int | None = 2
    mode: str = "offline"
    max_new_tokens: int = 256
    max_blocks: int | None = None
    device: str | None = None
    dtype: str | None = None
    sglang: str = "auto"            # auto (the host's, offline mode) | off | URL
    thinking: str = "default"
    ddtree_budgets: str = "8,16,32,64"
    all_anchors: bool = False
    min_free_gb: float = 1.0
    verify_weights: bool = False    # sha256 of the weights vs the sync manifest (slow on 17 GB)


@dataclass
class Shard:
    host: str
    index: int
    count: int
    run_dir: str = ""
    code_dir: str = ""
    python: str = ""
    drafter_path: str = ""
    target_path: str = ""
    fetched: bool = False
    state: str = "pending"
    exit_code: int | None = None


@dataclass
class RunRecord:
    """``runs/<id>/run.json``: everything needed to follow, resume, cancel and report a run."""
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

    def save(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / "run.json.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(run_dir / "run.json")

    @classmethod
    def load(cls, run_dir: Path) -> "RunRecord":
        raw = json.loads((run_dir / "run.json").read_text())
        raw["shards"] = [Shard(**s) for s in raw.get("shards", [])]
        return cls(**raw)


def run_id(drafter: str, checkpoint: str | None, host: str, when: datetime | None = None) -> str:
    when = when or datetime.now()
    parts = [when.strftime("%Y%m%d-%H%M%S"), drafter, checkpoint or "", host]
    return "-".join(re.sub(r"[^A-Za-z0-9._-]+", "_", p).strip("_") for p in parts if p)


def split_drafter(spec: str | None) -> tuple[str | None, str | None]:
    """``v5:step20k`` -> ("v5", "step20k"); a path is kept whole."""
    if spec and "/" not in spec and ":" in spec:
        label, ckpt = spec.split(":", 1)
        return label, ckpt or None
    return spec, None


# ----------------------------------------------------------------------------- per-host preparation

def _python_json(job_runner, python: str, code_dir: str, module: str, *args: str, timeout: float = 600) -> tuple[dict | None, str]:
    res = job_runner.run([python, "-m", module, *args], timeout=timeout, env={"PYTHONPATH": code_dir}, cwd=code_dir)
    try:
        return json.loads(res.stdout), res.stderr
    except json.JSONDecodeError:
        return None, (res.stderr or res.stdout).strip()


def check_host_ready(host: Host, inventory: Inventory, req: EvalRequest) -> None:
    from .hostcheck import check_host

    report = check_host(host, inventory=inventory)
    if not report.reachable:
        raise EvalError(f"host {host.name} is not reachable: {'; '.join(report.errors)}")
    if not report.torch or not report.transformers:
        missing = [n for n, v in (("torch", report.torch), ("transformers", report.transformers)) if not v]
        raise EvalError(f"host {host.name}: the python environment {host.python} lacks {', '.join(missing)} "
                        f"(set `python:` in the inventory to the ML environment's interpreter)")
    free = (((report.raw or {}).get("disk") or {}).get("workdir") or {}).get("free_bytes")
    if free is not None and free < req.min_free_gb * 2**30:
        raise EvalError(f"host {host.name}: only {free / 2**30:.1f} GiB free in {host.workdir} "
                        f"(need {req.min_free_gb:g} GiB for the worker and its results)")
    wants_gpu = (req.device or ("cpu" if host.is_local else "cuda")).startswith("cuda")
    if wants_gpu and not (report.cuda or "").startswith("yes"):
        raise EvalError(f"host {host.name}: no CUDA GPU visible to torch (pass --device cpu to run on CPU)")


def prepare_shard(host: Host, inventory: Inventory, req: EvalRequest, shard: Shard, rid: str, catalog_resolve) -> HostJob:
    """Pre-flight on one host, before any GPU time: environment, ship the worker, locate and check
    the drafter and target there."""
    if not host.workdir:
        raise EvalError(f"host {host.name}: no `workdir` in the inventory")
    check_host_ready(host, inventory, req)
    runner = runner_for(host, inventory)
    code_dir = ship(runner, host.python, host.workdir)
    drafter_path, target_path = catalog_resolve(host, runner, code_dir)
    flags = ["--verify-hashes"] if req.verify_weights else []
    report, err = _python_json(runner, host.python, code_dir, "remote.inspect", drafter_path,
                               "--target", target_path, "--json", *flags, timeout=1800)
    if report is None:
        raise EvalError(f"host {host.name}: drafter inspection failed: {err[-800:]}")
    if not report["ok"]:
        raise EvalError(f"host {host.name}: " + "\n  ".join(report["problems"]))
    shard.run_dir = f"{host.workdir.rstrip('/')}/runs/{rid}" + (f"/shard-{shard.index}" if shard.count > 1 else "")
    shard.code_dir, shard.python = code_dir, host.python
    shard.drafter_path, shard.target_path = drafter_path, target_path
    return HostJob(runner, host.python, code_dir, shard.run_dir)


def embedded_models(host: Host, runner, code_dir: str) -> tuple[str, str]:
    """Build (first use) or find the embedded demo target + drafter in the host's workdir."""
    out = f"{host.workdir.rstrip('/')}/embedded"
    res, err = _python_json(runner, host.python, code_dir, "remote.embedded", "--out", out, timeout=900)
    if res is None:
        raise EvalError(f"host {host.name}: building the embedded demo models failed: {err[-800:]}")
    return res["drafter"], res["target"]


_LIST_DIR = "import json, os, sys; d = sys.argv[1]; print(json.dumps(sorted(os.listdir(d)) if os.path.isdir(d) else None))"


def list_dir(runner, python: str, path: str) -> list[str] | None:
    res = runner.run([python, "-c", _LIST_DIR, path], timeout=60)
    return json.loads(res.stdout) if res.ok else None


def catalog_paths(host: Host, runner, label: str, ckpt: str | None, target: str | None) -> tuple[str, str]:
    """Drafter and target folders on ``host`` for ``label[:ckpt]`` (configs/drafters.yaml) or paths.
    A run drafter's checkpoints live in ``<host checkpoints>/<run>/``; ``ckpt`` may be any spelling
    of a step (``step20k``, ``20000``) or a folder name; without one the newest is used."""
    from .catalog import CatalogError, load_catalog, resolve_checkpoint

    try:
        cat = load_catalog()
        entry = None
        if "/" in label:
            drafter_path = label
        else:
            entry = cat.drafter(label)
            if entry.path:
                drafter_path = entry.path
            else:
                run = cat.run(entry.run)
                root = f"{(host.checkpoints or '').rstrip('/')}/{entry.run}"
                if not host.checkpoints:
                    raise EvalError(f"host {host.name}: no `checkpoints` root in the inventory")
                folders = [f for f in (list_dir(runner, host.python, root) or []) if not f.startswith(".")]
                if not folders:
                    raise EvalError(f"host {host.name}: no checkpoints of run {entry.run} in {root} "
                                    f"(copy one there with: dflash-ops sync-ckpt {ckpt or 'STEP'} --run {entry.run})")
                if ckpt is None:
                    stepped = sorted((f for f in folders if run.step_of(f) is not None), key=run.step_of)
                    if not stepped:
                        raise EvalError(f"drafter {label}: name a checkpoint ({label}:NAME); {root} holds "
                                        f"{', '.join(folders[:10])}")
                    ckpt_folder = stepped[-1]
                else:
                    ckpt_folder = resolve_checkpoint(ckpt, run, folders)
                drafter_path = f"{root}/{ckpt_folder}"
        if target and "/" in target:
            target_path = target
        elif target or (entry and entry.target):
            target_path = cat.target(target or entry.target).path
        else:
            raise EvalError(f"no target for drafter {label}: pass --target LABEL|PATH or set `target:` "
                            f"for it in configs/drafters.yaml")
    except CatalogError as e:
        raise EvalError(str(e)) from None
    return drafter_path, target_path


def worker_args(req: EvalRequest, shard: Shard, host: Host, resume: bool) -> list[str]:
    args = ["--target", shard.target_path, "--drafter", shard.drafter_path, "--suite", req.suite,
            "--mode", req.mode, "--out", f"{shard.run_dir}/out", "--max-new-tokens", str(req.max_new_tokens),
            "--thinking", req.thinking, "--ddtree-budgets", req.ddtree_budgets, "--host-label", host.name]
    if req.prompts:
        args += ["--prompts", str(req.prompts)]
    if req.max_blocks:
        args += ["--max-blocks", str(req.max_blocks)]
    device = req.device or ("cpu" if host.is_local else None)
    if device:
        args += ["--device", device]
    if req.dtype:
        args += ["--dtype", req.dtype]
    sglang = host.sglang if req.sglang == "auto" and req.mode == "offline" else (None if req.sglang in ("auto", "off") else req.sglang)
    if sglang:
        args += ["--sglang", sglang]
    if req.all_anchors:
        args.append("--all-anchors")
    if shard.count > 1:
        args += ["--shard", f"{shard.index}/{shard.count}"]
    if resume:
        args.append("--resume")
    return args


# ----------------------------------------------------------------------------- merging

def merge_shards(run_dir: Path, shards: list[Shard]) -> dict:
    """Merge shard folders (``run_dir/shard-k``, or the run folder itself for one shard) into
    ``run_dir``'s results.jsonl / summary.json / env.json, in suite order."""
    from remote.metrics import summarize

    if len(shards) == 1:
        return json.loads((run_dir / "summary.json").read_text())
    rows_by_id, order, envs = {}, {}, []
    for s in shards:
        d = run_dir / f"shard-{s.index}"
        env = json.loads((d / "env.json").read_text())
        envs.append(env)
        for j, rid in enumerate(env["suite"]["ids"]):
            order[rid] = s.index + j * s.count
        for line in (d / "results.jsonl").read_text().splitlines():
            row = json.loads(line)
            if row["id"] in rows_by_id:
                raise EvalError(f"prompt {row['id']} appears in two shards")
            rows_by_id[row["id"]] = row
    rows = sorted(rows_by_id.values(), key=lambda r: order.get(r["id"], 1 << 30))
    with open(run_dir / "results.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    env = dict(envs[0])
    env["host"] = ",".join(e["host"] for e in envs)
    env["suite"] = {**env["suite"], "ids": [r["id"] for r in rows], "shard": None}
    env["shards"] = envs
    (run_dir / "env.json").write_text(json.dumps(env, indent=2))
    summary = summarize(rows, env["settings"]["block_size"], env["settings"]["mode"])
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def local_shard_dir(run_dir: Path, shard: Shard) -> Path:
    return run_dir if shard.count == 1 else run_dir / f"shard-{shard.index}"


def finish_shard(job: HostJob, run_dir: Path, shard: Shard, exit_event: dict) -> None:
    shard.state = exit_event.get("state", "unknown")
    shard.exit_code = exit_event.get("exit_code")
    job.fetch(local_shard_dir(run_dir, shard))
    shard.fetched = True


def parallel(fn, items) -> list:
    with ThreadPoolExecutor(max_workers=max(1, len(items))) as pool:
        return [f.result() for f in [pool.submit(fn, i) for i in items]]
