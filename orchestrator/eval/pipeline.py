"""`dflash-ops eval`: pre-flight → ship → start detached → follow → fetch → merge → report.

One run may shard its prompts over several eval hosts (``--host a --host b``): each host runs the
worker with ``--shard k/n`` in ``<workdir>/runs/<run id>/``; the results are merged locally into
``runs/<run id>/`` in suite order. The run's state lives in its :class:`RunRecord` (runrecord.py);
this module moves it only through the record's transitions. Following never stops a worker:
Ctrl-C or a lost connection leaves it running (``dflash-ops attach RUN`` picks it up again).
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from remote.contract import events
from remote.contract import exits
from remote.contract.credentials import AUTH_ENV, split_credentials
from remote.contract.settings import ASSUMED_GPU_MEMORY_ENV, BUILTIN_SUITES, CPU_WORKERS_ENV, SPECFORGE, EvalSettings
from remote.contract.states import State

from ..config.catalog import EMBEDDED
from ..config.inventory import Host, Inventory
from ..config.paths import read_config_text
from ..errors import InputError, OperationFailed, disk_error
from ..runs.record import RESUME_LOCK, EvalRequest, RunRecord, Shard, now_iso, write_atomic
from ..transport import TransportError, runner_for
from . import lease
from .jobs import RESULTS, FetchFailed, HostJob, WorkerStalled, check_shard
from .placement import group, host_gpu_ids, parse_gpus, visible_gpus
from .ship import bundle, ship

PREFLIGHT = "remote.preflight"   # the drafter/target compatibility check and memory plan


class EvalError(OperationFailed):
    """A clear, user-facing reason the eval cannot run (or failed)."""


class RunUnfinished(EvalError):
    """Some shard was not followed to its end (contact lost); its worker keeps running."""

    exit_code = 4


class RunStalled(RunUnfinished):
    """A worker alive on its host reported no progress for its stall limit; following ended, the
    worker was left running (`attach` follows it again, `cancel` stops it)."""


class LocalWriteFailed(RunUnfinished):
    """This machine's disk (full or read-only) refused a run file; the results wait on the host."""


class DuplicatePrompts(EvalError):
    """A prompt id more than once in a run's results: nothing is merged."""


class RunCancelled(EvalError):
    """`cancel` came while `eval --resume` was preparing the run: nothing was started."""


class InvalidRun(EvalError):
    """A worker found its greedy online output differing from the target's own, or its drafter's
    outputs NaN or infinite: no τ of the run is a result (the rows are kept, the summary is marked
    invalid)."""

    exit_code = 7


def default_device(host: Host, req: EvalRequest) -> str | None:
    """``--device``, else CPU on ``local`` and on a host whose inventory says ``gpus: 0``, else
    the worker's default (CUDA)."""
    return req.settings.device or ("cpu" if host.is_local or host.gpus == 0 else None)


def host_settings(req: EvalRequest, host: Host) -> EvalSettings:
    """The run's settings as the worker on ``host`` gets them: its device chosen."""
    return replace(req.settings, device=default_device(host, req))


def check_sglang_option(value: str) -> None:
    """``--sglang`` is auto, off or a URL without credentials: a password typed there would be in the
    shell history and the run's files; it belongs in the inventory's URL or in $DFLASH_OPS_SGLANG_AUTH."""
    if value in ("auto", "off"):
        return
    try:
        _, auth = split_credentials(value)
    except ValueError as e:
        raise InputError(f"--sglang: not a valid URL ({e})") from None
    if auth is not None:
        raise InputError(f"--sglang: the URL holds credentials; give the URL without them and set "
                         f"{AUTH_ENV}=user:password, or put the URL in the host's inventory entry")


def reference_sglang(req: EvalRequest, host: Host) -> tuple[str | None, str | None]:
    """(the SGLang URL the worker asks for reference completions, or None for local greedy;
    its credentials ``user:password`` or None)."""
    if req.sglang == "off" or (req.sglang == "auto" and req.settings.mode != "offline"):
        return None, None
    if req.sglang == "auto":
        return host.sglang, host.sglang_auth
    return req.sglang, os.environ.get(AUTH_ENV) or None


def parallel(fn, items) -> list:
    with ThreadPoolExecutor(max_workers=max(1, len(items))) as pool:
        return [f.result() for f in [pool.submit(fn, i) for i in items]]


def new_run(runs_root: Path, hosts: list[str], choice, settings: EvalSettings, *, sglang: str = "auto",
            gpus: str | None = None, verify_weights: bool = False) -> RunRecord:
    """A run of ``choice`` (a resolved drafter: names.DrafterChoice, its checkpoint located) with
    ``settings`` on ``hosts``: the request checked and the record made; nothing on a host yet.
    `eval` and `watch` both start here, then :func:`start` and :func:`complete`. A catalog drafter of
    ``format: specforge`` is counted by SpecForge's rules unless the settings name others."""
    if settings.semantics is None and choice.entry is not None and choice.entry.format == SPECFORGE:
        settings = replace(settings, semantics=SPECFORGE)
    req = EvalRequest(hosts=list(hosts), settings=settings, drafter_ref=choice.resolved, target=choice.target,
                      sglang=sglang, gpus=gpus, verify_weights=verify_weights, drafter_path=choice.path,
                      drafter_run=choice.run.name if choice.run else None,
                      checkpoint=choice.checkpoint if choice.run else None, target_path=choice.target_path)
    local = Path(settings.suite).expanduser()
    if settings.suite not in BUILTIN_SUITES and local.is_file():     # this machine's suite file: sent to the hosts
        text = read_config_text(local, InputError, "the suite")      # UTF-8, or one line saying where not
        req.suite_file, req.suite_sha256 = str(local.resolve()), hashlib.sha256(text.encode()).hexdigest()
    check_request(req)
    return RunRecord.create(runs_root, req, choice.label, req.checkpoint, choice.step if choice.run else None)


def check_request(req: EvalRequest) -> None:
    """Refuse what the worker would refuse, before any host is touched (one line each; the settings
    were checked when they were made)."""
    check_sglang_option(req.sglang)
    parse_gpus(req.gpus)


# ----------------------------------------------------------------------------- pre-flight

def _python_json(runner, python: str, code_dir: str, module: str, *args: str,
                 timeout: float = 600, env: dict[str, str] | None = None) -> tuple[dict | None, str]:
    res = runner.run([python, "-m", module, *args], timeout=timeout, env={"PYTHONPATH": code_dir, **(env or {})},
                     cwd=code_dir)
    try:
        return json.loads(res.stdout), res.stderr
    except json.JSONDecodeError:
        return None, (res.stderr or res.stdout).strip()


