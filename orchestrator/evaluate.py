"""`dflash-ops eval`: pre-flight → ship → start detached → follow → fetch → merge → report.

One run may shard its prompts over several eval hosts (``--host a --host b``): each host runs the
worker with ``--shard k/n`` in ``<workdir>/runs/<run id>/``; the results are merged locally into
``runs/<run id>/`` in suite order. The run's state lives in its :class:`RunRecord` (runrecord.py);
this module moves it only through the record's transitions. Following never stops a worker:
Ctrl-C or a lost connection leaves it running (``dflash-ops attach RUN`` picks it up again).
"""
from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from .catalog import EMBEDDED
from .errors import InputError, OperationFailed
from .inventory import Host, Inventory
from .jobs import HostJob
from .runrecord import EvalRequest, RunRecord, Shard
from .ship import ship
from .transport import runner_for

INSPECT = ("remote.inspect",)   # the worker's drafter/target compatibility check
THINKING = ("off", "on", "default")
MAX_DDTREE_BUDGET = 1024        # remote/offline.py's MAX_BUDGET (tests/test_sampling_eval.py checks they agree)


class EvalError(OperationFailed):
    """A clear, user-facing reason the eval cannot run (or failed)."""


class RunUnfinished(EvalError):
    """Some shard was not followed to its end (contact lost); its worker keeps running."""

    exit_code = 4


def default_device(host: Host, req: EvalRequest) -> str | None:
    """``--device``, else CPU on ``local`` and on a host whose inventory says ``gpus: 0``, else
    the worker's default (CUDA)."""
    return req.device or ("cpu" if host.is_local or host.gpus == 0 else None)


def parallel(fn, items) -> list:
    with ThreadPoolExecutor(max_workers=max(1, len(items))) as pool:
        return [f.result() for f in [pool.submit(fn, i) for i in items]]


def ddtree_budgets(req: EvalRequest) -> list[int] | None:
    """The request's DDTree budgets (None: the worker's default), checked as the worker checks them."""
    if req.ddtree_budgets is None:
        return None
    try:
        budgets = [int(b) for b in req.ddtree_budgets.split(",") if b.strip()]
    except ValueError:
        raise InputError(f"--ddtree: not a comma-separated list of integers: {req.ddtree_budgets!r}") from None
    if any(not 1 <= b <= MAX_DDTREE_BUDGET for b in budgets):
        raise InputError(f"--ddtree: each budget must be 1..{MAX_DDTREE_BUDGET}, got {req.ddtree_budgets!r}")
    return budgets


def check_request(req: EvalRequest) -> None:
    """Refuse what the worker would refuse, before any host is touched (one line each)."""
    if req.thinking not in THINKING:
        raise InputError(f"--thinking must be one of {', '.join(THINKING)}, not {req.thinking!r}")
    if req.temperature < 0 or not 0 < req.top_p <= 1 or req.top_k < 0:
        raise InputError(f"sampling needs --temperature >= 0, 0 < --top-p <= 1 and --top-k >= 0 (got "
                         f"{req.temperature:g}, {req.top_p:g}, {req.top_k})")
    if req.max_new_tokens < 1:
        raise InputError("--max-new-tokens must be >= 1")
    if ddtree_budgets(req) and req.temperature > 0 and req.mode == "offline":
        raise InputError("--ddtree at --temperature > 0 offline: a sampled DDTree is verified by the target's own "
                         "sampling at every node, which an offline walk cannot do; offline at T > 0 reports the "
                         "expected acceptance (an estimate) instead (leave out --ddtree)")


# ----------------------------------------------------------------------------- pre-flight

def _python_json(runner, python: str, code_dir: str, module: str, *args: str,
                 timeout: float = 600) -> tuple[dict | None, str]:
    res = runner.run([python, "-m", module, *args], timeout=timeout, env={"PYTHONPATH": code_dir}, cwd=code_dir)
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
    wants_gpu = (default_device(host, req) or "cuda").startswith("cuda")
    if wants_gpu and not (report.cuda or "").startswith("yes"):
        raise EvalError(f"host {host.name}: no CUDA GPU visible to torch (pass --device cpu to run on CPU, "
                        f"or set `gpus: 0` for it in the inventory)")


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


