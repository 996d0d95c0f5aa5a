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
from contextlib import nullcontext
from dataclasses import dataclass, replace
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from remote.contract import events
from remote.contract import exits
from remote.contract.credentials import AUTH_ENV, split_credentials
from remote.contract.settings import BUILTIN_SUITES, CPU_WORKERS_ENV, SPECFORGE, EvalSettings
from remote.contract.states import State

from ..config.catalog import EMBEDDED
from ..config.inventory import Host, Inventory
from ..config.paths import read_config_text
from ..errors import InputError, OperationFailed
from ..runs.record import RESUME_LOCK, EvalRequest, RunRecord, Shard, write_atomic
from ..transport import TransportError, runner_for
from .jobs import RESULTS, FetchFailed, HostJob, check_shard
from .placement import group, host_gpu_ids, parse_gpus, visible_gpus
from .ship import ship

PREFLIGHT = "remote.preflight"   # the drafter/target compatibility check and memory plan


class EvalError(OperationFailed):
    """A clear, user-facing reason the eval cannot run (or failed)."""


class RunUnfinished(EvalError):
    """Some shard was not followed to its end (contact lost); its worker keeps running."""

    exit_code = 4


class RunCancelled(EvalError):
    """`cancel` came while `eval --resume` was preparing the run: nothing was started."""


class InvalidRun(EvalError):
    """A worker found its greedy online output differing from the target's own: no τ of the run is
    a result (the rows are kept, the summary is marked invalid)."""

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
                 timeout: float = 600) -> tuple[dict | None, str]:
    res = runner.run([python, "-m", module, *args], timeout=timeout, env={"PYTHONPATH": code_dir}, cwd=code_dir)
    try:
        return json.loads(res.stdout), res.stderr
    except json.JSONDecodeError:
        return None, (res.stderr or res.stdout).strip()


def check_host_ready(host: Host, runner, req: EvalRequest):
    """The host's probe report through ``runner``, once it passed (reachable, ML stack, disk, CUDA
    when wanted)."""
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
                        f"(need {req.min_free_gb:g} GiB for the worker and its results)")
    if wants_gpu and not (report.cuda or "").startswith("yes"):
        raise EvalError(f"host {host.name}: no CUDA GPU visible to torch (pass --device cpu to run on CPU, "
                        f"or set `gpus: 0` for it in the inventory)")
    return report


def embedded_models(host: Host, runner, code_dir: str) -> tuple[str, str]:
    """Build (first use) or find the embedded demo target + drafter in the host's workdir."""
    out = f"{host.workdir.rstrip('/')}/embedded"
    res, err = _python_json(runner, host.python, code_dir, "remote.embedded", "--out", out, timeout=900)
    if res is None:
        raise EvalError(f"host {host.name}: building the embedded demo models failed: {err[-800:]}")
    return res["drafter"], res["target"]


def locate_models(host: Host, runner, code_dir: str, req: EvalRequest) -> tuple[str, str]:
    """(drafter folder, target folder) on ``host`` for the request, whose names were resolved
    before it was made (orchestrator/names.py): a folder, a training run's checkpoint folder
    under the host's ``checkpoints`` root, or the embedded demo pair. That they exist and fit is
    pre-flight's to say (:func:`check_models`), in the same call to the host."""
    embedded = req.drafter_ref == EMBEDDED or req.target == EMBEDDED
    drafter, target = embedded_models(host, runner, code_dir) if embedded else (None, None)
    if req.drafter_ref != EMBEDDED:
        if req.drafter_run:
            if not host.checkpoints:
                raise EvalError(f"host {host.name}: no `checkpoints` root in the inventory")
            drafter = f"{host.checkpoints.rstrip('/')}/{req.drafter_run}/{req.checkpoint}"
        elif req.drafter_path:
            drafter = runner.absolute(req.drafter_path)
        else:
            raise EvalError(f"the run's request names no drafter folder ({req.drafter_ref}); start a new eval")
    if req.target != EMBEDDED:
        target = runner.absolute(req.target_path) if _is_folder(req.target_path) else req.target_path
    return drafter, target