def check_host_ready(host: Host, runner, req: EvalRequest, gpu_here: bool = True):
    """The host's probe report through ``runner``, once it passed (reachable, ML stack, disk, CUDA
    when wanted; ``gpu_here=False``: the GPUs are elsewhere, a Slurm cluster's compute nodes)."""
    from .hostcheck import probe

    wants_gpu = not wants_cpu(req, host)
    report = probe(host, runner, cuda=wants_gpu)
    if not report.reachable:
        raise EvalError(f"host {host.name} is not reachable: {'; '.join(report.errors)}")
    if not report.torch or not report.transformers:
        missing = [n for n, v in (("torch", report.torch), ("transformers", report.transformers)) if not v]
        raise EvalError(f"host {host.name}: the python environment {host.python} lacks {', '.join(missing)} "
                        f"(set `python:` in the inventory to the ML environment's interpreter)")
    free = (((report.raw or {}).get("disk") or {}).get("workdir") or {}).get("free_bytes")
    if free is not None and free < req.min_free_gb * 2**30:
        raise EvalError(f"host {host.name}: only {free / 2**30:.1f} GiB free in {host.workdir} "
                        f"(need {req.min_free_gb:g} GiB for the worker and its results); `dflash-ops clean --host "
                        f"{host.name}` shows what can go (older workers, fetched runs, copies the trainer deleted)")
    if wants_gpu and gpu_here and not (report.cuda or "").startswith("yes"):
        raise EvalError(f"host {host.name}: no CUDA GPU visible to torch (pass --device cpu to run on CPU, "
                        f"or set `gpus: 0` for it in the inventory)")
    return report


class Notice(str):
    """A phase worth a line of its own where no spinner shows the phases (output not a terminal): a
    step that can take minutes, said when it starts and when it is done."""


def embedded_models(host: Host, runner, code_dir: str, phase: Callable[[str], None] = lambda _: None
                    ) -> tuple[str, str]:
    """Find the embedded demo target + drafter in the host's workdir, or build them there (first
    use), saying so (:class:`Notice`) only when they are really built."""
    out = f"{host.workdir.rstrip('/')}/embedded"
    res, err = _python_json(runner, host.python, code_dir, "remote.embedded", "--out", out, "--check", timeout=120)
    if not res:
        started = time.monotonic()
        phase(Notice(f"building the embedded demo pair in {out} (first use on this host: about a minute on CPU)"))
        res, err = _python_json(runner, host.python, code_dir, "remote.embedded", "--out", out, timeout=900)
        if res is not None:
            phase(Notice(f"built the embedded demo pair in {time.monotonic() - started:.0f}s"))
    if res is None:
        raise EvalError(f"host {host.name}: building the embedded demo models failed: {err[-800:]}")
    return res["drafter"], res["target"]


def locate_models(host: Host, runner, code_dir: str, req: EvalRequest) -> tuple[str, str]:
    """(drafter folder, target folder) on ``host`` for the request, whose names were resolved
    before it was made (orchestrator/names.py): a folder, a training run's checkpoint folder
    under the host's ``checkpoints`` root (:func:`lease.model_paths`), or the embedded demo pair. That
    they exist and fit is pre-flight's to say (:func:`check_models`), in the same call to the host."""
    embedded = req.drafter_ref == EMBEDDED or req.target == EMBEDDED
    drafter, target = embedded_models(host, runner, code_dir) if embedded else (None, None)
    named_drafter, named_target = lease.model_paths(host, runner, req)
    if req.drafter_ref != EMBEDDED:
        if req.drafter_run and not host.checkpoints:
            raise EvalError(f"host {host.name}: no `checkpoints` root in the inventory")
        if named_drafter is None:
            raise EvalError(f"the run's request names no drafter folder ({req.drafter_ref}); start a new eval")
        drafter = named_drafter
    if req.target != EMBEDDED:
        target = named_target or req.target_path
    return drafter, target


@dataclass
class HostPrep:
    """What pre-flight learned on one host, shared by all its shards."""
    host: Host                      # its paths expanded there (~ is the login home)
    runner: object
    code_dir: str
    drafter_path: str
    target_path: str
    visible_gpus: int
    cpu: bool                       # its workers run on CPU
    suite: str                      # the suite as the worker there reads it (a file sent there, or a name)
    cluster: object = None          # a Slurm cluster's partitions and version (eval/slurm.py Cluster)
    target_identity: dict | None = None     # what a resume compares of the target (remote/target/memory.py)
    checked: bool = True            # its checks ran on the workers' device (not: a Slurm login node without GPU,
                                    # the worker checks again on its node)


def send_suite(host: Host, runner, req: EvalRequest) -> str:
    """The suite for the workers on ``host``: this machine's suite file copied to
    ``<workdir>/suites/<sha256>/<name>`` (once per content), else the suite as given."""
    if not req.suite_file:
        return req.settings.suite
    name = Path(req.suite_file).name
    folder = f"{host.workdir.rstrip('/')}/suites/{req.suite_sha256[:16]}"
    there = f"{folder}/{name}"
    if runner.run(["test", "-f", there], timeout=30).ok:
        return there
    try:
        data = Path(req.suite_file).read_bytes()
    except OSError as e:
        raise EvalError(f"cannot read the suite {req.suite_file}: {e.strerror or e}") from None
    if hashlib.sha256(data).hexdigest() != req.suite_sha256:
        raise EvalError(f"the suite {req.suite_file} changed since the run started (its sha256 differs): start a new "
                        f"eval, or put the file back as it was")
    runner.run(["mkdir", "-p", folder], timeout=30, check=True)
    runner.put_text(data.decode("utf-8"), f"{there}.tmp")
    runner.run(["mv", "-f", f"{there}.tmp", there], timeout=30, check=True)
    return there


def wants_cpu(req: EvalRequest, host: Host) -> bool:
    return not (default_device(host, req) or "cuda").startswith("cuda")


def engine_of(host: Host):
    """The host's serving engine for `eval --engine`, or the one line that says how to give it one."""
    if host.engine is None:
        raise EvalError(f"host {host.name} has no engine for --engine: add `engine: {{kind: vllm, python: "
                        f"/path/to/engine-venv/bin/python}}` (or `url:` of a running server) to its inventory entry")
    return host.engine


def check_engine(host: Host, runner) -> dict | None:
    """An engine the worker starts (``python:``) is installed on the host: its version from package
    metadata, or the one line that says it is not and how to install it. A running server
    (``url:``) is checked by the worker, which talks to it."""
    from remote.contract.engines import ENGINES
    from remote.host.probe import ENGINE_DISTRIBUTIONS, ENGINE_SNIPPET

    engine = host.engine
    if engine.python is None:
        return None
    install, name = ENGINES[engine.kind].install, ENGINES[engine.kind].name
    res = runner.run([engine.python, "-c", ENGINE_SNIPPET], timeout=120)
    try:
        found = json.loads(res.stdout.strip().splitlines()[-1]) if res.ok else None
    except (ValueError, IndexError):
        found = None
    if found is None:
        raise EvalError(f"host {host.name}: {name} is not installed: {engine.python} (the inventory's engine.python) "
                        f"does not run there; install it: {install}")
    dist = next((d for d in ENGINE_DISTRIBUTIONS[engine.kind] if found.get(d)), None)
    if dist is None:
        raise EvalError(f"host {host.name}: {name} is not installed in {engine.python}'s environment; install it: "
                        f"{install}")
    return {engine.kind: found[dist], "distribution": dist}