def resolve_models(host: Host, runner, code_dir: str, req: EvalRequest) -> tuple[str, str]:
    """(drafter folder, target folder) on ``host`` for the request, whose names were resolved
    before it was made (orchestrator/resolve.py): a folder, a training run's checkpoint folder
    under the host's ``checkpoints`` root, or the embedded demo pair."""
    embedded = req.drafter == EMBEDDED or req.target == EMBEDDED
    drafter, target = embedded_models(host, runner, code_dir) if embedded else (None, None)
    if req.drafter != EMBEDDED:
        if req.drafter_run:
            if not host.checkpoints:
                raise EvalError(f"host {host.name}: no `checkpoints` root in the inventory")
            root = f"{host.checkpoints.rstrip('/')}/{req.drafter_run}"
            if req.checkpoint not in (list_dir(runner, host.python, root) or []):
                raise EvalError(f"host {host.name}: no checkpoint {req.checkpoint} of run {req.drafter_run} in {root} "
                                f"(copy it there with: dflash-ops sync-ckpt {req.drafter} --to {host.name})")
            drafter = f"{root}/{req.checkpoint}"
        elif req.drafter_path:
            drafter = req.drafter_path
        else:
            raise EvalError(f"the run's request names no drafter folder ({req.drafter}): it was recorded by an "
                            f"older dflash-ops; start a new eval")
    if req.target != EMBEDDED:
        target = req.target_path
    return drafter, target


def prepare_shard(record: RunRecord, index: int, host: Host, inventory: Inventory,
                  on_phase: Callable[[str], None] | None = None) -> HostJob:
    """Pre-flight on one host, before any GPU time: environment, ship the worker, locate and check
    the drafter and target there; the shard learns where its worker runs."""
    req, shard = record.eval_request, record.shards[index]
    phase = on_phase or (lambda _: None)
    if not host.workdir:
        raise EvalError(f"host {host.name}: no `workdir` in the inventory")
    phase("connecting")
    check_host_ready(host, inventory, req)
    phase("pre-flight: shipping the worker, checking drafter and target")
    runner = runner_for(host, inventory)
    code_dir = ship(runner, host.python, host.workdir)
    drafter_path, target_path = resolve_models(host, runner, code_dir, req)
    flags = ["--verify-hashes"] if req.verify_weights else []
    report, err = _python_json(runner, host.python, code_dir, *INSPECT, drafter_path, "--target", target_path,
                               "--json", *flags, timeout=1800)
    if report is None:
        raise EvalError(f"host {host.name}: drafter inspection failed: {err[-800:]}")
    if not report["ok"]:
        raise EvalError(f"host {host.name}: " + "\n  ".join(report["problems"]))
    run_dir = f"{host.workdir.rstrip('/')}/runs/{record.id}" + (f"/shard-{shard.index}" if shard.count > 1 else "")
    record.prepared(index, run_dir=run_dir, code_dir=code_dir, python=host.python, drafter_path=drafter_path,
                    target_path=target_path)
    return HostJob(runner, host.python, code_dir, run_dir)


def worker_args(req: EvalRequest, shard: Shard, host: Host, resume: bool) -> list[str]:
    args = ["--target", shard.target_path, "--drafter", shard.drafter_path, "--suite", req.suite,
            "--mode", req.mode, "--out", f"{shard.run_dir}/out", "--max-new-tokens", str(req.max_new_tokens),
            "--thinking", req.thinking, "--temperature", repr(float(req.temperature)), "--top-p",
            repr(float(req.top_p)), "--top-k", str(req.top_k), "--seed", str(req.seed), "--host-label", host.name]
    if req.ddtree_budgets is not None:
        args += ["--ddtree-budgets", req.ddtree_budgets]
    if req.prompts:
        args += ["--prompts", str(req.prompts)]
    if req.max_blocks:
        args += ["--max-blocks", str(req.max_blocks)]
    device = default_device(host, req)
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


def start(record: RunRecord, inventory: Inventory, resume: bool = False,
          on_phase: Callable[[str, str], None] | None = None) -> dict[int, HostJob]:
    """Pre-flight every shard's host (in parallel), then start every worker detached.
    ``on_phase(host, phase)`` hears each step: connecting, pre-flight, starting the worker."""
    hosts = [inventory.get(s.host) for s in record.shards]

    def prepare(i: int) -> HostJob:
        return prepare_shard(record, i, hosts[i], inventory,
                             on_phase=(lambda phase: on_phase(hosts[i].name, phase)) if on_phase else None)

    jobs = dict(enumerate(parallel(prepare, list(range(len(record.shards))))))
    req = record.eval_request
    for i, job in jobs.items():
        if on_phase:
            on_phase(hosts[i].name, "starting the worker")
        job.start(worker_args(req, record.shards[i], hosts[i], resume=resume))
    record.started()
    return jobs