def _is_folder(target: str | None) -> bool:
    """A target named by a folder (``/x``, ``~/x``, ``./x``, ``a/b/c``), not a hub model id (``org/name``)."""
    return bool(target) and (target.startswith(("/", "~", ".")) or target.count("/") >= 2)


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
    report = check_host_ready(host, runner, req)
    if req.settings.engine:
        check_engine(host, runner)
    embedded = req.drafter_ref == EMBEDDED or req.target == EMBEDDED
    phase("pre-flight: shipping the worker, " + ("building the embedded demo pair (first use on a host: about a "
                                                 "minute on CPU), " if embedded else "")
          + "checking drafter and target")
    code_dir = ship(runner, host.python, host.workdir)
    suite = send_suite(host, runner, req)
    drafter_path, target_path = check_models(host, runner, code_dir, req, suite)
    return HostPrep(host, runner, code_dir, drafter_path, target_path, visible_gpus(report.raw), wants_cpu(req, host),
                    suite)


def check_models(host: Host, runner, code_dir: str, req: EvalRequest, suite: str) -> tuple[str, str]:
    """(drafter folder, target folder) on the host, located, inspected for compatibility and
    planned against its memory (remote/preflight.py: one process, before any weights load)."""
    drafter_path, target_path = map(runner.expand_home, locate_models(host, runner, code_dir, req))
    settings = replace(req.settings, device="cpu" if wants_cpu(req, host) else "cuda", suite=suite)
    args = [drafter_path, "--target", target_path, "--cache", f"{code_dir}/preflight", *settings.to_argv()]
    if req.verify_weights:
        args.append("--verify-hashes")
    found, err = _python_json(runner, host.python, code_dir, PREFLIGHT, *args, timeout=1800)
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
    return drafter_path, target_path


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
    if req.settings.engine:
        raise EvalError(f"host {host.name} is a Ray cluster: --engine runs on an SSH eval host with `engine:` in "
                        f"the inventory")
    if req.settings.target_devices == "auto":
        raise EvalError(f"host {host.name} is a Ray cluster: give --target-devices a count (GPUs per worker)")
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
        drafter_path, target_path = check_models(host, runner, runner.info["code_dir"], req, suite)
    finally:
        ray_backend.release(runner)
    return HostPrep(host, runner, runner.info["code_dir"], drafter_path, target_path, cluster.gpus, host.gpus == 0,
                    suite)


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
          on_phase: Callable[[str, str], None] | None = None) -> dict[int, HostJob]:
    """Pre-flight every host once (in parallel), place the shards (``--gpus``), then start every
    worker detached, each with its GPU as ``CUDA_VISIBLE_DEVICES``. ``on_phase(host, phase)`` hears
    each step: connecting, pre-flight, starting the worker. Resuming, a finished and fetched shard
    is kept, and a worker still running or finished but not fetched (its follower was cut off: a
    killed CLI, a dropped link) is followed and fetched, not started twice. run.json is written
    before the first worker starts; a new run whose start failed gives its claimed run folder back
    (the workers it started stopped), one interrupted (Ctrl-C, a signal) keeps it, for `attach` and
    `cancel` to reach what may have started."""
    try:
        with record.lock(RESUME_LOCK) if resume else nullcontext():    # a `cancel` meanwhile is seen
            return _start(record, inventory, resume, on_phase)
    except Exception:
        if not resume:
            record.abandon(started=False)
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


def worker_env(shard: Shard, starting: list[Shard], cpu: bool) -> dict[str, str] | None:
    """A worker's environment: its GPUs, or on CPU how many workers of the run start on its host
    (each takes its share of the cores: remote/worker.py's share_cores)."""
    env = {"CUDA_VISIBLE_DEVICES": shard.gpu} if shard.gpu is not None else {}
    if cpu:
        env[CPU_WORKERS_ENV] = str(sum(1 for s in starting if s.host == shard.host))
    return env or None