def prepare_host(record: RunRecord, host: Host, inventory: Inventory,
                 on_phase: Callable[[str], None] | None = None) -> HostPrep:
    """Pre-flight on one host, before any GPU time: environment, ship the worker, locate and check
    the drafter and target there (and, with --engine, that the host's engine is installed)."""
    req = record.request
    phase = on_phase or (lambda _: None)
    if not host.workdir:
        raise EvalError(f"host {host.name}: no `workdir` in the inventory")
    host.refuse_example()                   # a placeholder: its own line, not "not reachable"
    if req.settings.engine:
        engine_of(host)
    phase("connecting")
    runner = runner_for(host, inventory)
    try:
        host = host.on_host(runner.expand_home)
    except TransportError as e:
        raise EvalError(f"host {host.name} is not reachable: {e}") from None
    lease.take(record, host, runner, bundle()[0])
    report = check_host_ready(host, runner, req)
    if req.settings.engine:
        check_engine(host, runner)
    phase("pre-flight: shipping the worker, checking drafter and target")
    code_dir = ship(runner, host.python, host.workdir)
    if req.drafter_ref == EMBEDDED or req.target == EMBEDDED:
        embedded_models(host, runner, code_dir, phase)
        phase("pre-flight: checking drafter and target")
    suite = send_suite(host, runner, req)
    drafter_path, target_path, identity = check_models(host, runner, code_dir, req, suite)
    return HostPrep(host, runner, code_dir, drafter_path, target_path, visible_gpus(report.raw), wants_cpu(req, host),
                    suite, target_identity=identity)


def check_models(host: Host, runner, code_dir: str, req: EvalRequest, suite: str,
                 assumed_gpu_gb: float | None = None) -> tuple[str, str, dict | None]:
    """(drafter folder, target folder, the target's identity) on the host, located, inspected for
    compatibility and planned against its memory (remote/preflight.py: one process, before any
    weights load)."""
    drafter_path, target_path = map(runner.expand_home, locate_models(host, runner, code_dir, req))
    settings = replace(req.settings, device="cpu" if wants_cpu(req, host) else "cuda", suite=suite)
    args = [drafter_path, "--target", target_path, "--cache", f"{code_dir}/preflight", *settings.to_argv()]
    if req.verify_weights:
        args.append("--verify-hashes")
    if req.settings.engine and host.engine is not None:     # pre-flight checks that it serves the family
        args += ["--engine-kind", host.engine.kind]
    found, err = _python_json(runner, host.python, code_dir, PREFLIGHT, *args, timeout=1800,
                              env={ASSUMED_GPU_MEMORY_ENV: f"{assumed_gpu_gb:g}"} if assumed_gpu_gb else None)
    if found is None:
        raise EvalError(f"host {host.name}: the drafter/target pre-flight failed: {err[-800:]}")
    inspected, plan = found["inspect"], found["memory"]
    if inspected.get("drafter_missing") and req.drafter_run:
        raise EvalError(f"host {host.name}: no checkpoint {req.checkpoint} of run {req.drafter_run} there "
                        f"({drafter_path}); copy it with: dflash-ops sync-ckpt {req.drafter_ref} --to {host.name}")
    if not inspected["ok"]:
        raise EvalError(f"host {host.name}: " + "\n  ".join(inspected["problems"]))
    if not plan["fits"]:
        raise EvalError(f"host {host.name}: {plan['refusal']}")
    identity = found.get("target_identity")
    return drafter_path, target_path, identity if isinstance(identity, dict) else None


def refuse_on_cluster(host: Host, req: EvalRequest, what: str) -> None:
    """What a run on a scheduler's cluster (``what``: a Ray cluster, a Slurm cluster) cannot do: a
    serving engine (its servers would outlive the task), a target over every GPU of a host."""
    if req.settings.engine:
        raise EvalError(f"host {host.name} is {what}: --engine runs on an SSH eval host with `engine:` in the "
                        f"inventory")
    if req.settings.target_devices == "auto":
        raise EvalError(f"host {host.name} is {what}: give --target-devices a count (GPUs per worker)")


def prepare_cluster(record: RunRecord, host: Host, inventory: Inventory,
                    on_phase: Callable[[str], None] | None = None) -> HostPrep:
    """Pre-flight on a Ray cluster (``kind: ray``): its GPUs, then the drafter and target checked
    by a short-lived actor on one of its nodes (holding a worker's GPUs, so that the memory plan
    sees one). Its shards' actors are placed later, one per shard (:func:`ray_job`)."""
    from . import ray as ray_backend

    req = record.request
    phase = on_phase or (lambda _: None)
    if not host.workdir:
        raise EvalError(f"host {host.name}: no `workdir` in the inventory")
    refuse_on_cluster(host, req, "a Ray cluster")
    phase("connecting")
    cluster = ray_backend.cluster_info(host, inventory)
    cpu = wants_cpu(req, host)
    if not cpu and cluster.gpus < req.settings.gpus_per_worker:
        raise EvalError(f"host {host.name}: the Ray cluster has {cluster.gpus} GPU(s), a worker needs "
                        f"{req.settings.gpus_per_worker} (pass --device cpu to run on CPU, or set `gpus: 0`)")
    phase("pre-flight: checking drafter and target on the cluster")
    runner = ray_backend.place(host, inventory, None, 0 if cpu or host.gpus == 0 else req.settings.gpus_per_worker)
    try:
        host = replace(host.on_host(runner.expand_home), python=runner.info["python"])
        suite = send_suite(host, runner, req)
        drafter_path, target_path, identity = check_models(host, runner, runner.info["code_dir"], req, suite)
    finally:
        ray_backend.release(runner)
    return HostPrep(host, runner, runner.info["code_dir"], drafter_path, target_path, cluster.gpus, host.gpus == 0,
                    suite, target_identity=identity)


def prepare_slurm(record: RunRecord, host: Host, inventory: Inventory,
                  on_phase: Callable[[str], None] | None = None) -> HostPrep:
    """Pre-flight on a Slurm cluster (``kind: slurm``) through its login host: the partition and its
    GPUs, the environment, the worker shipped to ``workdir`` (shared storage), drafter and target
    checked there (eval/slurm.py). Its shards become one job array at the start."""
    from . import slurm as slurm_backend

    req = record.request
    phase = on_phase or (lambda _: None)
    refuse_on_cluster(host, req, "a Slurm cluster")
    gres = host.slurm.gres_problem(0 if host.gpus == 0 else req.settings.gpus_per_worker)   # as the jobs ask
    if gres:
        raise EvalError(f"host {host.name}: {gres}")
    phase("connecting")
    runner = slurm_backend.login_runner(host, inventory)
    try:
        host = host.on_host(runner.expand_home)
    except TransportError as e:
        raise EvalError(f"host {host.name}: its login host {host.slurm.login} is not reachable: {e}") from None
    lease.take(record, host, runner, bundle()[0])
    cluster = slurm_backend.cluster_info(host, runner)
    part = cluster.partition(host.slurm.partition)
    if part is None:
        raise EvalError(f"host {host.name}: no partition {host.slurm.partition or '(default)'} on the cluster (it has "
                        f"{', '.join(p.name for p in cluster.partitions) or 'none'})")
    cpu = host.gpus == 0
    if not cpu and part.gpus < req.settings.gpus_per_worker:
        raise EvalError(f"host {host.name}: partition {part.name} has {part.gpus} GPU(s), a worker needs "
                        f"{req.settings.gpus_per_worker} (set `gpus: 0` for CPU jobs)")
    report = check_host_ready(host, runner, req, gpu_here=False)
    assumed = None                  # the login node has no GPU: plan on the inventory's gpu_memory
    if not wants_cpu(req, host) and not (report.cuda or "").startswith("yes"):
        assumed = host.slurm.gpu_memory
        if assumed is None:
            raise EvalError(f"host {host.name}: its login node has no GPU to plan the target's memory against: set "
                            f"`gpu_memory:` (GiB per GPU of partition {part.name}) in its inventory entry")
    phase("pre-flight: shipping the worker, checking drafter and target on the login node")
    code_dir = ship(runner, host.python, host.workdir)
    suite = send_suite(host, runner, req)
    drafter_path, target_path, identity = check_models(host, runner, code_dir, req, suite, assumed_gpu_gb=assumed)
    return HostPrep(host, runner, code_dir, drafter_path, target_path, part.gpus, cpu, suite, cluster,
                    target_identity=identity, checked=assumed is None)