def jobs_of(record: RunRecord, inventory: Inventory) -> dict[int, HostJob]:
    """The started workers of a run, to follow or cancel them."""
    return {s.index: HostJob(runner_for(inventory.get(s.host), inventory), s.python, s.code_dir, s.run_dir)
            for s in record.shards}


# ----------------------------------------------------------------------------- following

def follow(record: RunRecord, jobs: dict[int, HostJob], on_event: Callable[[int, dict], None]) -> dict[int, str]:
    """Follow every unfetched shard at once until its worker ends, then fetch its files.
    ``on_event(shard index, event)`` sees every worker event. Returns {shard index: why contact
    was lost}. KeyboardInterrupt propagates (the workers keep running)."""
    lost: dict[int, str] = {}

    def follow_one(i: int) -> None:
        shard, job = record.shards[i], jobs[i]
        try:
            for ev in job.follow():
                on_event(i, ev)
                if ev.get("event") == "exit":
                    record.shard_exited(i, ev)
                    job.fetch(shard.local_dir(record.folder))
                    record.shard_fetched(i)
        except Exception as e:  # noqa: BLE001 — reported to the caller; the worker itself keeps running
            lost[i] = f"lost contact with {shard.host}: {e}"

    threads = [threading.Thread(target=follow_one, args=(i,), daemon=True)
               for i, s in enumerate(record.shards) if not s.fetched]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.2)
    return lost


def merge_shards(run_dir: Path, shards: list[Shard]) -> dict:
    """Merge shard folders (``run_dir/shard-k``, or the run folder itself for one shard) into
    ``run_dir``'s results.jsonl / summary.json / env.json, in suite order."""
    from remote.metrics import summarize

    if len(shards) == 1:
        return json.loads((run_dir / "summary.json").read_text())
    rows_by_id, order, envs = {}, {}, []
    for s in shards:
        d = s.local_dir(run_dir)
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
    settings = env["settings"]
    summary = summarize(rows, settings["block_size"], settings["mode"], max_length=settings.get("verify_block"))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def finish(record: RunRecord) -> tuple[dict, tuple[Path, Path] | None]:
    """After following: a finished run is merged and reported: (summary, report paths). A run
    with an unfetched shard raises :class:`RunUnfinished`, one with a failed worker
    :class:`EvalError` (the caller shows the failed shards' logs first, see :func:`failed_logs`)."""
    outcome = record.settle()
    if outcome == "unfinished":
        raise RunUnfinished(f"not all shards finished; the workers keep running. Re-attach with: "
                            f"dflash-ops attach {record.id}")
    if outcome == "failed":
        hosts = ", ".join(f"{s.host} (state {s.state}, exit code {s.exit_code})"
                          for s in record.shards if s.state != "done")
        raise EvalError(f"the worker failed on {hosts}; finished prompts are kept: "
                        f"dflash-ops eval --resume {record.id}")
    summary = merge_shards(record.folder, record.shards)
    from .report import write_report

    return summary, write_report(record.folder)


def failed_logs(record: RunRecord, jobs: dict[int, HostJob], lines: int = 25) -> dict[str, str]:
    """{host: the last lines of its worker log} for the shards that did not end ``done``."""
    out = {}
    for s in record.shards:
        if s.fetched and s.state != "done":
            log = s.local_dir(record.folder) / "worker.log"
            tail = "\n".join(log.read_text().splitlines()[-lines:]) if log.exists() else jobs[s.index].log_tail(lines)
            out[s.host] = tail
    return out


def cancel(record: RunRecord, inventory: Inventory) -> dict[str, dict]:
    """Stop a run's workers (finished prompts stay on the hosts); {host: the worker's state}."""
    states = {i: job.cancel() for i, job in jobs_of(record, inventory).items()}
    record.cancelled({i: st.get("state", "unknown") for i, st in states.items()})
    return {record.shards[i].host: st for i, st in states.items()}