def _start(record: RunRecord, inventory: Inventory, resume: bool,
           on_phase: Callable[[str, str], None] | None) -> dict[int, HostJob]:
    req = record.request
    clusters = [h for h in dict.fromkeys(req.hosts) if inventory.get(h).is_ray]
    if len(clusters) > 1:
        raise EvalError(f"one Ray cluster per run (a process is the Ray Client of one cluster): {', '.join(clusters)}")
    todo = [s for s in record.shards if not (resume and s.state == State.DONE and s.fetched)]   # resume: the rest
    names = list(dict.fromkeys(req.hosts if not resume else [s.host for s in todo]))

    def prepare(name: str) -> HostPrep:
        host = inventory.get(name)
        return (prepare_cluster if host.is_ray else prepare_host)(
            record, host, inventory, on_phase=(lambda phase: on_phase(name, phase)) if on_phase else None)

    preps = dict(zip(names, parallel(prepare, names)))
    if not resume:
        record.place(placements(req, [inventory.get(h) for h in req.hosts], preps))
        todo = record.shards
    jobs, placed, launched = {}, [], []
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
            jobs[s.index] = HostJob(prep.runner, prep.host.python, prep.code_dir, run_dir)
        if not resume:
            record.save()       # before any worker starts: an interrupt from here on leaves a run `runs` lists
        states = {s.index: jobs[s.index].status() for s in todo} if resume else {}
        if resume:
            refuse_mixing(record, [s for s in todo if states[s.index].get("state") not in (State.RUNNING, State.DONE)],
                          jobs, states, code_before)
        with record.lock():     # a `cancel` now waits, and one that came during pre-flight is seen
            if resume and record.cancelled_meanwhile():
                raise RunCancelled(f"run {record.id} was cancelled while `eval --resume` prepared it; no worker "
                                   f"was started")
            for s in todo:
                job, host = jobs[s.index], inventory.get(s.host)
                if resume and states[s.index].get("state") in (State.RUNNING, State.DONE):
                    continue        # still going, or finished and not yet fetched: followed, not redone
                if on_phase:
                    on_phase(s.host, "starting the worker")
                _, auth = reference_sglang(req, host)
                job.start(worker_args(req, s, host, resume=resume, suite=preps[s.host].suite),
                          secrets={AUTH_ENV: auth} if auth else None,
                          env=worker_env(s, todo, preps[s.host].cpu), fresh=not resume)
                launched.append(job)
            record.started(shards=[s.index for s in todo])
    except BaseException as e:
        freed = _abandon(placed, launched)
        if freed and isinstance(e, OperationFailed):
            raise EvalError(f"{e}; the {freed} shard(s) of this run placed before were released (their GPUs "
                            f"are free again)") from None
        raise
    return jobs


def refuse_mixing(record: RunRecord, restarting: list[Shard], jobs: dict[int, HostJob], states: dict[int, dict],
                  code_before: dict[int, str]) -> None:
    """A resume continues a run only with what its finished rows were made with: the same worker
    code (its shipped folder's digest) and the same drafter weights (the sha256 the worker recorded
    in env.json, against the files there now). Else one line naming the change, and nothing starts:
    one run is one measurement."""
    new_run = (f"start a new run of it: dflash-ops eval --drafter {record.request.drafter_ref} "
               + " ".join(f"--host {h}" for h in record.request.hosts)
               + f" (with the settings `dflash-ops show {record.id}` lists)")
    for s in restarting:
        done = max(s.done, states[s.index].get("done") or 0)
        if not done:
            continue
        before, now = code_before[s.index].rpartition("/")[2], s.code_dir.rpartition("/")[2]
        if before and before != now:
            raise EvalError(f"run {record.id}: dflash-ops changed since its {done} finished prompt(s) on {s.label} "
                            f"were made (worker code {before} then, {now} now); a resume would mix two worker "
                            f"versions in one run: {new_run}, or resume it with the dflash-ops that started it")
        job = jobs[s.index]
        recorded = ((job.recorded_env() or {}).get("drafter") or {}).get("sha256")
        if not isinstance(recorded, dict) or not recorded:
            continue
        current = job.digest(s.drafter_path, sorted(recorded))
        changed = [name for name in sorted(recorded) if current.get(name) != recorded[name]]
        if changed:
            name = changed[0]
            now_sha = current.get(name)
            raise EvalError(f"run {record.id}: the drafter's weights in {s.drafter_path} on {s.host} changed since its "
                            f"{done} finished prompt(s) were made ({name}: sha256 {str(recorded[name])[:12]} then, "
                            + (f"{now_sha[:12]} now" if now_sha else "gone now")
                            + (f"; {len(changed) - 1} more file(s)" if len(changed) > 1 else "")
                            + f"); a resume would mix two checkpoints in one run: {new_run}, or put those weights back")