def ray_job(record: RunRecord, shard: Shard, prep: HostPrep, inventory: Inventory):
    """Place shard ``shard`` of a run on a Ray cluster: its detached actor holding its GPUs (the
    existing one when it still runs; a resumed shard goes back to its node), recorded in the run."""
    from . import ray as ray_backend

    name = ray_backend.actor_name(record.id, shard.index)
    runner = ray_backend.place(prep.host, inventory, name, 0 if prep.cpu else record.request.settings.gpus_per_worker,
                               node_id=(shard.ray or {}).get("node_id"))
    info = runner.info
    run_dir = f"{prep.host.workdir.rstrip('/')}/runs/{record.id}" + (f"/shard-{shard.index}" if shard.count > 1 else "")
    record.prepared(shard.index, run_dir=run_dir, code_dir=info["code_dir"], python=info["python"],
                    drafter_path=prep.drafter_path, target_path=prep.target_path)
    record.placed(shard.index, gpu=",".join(info["gpu_ids"]) or None,
                  ray={"address": prep.host.address, "actor": name, "actor_id": info["actor_id"],
                       "job_id": info["job_id"], "node_id": info["node_id"], "node": info["node"],
                       "gpu_ids": info["gpu_ids"]})
    return ray_backend.RayJob(runner, info["python"], info["code_dir"], run_dir)


def placements(req: EvalRequest, hosts: list[Host], preps: dict[str, HostPrep]) -> list[tuple[str, str | None]]:
    """(host, GPU id) of every shard: ``--gpus`` expanded on each host in turn."""
    spec = parse_gpus(req.gpus)
    per_worker = req.settings.gpus_per_worker
    ray_hosts = [h.name for h in hosts if h.is_ray]
    if ray_hosts and isinstance(spec, list):
        raise EvalError(f"host {ray_hosts[0]} is a Ray cluster: Ray assigns the GPUs; give --gpus N or all")
    slurm_hosts = [h.name for h in hosts if h.is_slurm]
    if slurm_hosts and isinstance(spec, list):
        raise EvalError(f"host {slurm_hosts[0]} is a Slurm cluster: Slurm assigns the GPUs; give --gpus N or all")
    if spec is not None and req.settings.target_devices == "auto":
        raise EvalError("--target-devices auto splits the target over every GPU of the host: drop --gpus, "
                        "or give --target-devices a count")
    placed = [(h.name, gpu) for h in hosts
              for gpu in group(host_gpu_ids(spec, h.name, preps[h.name].visible_gpus, h.gpus, preps[h.name].cpu),
                               per_worker)]
    prompts = req.settings.prompts
    return placed[:prompts] if prompts else placed     # no worker without a prompt


def worker_args(req: EvalRequest, shard: Shard, host: Host, resume: bool, suite: str | None = None) -> list[str]:
    """The worker's argv for ``shard`` on ``host``: where it reads and writes, the run's settings
    (``suite``: as the host reads it), and ``--checked`` (pre-flight just ran the same checks there)."""
    settings = host_settings(req, host)
    if suite is not None:
        settings = replace(settings, suite=suite)
    args = ["--target", shard.target_path, "--drafter", shard.drafter_path, "--out", f"{shard.run_dir}/out",
            *settings.to_argv(), "--host-label", host.name, "--checked"]
    sglang, _ = reference_sglang(req, host)
    if sglang:
        args += ["--sglang", sglang]
    if req.settings.engine:
        args += engine_of(host).worker_args()
    if shard.count > 1:
        args += ["--shard", f"{shard.index}/{shard.count}"]
    if resume:
        args.append("--resume")
    return args


def start(record: RunRecord, inventory: Inventory, resume: bool = False,
          on_phase: Callable[[str, str], None] | None = None, force: bool = False) -> dict[int, HostJob]:
    """Pre-flight every host once (in parallel), place the shards (``--gpus``), then start every
    worker detached, each with its GPU as ``CUDA_VISIBLE_DEVICES``. ``on_phase(host, phase)`` hears
    each step: connecting, pre-flight, starting the worker. Resuming, a finished and fetched shard
    is kept, and a worker still running or finished but not fetched (its follower was cut off: a
    killed CLI, a dropped link) is followed and fetched, not started twice. run.json is written
    before the first worker starts; a new run whose start failed gives its claimed run folder back
    (the workers it started stopped), one interrupted (Ctrl-C, a signal) keeps it, for `attach` and
    `cancel` to reach what may have started. ``force``: resume even where the finished rows were
    made with another drafter, target or worker code (:func:`refuse_mixing`; recorded in the run)."""
    try:
        with record.lock(RESUME_LOCK) if resume else nullcontext():    # a `cancel` meanwhile is seen
            return _start(record, inventory, resume, on_phase, force)
    except Exception:
        if not resume:
            record.abandon(started=False)
            lease.release(record, inventory)
        raise
    except BaseException:       # Ctrl-C, SIGTERM, SIGHUP: a worker may be starting; its run stays reachable
        if not resume:
            record.abandon()
        raise


def _abandon(placed: list, launched: list) -> int:
    """A start that failed part way: stop the workers it started and give back the Ray actors it
    placed (their GPUs), so nothing runs or holds a GPU without a run record to cancel it from.
    Returns how many placed shards were given back."""
    for job in launched:
        try:
            job.cancel()
        except Exception:  # noqa: BLE001 — best effort; the start's own error is what the user sees
            pass
    freed = [job for job in placed if getattr(job.runner, "created", False)]
    for job in freed:
        from . import ray as ray_backend

        ray_backend.release(job.runner)
    return len(freed)


def worker_env(shard: Shard, starting: list[Shard], cpu: bool, scheduled: bool = False) -> dict[str, str] | None:
    """A worker's environment: its GPUs (``scheduled``: a scheduler gives them, not us), or on CPU
    how many workers of the run start on its host (each takes its share of the cores:
    remote/worker.py's share_cores)."""
    env = {"CUDA_VISIBLE_DEVICES": shard.gpu} if shard.gpu is not None and not scheduled else {}
    if cpu:
        env[CPU_WORKERS_ENV] = str(sum(1 for s in starting if s.host == shard.host))
    return env or None


def _start(record: RunRecord, inventory: Inventory, resume: bool,
           on_phase: Callable[[str, str], None] | None, force: bool = False) -> dict[int, HostJob]:
    req = record.request
    clusters = [h for h in dict.fromkeys(req.hosts) if inventory.get(h).is_ray]
    if len(clusters) > 1:
        raise EvalError(f"one Ray cluster per run (a process is the Ray Client of one cluster): {', '.join(clusters)}")
    todo = [s for s in record.shards if not (resume and s.state == State.DONE and s.fetched)]   # resume: the rest
    names = list(dict.fromkeys(req.hosts if not resume else [s.host for s in todo]))

    def prepare(name: str) -> HostPrep:
        host = inventory.get(name)
        return (prepare_cluster if host.is_ray else prepare_slurm if host.is_slurm else prepare_host)(
            record, host, inventory, on_phase=(lambda phase: on_phase(name, phase)) if on_phase else None)

    preps = dict(zip(names, parallel(prepare, names)))
    if not resume:
        record.place(placements(req, [inventory.get(h) for h in req.hosts], preps))
        todo = record.shards
    jobs, placed, launched, started = {}, [], [], []
    code_before = {s.index: s.code_dir for s in todo}
    try:
        for s in todo:
            prep = preps[s.host]
            if prep.host.is_ray:
                jobs[s.index] = ray_job(record, s, prep, inventory)
                placed.append(jobs[s.index])
                continue
            run_dir = f"{prep.host.workdir.rstrip('/')}/runs/{record.id}" + (f"/shard-{s.index}" if s.count > 1 else "")
            record.prepared(s.index, run_dir=run_dir, code_dir=prep.code_dir, python=prep.host.python,
                            drafter_path=prep.drafter_path, target_path=prep.target_path)
            jobs[s.index] = job_for(prep.host, prep.runner, inventory, prep.code_dir, run_dir)
        if not resume:
            record.save()       # before any worker starts: an interrupt from here on leaves a run `runs` lists
        states = {s.index: jobs[s.index].status() for s in todo} if resume else {}
        if resume:
            refuse_if_cancelled(record)     # a cancel during pre-flight wins over what a resume would refuse
            refuse_mixing(record, [s for s in todo if states[s.index].get("state") not in (State.RUNNING, State.QUEUED,
                                                                                            State.DONE)],
                          jobs, states, code_before, {s.index: preps[s.host].target_identity for s in todo}, force)
        with record.lock():     # a `cancel` now waits, and one that came during pre-flight is seen
            if resume:
                refuse_if_cancelled(record)
            for s in todo:
                job, host = jobs[s.index], inventory.get(s.host)
                if resume and states[s.index].get("state") in (State.RUNNING, State.QUEUED, State.DONE):
                    continue        # still going, or finished and not yet fetched: followed, not redone
                if on_phase:
                    on_phase(s.host, "starting the worker")
                _, auth = reference_sglang(req, host)
                args = worker_args(req, s, host, resume=resume, suite=preps[s.host].suite)
                if not preps[s.host].checked:
                    args.remove("--checked")        # the worker checks on its own node's GPU
                job.start(args,
                          secrets={AUTH_ENV: auth} if auth else None,
                          env=worker_env(s, todo, preps[s.host].cpu, scheduled=host.is_slurm), fresh=not resume)
                launched.append(job)
                started.append(s)
            submit_arrays(record, started, preps, inventory)
            record.started(shards=[s.index for s in todo])
    except BaseException as e:
        freed = _abandon(placed, launched)
        if freed and isinstance(e, OperationFailed):
            raise EvalError(f"{e}; the {freed} shard(s) of this run placed before were released (their GPUs "
                            f"are free again)") from None
        raise
    return jobs


def refuse_if_cancelled(record: RunRecord) -> None:
    if record.cancelled_meanwhile():
        raise RunCancelled(f"run {record.id} was cancelled while `eval --resume` prepared it; no worker was started")


def refuse_mixing(record: RunRecord, restarting: list[Shard], jobs: dict[int, HostJob], states: dict[int, dict],
                  code_before: dict[int, str], targets: dict[int, dict | None] | None = None,
                  force: bool = False) -> None:
    """A resume continues a run only with what its finished rows were made with: the same worker
    code (its shipped folder's digest), the same drafter weights (the sha256 the worker recorded
    in env.json, against the files there now) and the same target (its identity in env.json against
    ``targets``: pre-flight's, now). Else one line naming the change, and nothing starts: one run is
    one measurement. ``force``: each change is recorded in the run instead (run.json, then the
    merged env.json and the report), and the resume goes on."""
    new_run = (f"start a new run of it: dflash-ops eval --drafter {record.request.drafter_ref} "
               + " ".join(f"--host {h}" for h in record.request.hosts)
               + f" (with the settings `dflash-ops show {record.id}` lists)")
    changes: list[dict] = []

    def changed(s: Shard, what: str, change: str, refusal: str) -> None:
        if not force:
            raise EvalError(f"run {record.id}: {refusal} (or `dflash-ops eval --resume {record.id} --force` resumes "
                            f"anyway, recorded in the run)")
        changes.append({"at": now_iso(), "shard": s.label, "what": what, "change": change})

    for s in restarting:
        done = max(s.done, states[s.index].get("done") or 0)
        if not done:
            continue
        made = f"since its {done} finished prompt(s) were made"
        before, now = code_before[s.index].rpartition("/")[2], s.code_dir.rpartition("/")[2]
        if before and before != now:
            change = f"worker code {before} then, {now} now"
            changed(s, "worker code", change,
                    f"dflash-ops changed since its {done} finished prompt(s) on {s.label} were made ({change}); a "
                    f"resume would mix two worker versions in one run: {new_run}, or resume it with the dflash-ops "
                    f"that started it")
        job = jobs[s.index]
        env = job.recorded_env() or {}
        recorded = (env.get("drafter") or {}).get("sha256") if isinstance(env.get("drafter"), dict) else None
        if isinstance(recorded, dict) and recorded:
            current = job.digest(s.drafter_path, sorted(recorded))
            names = [name for name in sorted(recorded) if current.get(name) != recorded[name]]
            if names:
                name, now_sha = names[0], current.get(names[0])
                change = (f"{name}: sha256 {str(recorded[name])[:12]} then, "
                          + (f"{now_sha[:12]} now" if now_sha else "gone now")
                          + (f"; {len(names) - 1} more file(s)" if len(names) > 1 else ""))
                changed(s, "drafter", change,
                        f"the drafter's weights in {s.drafter_path} on {s.host} changed {made} ({change}); a resume "
                        f"would mix two checkpoints in one run: {new_run}, or put those weights back")
        then = (env.get("target") or {}).get("identity") if isinstance(env.get("target"), dict) else None
        change = target_change(then, (targets or {}).get(s.index))
        if change:
            changed(s, "target", change,
                    f"the target in {s.target_path} on {s.host} changed {made} ({change}); a resume would mix two "
                    f"targets in one run: {new_run}, or put the target back")
    if changes:
        record.forced_resume(changes)