def jobs_of(record: RunRecord, inventory: Inventory, shards: list[Shard] | None = None) -> dict[int, HostJob]:
    """The started workers of a run (or of ``shards`` of it), to follow or cancel them (a Ray
    shard through its actor, or a 0-GPU one on the same node when the actor is gone)."""
    def job(s: Shard) -> HostJob:
        host = inventory.get(s.host)
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
            if s.fetched and s.state == State.DONE and jobs[s.index].status().get("state") == State.MISSING]
    record.following(keep=[s.index for s in gone])
    return [f"{s.label}: its folder on the host ({s.run_dir}) is gone; the results fetched before are kept as "
            f"they are" for s in gone]


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
                record.shard_progressed(i, ev)
                if ev.get(events.KEY) == events.EXIT:
                    record.shard_exited(i, ev)
                    job.fetch(shard.local_dir(record.folder), required=RESULTS if ev.get("state") == "done" else ())
                    record.shard_fetched(i)
        except FetchFailed as e:
            lost[i] = f"{e}; they stay on the host: dflash-ops attach {record.id} fetches them again"
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
    from remote.contract.metrics import summarize

    if len(shards) == 1:
        record_placement(run_dir, shards)
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
    write_atomic(run_dir / "results.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    env = dict(envs[0])
    env["host"] = ",".join(e["host"] for e in envs)
    env["suite"] = {**env["suite"], "ids": [r["id"] for r in rows], "shard": None}
    env["shards"] = envs
    record_placement(run_dir, shards, env)
    settings = env["settings"]
    summary = summarize(rows, settings["block_size"], settings["mode"], max_length=settings.get("verify_block"))
    write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
    return summary


def record_placement(run_dir: Path, shards: list[Shard], env: dict | None = None) -> None:
    """env.json's ``placement``: how the run ran (backend ``ssh`` or ``ray``, hosts, one entry per
    shard with its GPU; on Ray the job, actor and node ids and the GPUs Ray assigned); ``env``:
    the env.json to write (default: the one there)."""
    path = run_dir / "env.json"
    env = json.loads(path.read_text()) if env is None else env
    ray = [s.ray for s in shards if s.ray]
    env["placement"] = {"backend": "ray" if ray else "ssh", "hosts": list(dict.fromkeys(s.host for s in shards)),
                        "gpus": [s.gpu for s in shards if s.gpu is not None],
                        "shards": [{"index": s.index, "count": s.count, "host": s.host, "gpu": s.gpu,
                                    **({"ray": s.ray} if s.ray else {})} for s in shards]}
    if ray:
        env["placement"]["ray_job_ids"] = list(dict.fromkeys(r["job_id"] for r in ray))
    write_atomic(path, json.dumps(env, indent=2))


def complete(record: RunRecord, jobs: dict[int, HostJob],
             on_event: Callable[[int, dict], None]) -> tuple[dict, tuple[Path, Path] | None]:
    """Follow a started run to its end, then fetch, merge and report it (:func:`finish`). A shard
    whose contact was lost raises :class:`RunUnfinished` (its worker keeps running)."""
    lost = follow(record, jobs, on_event)
    if lost:
        raise RunUnfinished("; ".join(lost.values()) + f". The workers keep running; re-attach with: "
                            f"dflash-ops attach {record.id}")
    return finish(record)


def finish(record: RunRecord) -> tuple[dict, tuple[Path, Path] | None]:
    """After following: a finished run is merged and reported: (summary, report paths). A run
    with an unfetched shard raises :class:`RunUnfinished`, one with a failed worker
    :class:`EvalError` (the caller shows the failed shards' logs first, see :func:`failed_logs`)."""
    outcome = record.settle()
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
    summary = merge_shards(record.folder, record.shards)
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
    with record.lock():            # not while a start is starting workers: before it, or after it
        record.refresh()
        live = [s for s in record.shards if not s.fetched]
        jobs = jobs_of(record, inventory, live)
        states = {s.index: jobs[s.index].cancel() for s in live}
        stopped, ended = [], []
        for s in live:
            st = states[s.index]
            if not st.get("signalled", st.get("state") != State.DONE) and st.get("state") in (State.DONE, State.FAILED) \
                    and s.state != State.CANCELLED:
                ended.append(s)             # it had ended by itself, not by this or an earlier cancel
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
        elif ended:
            try:
                finish(record)      # done: merged and reported; failed or unfetched: settled as such
            except EvalError:
                pass
    return {record.shards[i].label: {**st, "state": "cancelled"} if i in stopped else st for i, st in states.items()}