def target_change(then, now) -> str | None:
    """How a target's identity (remote/target/memory.py ``identity``: config.json's sha256, the
    weight files' sizes) differs between the one recorded with the finished rows and now; None
    when it does not, or when either is unknown (a hub id, a run of an older worker)."""
    if not isinstance(then, dict) or not isinstance(now, dict):
        return None
    if then.get("config_sha256") != now.get("config_sha256"):
        return f"config.json: sha256 {str(then.get('config_sha256'))[:12]} then, {str(now.get('config_sha256'))[:12]} now"
    before, after = then.get("weights"), now.get("weights")
    if not isinstance(before, dict) or not isinstance(after, dict):
        return None
    changed = [name for name in sorted(set(before) | set(after)) if before.get(name) != after.get(name)]
    if not changed:
        return None
    size = lambda n: "none" if n is None else f"{n} bytes"    # noqa: E731
    name = changed[0]
    return (f"{name}: {size(before.get(name))} then, {size(after.get(name))} now"
            + (f"; {len(changed) - 1} more file(s)" if len(changed) > 1 else ""))


def job_for(host: Host, runner, inventory: Inventory, code_dir: str, run_dir: str) -> HostJob:
    """The job of a run folder on an SSH host, or of a Slurm task (run control on its login host)."""
    if host.is_slurm:
        from .slurm import SlurmJob, login_python

        return SlurmJob(runner, login_python(host, inventory), code_dir, run_dir, job_python=host.python)
    return HostJob(runner, host.python, code_dir, run_dir)


def submit_arrays(record: RunRecord, started: list[Shard], preps: dict[str, HostPrep], inventory: Inventory) -> None:
    """The shards just made ready on Slurm clusters, one job array per cluster (task k = shard k)."""
    from . import slurm as slurm_backend

    for name in dict.fromkeys(s.host for s in started):
        prep = preps[name]
        if not prep.host.is_slurm:
            continue
        shards = [s for s in started if s.host == name]
        slurm_backend.submit(record, prep.host, shards, prep.runner, slurm_backend.login_python(prep.host, inventory),
                             prep.code_dir, 0 if prep.cpu else record.request.settings.gpus_per_worker, prep.cluster)


def jobs_of(record: RunRecord, inventory: Inventory, shards: list[Shard] | None = None) -> dict[int, HostJob]:
    """The started workers of a run (or of ``shards`` of it), to follow or cancel them (a Ray
    shard through its actor, or a 0-GPU one on the same node when the actor is gone)."""
    def job(s: Shard) -> HostJob:
        host = inventory.get(s.host)
        if host.is_slurm:
            from .slurm import login_runner

            runner = login_runner(host, inventory)
            there = host.on_host(runner.expand_home)
            check_shard(record.id, s, there)
            return job_for(there, runner, inventory, s.code_dir, s.run_dir)
        if not host.is_ray:
            runner = runner_for(host, inventory)
            there = host.on_host(runner.expand_home)
            check_shard(record.id, s, there)
            return HostJob(runner, there.python, s.code_dir, s.run_dir)
        from . import ray as ray_backend

        runner = ray_backend.place(host, inventory, ray_backend.actor_name(record.id, s.index), 0,
                                   node_id=(s.ray or {}).get("node_id"), strict_node=True)
        try:
            check_shard(record.id, s, host.on_host(runner.expand_home), code=False)   # code: the actor's own
        except InputError:
            if runner.created:
                ray_backend.release(runner)
            raise
        return ray_backend.RayJob(runner, runner.info["python"], runner.info["code_dir"], s.run_dir)

    return {s.index: job(s) for s in (record.shards if shards is None else shards)}


# ----------------------------------------------------------------------------- following

def reattach(record: RunRecord, jobs: dict[int, HostJob]) -> list[str]:
    """`attach`: every shard is followed and its files fetched again, but for a finished, fetched
    shard whose folder on its host is gone (removed to free space): its files here are all there
    is of it, and stay as they are. Returns one line for each shard so kept."""
    gone = [s for s in record.shards
            if s.fetched and s.state == State.DONE and jobs[s.index].folder_gone()]
    record.following(keep=[s.index for s in gone])
    return [f"{s.label}: its folder on the host ({s.run_dir}) is gone; the results fetched before are kept as "
            f"they are" for s in gone]


@dataclass
class Followed:
    """Why shards were not followed to their end and fetched (shard index -> why)."""
    lost: dict[int, str]            # contact lost (its worker keeps running), or its files did not come
    stalled: dict[int, float]       # its worker, alive, wrote no event for this many seconds
    disk: dict[int, OSError]        # this machine's disk (full, read-only) refused a file of the run


def stall_limits(record: RunRecord, inventory: Inventory, minutes: float | None = None) -> dict[int, float | None]:
    """{shard index: seconds without an event from its worker after which following it ends, or
    None: never}: ``minutes`` (`--stall-minutes`), else its host's ``stall_minutes``; 0 is never."""
    def limit(s: Shard) -> float | None:
        m = minutes if minutes is not None else inventory.get(s.host).stall_minutes
        return m * 60 if m > 0 else None

    return {s.index: limit(s) for s in record.shards}


def follow(record: RunRecord, jobs: dict[int, HostJob], on_event: Callable[[int, dict], None],
           stall: dict[int, float | None] | None = None) -> Followed:
    """Follow every unfetched shard at once until its worker ends, then fetch its files.
    ``on_event(shard index, event)`` sees every worker event; ``stall``: :func:`stall_limits`
    (default: none). KeyboardInterrupt propagates (the workers keep running)."""
    out = Followed({}, {}, {})

    def follow_one(i: int) -> None:
        shard, job = record.shards[i], jobs[i]
        told: dict = {}                 # what a Slurm task's scheduler said last
        try:
            for ev in job.follow(stall_s=(stall or {}).get(i)):
                if ev.get(events.KEY) == events.SCHEDULER:
                    told = ev
                on_event(i, ev)
                record.shard_progressed(i, ev)
                if ev.get(events.KEY) == events.EXIT:
                    record.shard_exited(i, ev)
                    job.fetch(shard.local_dir(record.folder), required=RESULTS if ev.get("state") == "done" else ())
                    record.shard_fetched(i)
        except WorkerStalled as e:
            out.stalled[i] = e.seconds
        except FetchFailed as e:
            out.lost[i] = f"{e}; they stay on the host: dflash-ops attach {record.id} fetches them again"
        except Exception as e:  # noqa: BLE001 — reported to the caller; the worker itself keeps running
            if disk_error(e):
                out.disk[i] = e
            elif told.get("state") == State.UNKNOWN:      # Slurm did not answer for as long as the host waits
                out.lost[i] = f"{shard.label}: its state is unknown: {told.get('why')}"
            else:
                out.lost[i] = f"lost contact with {shard.host}: {e}"

    threads = [threading.Thread(target=follow_one, args=(i,), daemon=True)
               for i, s in enumerate(record.shards) if not s.fetched]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.2)
    return out


def local_write_failed(record: RunRecord, e: OSError, shards: list[Shard]) -> LocalWriteFailed:
    """The one line for a run file this machine's disk refused (full, read-only): nothing is lost,
    what waits on the host, and the command that finishes the run once the disk takes files again."""
    def where(s: Shard) -> str:
        ended = s.state not in (State.PENDING, State.RUNNING)
        return (f"{s.label}: " + (f"its worker ended ({s.state})" if ended else "its worker keeps running")
                + f", its results are safe on the host in {s.run_dir}")

    return LocalWriteFailed(f"cannot write to {record.folder} on this machine: {e.strerror or e}; nothing "
                            f"is lost ({'; '.join(map(where, shards))}): once space is freed (or the disk is "
                            f"writable again), dflash-ops attach {record.id} fetches them and writes the report")


def stalled_line(record: RunRecord, followed: Followed, stall: dict[int, float | None]) -> str:
    """The one line for shards whose workers made no progress for their stall limit (and any whose
    contact was lost meanwhile): what each had done, and how to go on."""
    def stalled(i: int) -> str:
        s = record.shards[i]
        return (f"{s.label}: no progress from its worker for {(stall.get(i) or followed.stalled[i]) / 60:g} min "
                + (f"({s.done} of {s.prompts} prompts done) " if s.prompts is not None else "")
                + "although it is alive")

    parts = [stalled(i) for i in sorted(followed.stalled)] + [followed.lost[i] for i in sorted(followed.lost)]
    return (f"run {record.id} stalled: {'; '.join(parts)}. Its workers are left running: dflash-ops attach "
            f"{record.id} follows them again (--stall-minutes M waits longer, 0 for ever), dflash-ops cancel "
            f"{record.id} stops them")


def merge_shards(run_dir: Path, shards: list[Shard], forced: list[dict] = ()) -> dict:
    """Merge shard folders (``run_dir/shard-k``, or the run folder itself for one shard) into
    ``run_dir``'s results.jsonl / summary.json / env.json, in suite order; ``forced``: what a
    `--resume --force` changed (run.json's), recorded in env.json. The files are read as reports
    read them (runs/folders.py: untrusted, checked); a prompt id found twice refuses the merge
    (:class:`DuplicatePrompts`) before anything is written."""
    from remote.contract.metrics import summarize

    from ..runs.folders import load_run

    parts = [load_run(s.local_dir(run_dir)) for s in shards]
    for part in parts:
        if not part.env:
            raise EvalError(f"{part.path / 'env.json'}: not there; dflash-ops attach {run_dir.name} fetches it again")
    refuse_duplicates(run_dir, [(part.path / "results.jsonl", part.results) for part in parts])
    if len(shards) == 1:
        summary = parts[0].summary
        if summary is None:
            raise EvalError(f"{run_dir / 'summary.json'}: not there; dflash-ops attach {run_dir.name} fetches it again")
        record_placement(run_dir, shards, dict(parts[0].env), forced)
        return summary
    rows_by_id, order = {}, {}
    for s, part in zip(shards, parts):
        for j, rid in enumerate((part.env.get("suite") or {}).get("ids") or []):
            order[rid] = s.index + j * s.count
        rows_by_id.update((row["id"], row) for row in part.results)
    rows = sorted(rows_by_id.values(), key=lambda r: order.get(r["id"], 1 << 30))
    first = parts[0]
    summary = summarize(rows, first.block_size, first.settings.get("mode"), max_length=first.max_length)
    envs = [part.env for part in parts]
    env = dict(envs[0])
    env["host"] = ",".join(str(e.get("host")) for e in envs)
    env["suite"] = {**(env.get("suite") or {}), "ids": [r["id"] for r in rows], "shard": None}
    env["shards"] = envs
    write_atomic(run_dir / "results.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    record_placement(run_dir, shards, env, forced)
    write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
    return summary


def refuse_duplicates(run_dir: Path, files: list[tuple[Path, list[dict]]]) -> None:
    """One line naming every prompt id found more than once in ``files`` (results.jsonl and its
    rows), and where; nothing is merged or written then."""
    where: dict[str, list[str]] = {}
    for path, rows in files:
        shown = str(path.relative_to(run_dir)) if path.is_relative_to(run_dir) else str(path)
        for row in rows:
            where.setdefault(row["id"], []).append(shown)
    twice = {pid: places for pid, places in where.items() if len(places) > 1}
    if not twice:
        return
    def places(found: list[str]) -> str:
        return ", ".join(f"{f} ×{found.count(f)}" if found.count(f) > 1 else f for f in dict.fromkeys(found))

    named = [f"{pid} ({places(found)})" for pid, found in list(twice.items())[:5]]
    raise DuplicatePrompts(f"run {run_dir.name}: {len(twice)} prompt id(s) more than once in its results: "
                           + "; ".join(named) + (f"; and {len(twice) - 5} more" if len(twice) > 5 else "")
                           + f"; nothing was merged or reported (the files in {run_dir} are as they came): rows of "
                           f"two workers in one folder? Start a new run of it")


def record_placement(run_dir: Path, shards: list[Shard], env: dict | None = None, forced: list[dict] = ()) -> None:
    """env.json's ``placement``: how the run ran (backend ``ssh``, ``ray`` or ``slurm``, hosts, one
    entry per shard with its GPU; on Ray the job, actor and node ids and the GPUs Ray assigned; on
    Slurm the job array, each task's node and the GPUs Slurm gave it, as the task saw them);
    ``env``: the env.json to write (default: the one there); ``forced``: what a `--resume --force`
    resumed despite (run.json's), recorded as env.json's ``forced``."""
    path = run_dir / "env.json"
    env = json.loads(path.read_text()) if env is None else env
    ray = [s.ray for s in shards if s.ray]
    slurm = {s.index: {**s.slurm, **_task_placement(s.local_dir(run_dir))} for s in shards if s.slurm}
    env["placement"] = {"backend": "ray" if ray else "slurm" if slurm else "ssh",
                        "hosts": list(dict.fromkeys(s.host for s in shards)),
                        "gpus": [s.gpu for s in shards if s.gpu is not None],
                        "shards": [{"index": s.index, "count": s.count, "host": s.host, "gpu": s.gpu,
                                    **({"ray": s.ray} if s.ray else {}),
                                    **({"slurm": slurm[s.index]} if s.index in slurm else {})} for s in shards]}
    if ray:
        env["placement"]["ray_job_ids"] = list(dict.fromkeys(r["job_id"] for r in ray))
    if slurm:
        tasks = list(slurm.values())
        env["placement"]["slurm"] = {
            "cluster": tasks[0].get("cluster"), "version": tasks[0].get("version"),
            "job_ids": list(dict.fromkeys(t["job"] for t in tasks)), "array_task_ids": [t["task"] for t in tasks],
            "nodes": list(dict.fromkeys(t["node"] for t in tasks if t.get("node"))),
            "partition": tasks[0].get("partition")}
    if forced:
        env["forced"] = list(forced)
    write_atomic(path, json.dumps(env, indent=2))


def _task_placement(folder: Path) -> dict:
    """Where a Slurm task ran, as it wrote it on its node (remote/host/slurm.py ``placement.json``)."""
    try:
        got = json.loads((folder / "placement.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(got, dict):
        return {}
    keep = {"node": str, "job_id": str, "cluster": str, "partition": str, "cuda_visible_devices": str,
            "job_gpus": str, "restarts": int}
    return {k: got[k] for k, kind in keep.items() if isinstance(got.get(k), kind)}


def complete(record: RunRecord, jobs: dict[int, HostJob], on_event: Callable[[int, dict], None],
             stall: dict[int, float | None] | None = None) -> tuple[dict, tuple[Path, Path] | None]:
    """Follow a started run to its end, then fetch, merge and report it (:func:`finish`). A shard
    whose contact was lost raises :class:`RunUnfinished` (its worker keeps running), one whose
    worker made no progress for its ``stall`` limit :class:`RunStalled` (left running), a file
    this machine's disk refused :class:`LocalWriteFailed`."""
    followed = follow(record, jobs, on_event, stall)
    if followed.disk:
        raise local_write_failed(record, next(iter(followed.disk.values())),
                                 [s for s in record.shards if s.index in followed.disk])
    if followed.stalled:
        raise RunStalled(stalled_line(record, followed, stall or {}))
    if followed.lost:
        raise RunUnfinished("; ".join(followed.lost.values()) + f". The workers keep running; re-attach with: "
                            f"dflash-ops attach {record.id}")
    return finish(record)


def finish(record: RunRecord) -> tuple[dict, tuple[Path, Path] | None]:
    """After following: a finished run is merged and reported: (summary, report paths). A run
    with an unfetched shard raises :class:`RunUnfinished`, one with a failed worker
    :class:`EvalError` (the caller shows the failed shards' logs first, see :func:`failed_logs`),
    one whose files this machine's disk refuses :class:`LocalWriteFailed` (the run is recorded
    done only once merged)."""
    try:
        return _finish(record)
    except OSError as e:
        if not disk_error(e):
            raise
        raise local_write_failed(record, e, record.shards) from None


def _finish(record: RunRecord) -> tuple[dict, tuple[Path, Path] | None]:
    outcome = record.settle(save=False)
    if outcome != "done":
        record.save()
    if outcome == "cancelled":
        raise EvalError(f"run {record.id} was cancelled; finished prompts are kept: dflash-ops eval --resume "
                        f"{record.id} continues it")
    if outcome == "unfinished":
        raise RunUnfinished(f"not all shards finished and were fetched; their workers keep running (or their "
                            f"files wait on the host). Re-attach with: dflash-ops attach {record.id}")
    if outcome == "failed":
        invalid = [s for s in record.shards if s.exit_code == exits.INVALID]
        if invalid:
            s = invalid[0]
            summary = s.local_dir(record.folder) / "summary.json"
            try:
                why = json.loads(summary.read_text())["invalid"]["message"]
            except (OSError, ValueError, KeyError, TypeError):
                why = f"the worker reported invalid results ({summary} unreadable)"
            raise InvalidRun(f"run {record.id} is invalid: on {s.label}, {why}")
        hosts = ", ".join(f"{s.label} (" + (f"shard {s.index + 1}/{s.count}, " if s.count > 1 else "")
                          + f"state {s.state}, exit code {s.exit_code}" + (f": {s.why}" if s.why else "") + ")"
                          for s in record.shards if s.state != State.DONE)
        raise EvalError(f"the worker failed on {hosts}; finished prompts are kept: "
                        f"dflash-ops eval --resume {record.id}")
    try:
        summary = merge_shards(record.folder, record.shards, record.forced)
    except DuplicatePrompts:
        record.unmergeable()
        raise
    record.save()
    from ..reports.report import write_report

    return summary, write_report(record.folder)


def failed_logs(record: RunRecord, jobs: dict[int, HostJob], lines: int = 25) -> dict[str, str]:
    """{shard label: the last lines of its worker log} for the shards that did not end ``done``."""
    out = {}
    for s in record.shards:
        if s.fetched and s.state != State.DONE:
            log = s.local_dir(record.folder) / "worker.log"
            text = log.read_text(errors="replace") if log.exists() else None   # a host's log: any bytes
            tail = "\n".join(text.splitlines()[-lines:]) if text is not None else jobs[s.index].log_tail(lines)
            out[s.label] = tail
    return out


def cancel(record: RunRecord, inventory: Inventory) -> dict[str, dict]:
    """Stop what still runs of a run (finished prompts stay on the hosts); {shard label: its
    worker's state, ``cancelled`` where this stopped it}. Only what is unfinished is cancelled: a
    worker that had ended by itself is fetched instead, and a run with nothing left running keeps
    its outcome (a finished run stays done, and is merged and reported). A run an `eval --resume`
    is preparing is cancelled even with nothing running yet: that resume then starts nothing."""
    from .slurm import SlurmError

    with record.lock():            # not while a start is starting workers: before it, or after it
        record.refresh()
        live = [s for s in record.shards if not s.fetched]
        jobs = jobs_of(record, inventory, live)
        states = {s.index: jobs[s.index].cancel() for s in live}
        unconfirmed = slurm_unconfirmed(live, states)
        if unconfirmed:                     # nothing is marked: the task may still run (cancel again)
            raise SlurmError(f"run {record.id} is not cancelled: {unconfirmed}; nothing was marked cancelled: "
                             f"dflash-ops cancel {record.id} again once Slurm answers")
        stopped, ended = [], []
        for s in live:
            st = states[s.index]
            if (not st.get("signalled", st.get("state") != State.DONE) and st.get("state") in (State.DONE, State.FAILED)
                    and s.state != State.CANCELLED) or st.get("foreign"):
                ended.append(s)             # it had ended by itself, not by this or an earlier cancel (or is gone)
            else:
                stopped.append(s.index)
        for s in ended:
            record.shard_exited(s.index, states[s.index])
            try:
                jobs[s.index].fetch(s.local_dir(record.folder), required=RESULTS if s.state == State.DONE else ())
                record.shard_fetched(s.index)
            except FetchFailed as e:
                states[s.index]["fetch"] = str(e)
        if stopped or record.being_resumed():
            record.cancelled(stopped)
            lease.release(record, inventory)
        elif ended:
            try:
                finish(record)      # done: merged and reported; failed or unfetched: settled as such
            except EvalError:
                pass
    foreign = [f"{s.label}: {states[s.index]['why']}" for s in live if states[s.index].get("foreign")]
    if foreign:
        raise SlurmError(f"run {record.id}: {'; '.join(foreign)}")
    return {record.shards[i].label: {**st, "state": "cancelled"} if i in stopped else st for i, st in states.items()}


def slurm_unconfirmed(shards: list[Shard], states: dict[int, dict]) -> str:
    """Why the cancel of Slurm tasks among ``shards`` is not known done, in one line ('' when it
    is): a task is cancelled only once Slurm said it ended; Slurm not answering (or a login host
    that did not) is no such word."""
    why = []
    for s in shards:
        st = states[s.index]
        if s.slurm is not None and (st.get("unconfirmed") or st.get("state") not in
                                    (State.CANCELLED, State.DONE, State.FAILED, State.LOST)):
            why.append(f"{s.label}: {st.get('unconfirmed') or st.get('error') or st.get('why') or st.get('state')}")
    return "; ".join(why)
