"""A Ray cluster as an eval host (inventory ``kind: ray``): the control side.

``connect`` joins the cluster as a Ray Client (``ray://HOST:PORT``; with ``via: HOST`` through an
``ssh -N -L`` tunnel that dflash-ops opens over that inventory host's OpenSSH endpoint, host keys
pinned as for sync). Each shard of a run is a *detached, named* actor (remote/host/ray_task.py's
:class:`~remote.host.ray_task.ShardNode`) holding the shard's GPUs (``num_gpus``); ``remote/`` travels
in its runtime environment (``py_modules``). :class:`ActorRunner` makes that actor a
:class:`~orchestrator.transport.Runner` on its node, so :class:`RayJob` is a
:class:`~orchestrator.eval.jobs.HostJob`: the worker starts detached in ``<workdir>/runs/<run id>``
(storage the node sees), with ``CUDA_VISIBLE_DEVICES`` as Ray assigned it, and follow, cancel and
``--resume`` work as on an SSH host. Detached, the actor outlives the CLI (Ctrl-C, ``--detach``);
it is killed once its shard is fetched or cancelled, which gives its GPUs back to the cluster.

``ray`` is an optional extra, imported only here and only when a Ray host is used.
"""
from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from ..errors import InputError, OperationFailed
from .jobs import HostJob
from ..transport import CommandTimeout, Result, Runner, SSHRunner, TransportError, endpoint_for
from ..transport.local import end_process
from ..transport.runner import ExecHandle, as_bytes, decode

if TYPE_CHECKING:  # pragma: no cover
    from ..config.inventory import Host, Inventory

NAMESPACE = "dflash-ops"
PLACE_TIMEOUT = float(os.environ.get("DFLASH_OPS_RAY_PLACE_TIMEOUT", "120"))   # s for Ray to place an actor
CONNECT_TIMEOUT = 30.0
CONNECT_ATTEMPTS = 3            # a Ray Client connection the head's server did not take up is tried again
EXTRA = "pip install 'dflash-ops[ray]'"


class RayMissing(InputError):
    """A Ray host was used without the `ray` extra installed."""


class RayError(OperationFailed):
    """The Ray cluster could not be reached, or could not place or run a shard."""


def import_ray():
    try:
        import ray
    except ImportError:
        raise RayMissing(f"Ray hosts need the `ray` extra (ray[client]==2.60.0): {EXTRA}") from None
    return ray


def remote_package() -> str:
    """The folder of the `remote` package shipped to the cluster (``py_modules``)."""
    return importlib.util.find_spec("remote").submodule_search_locations[0]


def runtime_env() -> dict:
    return {"py_modules": [remote_package()], "excludes": ["__pycache__", "*.pyc"]}


# ----------------------------------------------------------------------------- connecting

class Tunnel:
    """``ssh -N -L 127.0.0.1:PORT:HEAD_HOST:HEAD_PORT`` through an inventory SSH host, host key
    pinned to the one its control connection accepted (as sync's data path is)."""

    def __init__(self, via: "Host", inventory: "Inventory", target_host: str, target_port: int):
        endpoint = endpoint_for(via, inventory)
        self.proc = None
        self._pins = tempfile.NamedTemporaryFile("w", prefix="dflash-ops-pins-", suffix=".known_hosts", delete=False)
        try:                        # Ctrl-C or SIGTERM meanwhile: neither the tunnel nor its pins outlive this
            with SSHRunner(endpoint) as control:
                self._pins.write(control.pin_lines())
            self._pins.close()
            self.port = _free_port()
            argv = ["ssh", *endpoint.pinned_to(self._pins.name).options(("ExitOnForwardFailure=yes",
                                                                          "ServerAliveInterval=15")),
                    "-N", "-L", f"127.0.0.1:{self.port}:{target_host}:{target_port}", "--", endpoint.address]
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.PIPE, start_new_session=True)
            self._wait_open(via, target_host, target_port)
        except BaseException:
            self.close()
            raise
        Path(self._pins.name).unlink(missing_ok=True)   # read once, at the handshake: gone now

    def _wait_open(self, via: "Host", target_host: str, target_port: int) -> None:
        deadline = time.monotonic() + CONNECT_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = decode(self.proc.stderr.read()).strip().splitlines()[-1:] or ["exited"]
                raise TransportError(f"host {via.name}: the SSH tunnel to {target_host}:{target_port} failed: {err[0]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise TransportError(f"host {via.name}: the SSH tunnel did not open within {CONNECT_TIMEOUT:g}s")

    def close(self) -> None:
        self._pins.close()
        if self.proc is not None:
            end_process(self.proc)
        Path(self._pins.name).unlink(missing_ok=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.removeprefix("ray://").rpartition(":")
    return host, int(port)


_connection: dict = {}          # the one cluster this process is a client of: {"host": name, "tunnel": ...}
_lock = threading.Lock()


def connect(host: "Host", inventory: "Inventory | None"):
    """The ``ray`` module, connected to ``host``'s cluster (once per process; a Ray Client holds
    one connection)."""
    host.refuse_example()
    ray = import_ray()
    with _lock:
        if _connection.get("host") == host.name and ray.is_initialized():
            return ray
        disconnect()
        address, tunnel = host.address, None
        if host.via:
            if inventory is None:
                raise RayError(f"host {host.name}: `via: {host.via}` needs the inventory")
            tunnel = Tunnel(inventory.get(host.via), inventory, *split_address(host.address))
            _connection["tunnel"] = tunnel      # from now on closed at exit, however the connection ends
            address = f"ray://127.0.0.1:{tunnel.port}"
        try:                                    # a clear line at once, not Ray Client's 30 s of retries
            socket.create_connection(split_address(address), timeout=10).close()
        except OSError as e:
            if tunnel:
                tunnel.close()
            raise RayError(f"host {host.name}: cannot reach the Ray cluster at {host.endpoint}: "
                           f"{e.strerror or e}") from None
        logging.getLogger("ray").setLevel(logging.WARNING)
        for name in ("ray._private.worker", "ray.util.client.logsclient"):   # said here, and echoed by the server
            logging.getLogger(name).addFilter(_not_main_thread_note)
        for attempt in range(1, CONNECT_ATTEMPTS + 1):
            try:
                ray.init(address, namespace=NAMESPACE, runtime_env=runtime_env(), logging_level=logging.WARNING)
                break
            except Exception as e:  # noqa: BLE001 — grpc, timeouts, version mismatch: one line for the user
                why = init_failure(e)
                # The head starts a server process per client and waits a while for it (Ray's
                # RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S, 30 s); on a loaded node one can miss that
                if attempt < CONNECT_ATTEMPTS and why.startswith("Initialization failure from server"):
                    disconnect_client(ray)
                    continue
                if tunnel:
                    tunnel.close()
                raise RayError(f"host {host.name}: cannot connect to the Ray cluster at {host.endpoint}: {why}") from None
        _connection.update(host=host.name, tunnel=tunnel)
        return ray


def init_failure(e: Exception) -> str:
    """One line for a failed ``ray.init``: its first line and, when the server sent its traceback
    (``Initialization failure from server:`` then the traceback), the error that ended it."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    return lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"


def _not_main_thread_note(record: logging.LogRecord) -> bool:
    """Ray notes that it sets no SIGTERM handler when joined from a thread (pre-flight runs hosts
    in threads): true, and nothing for the user to act on."""
    return "SIGTERM handler is not set" not in record.getMessage()


def disconnect_client(ray) -> None:
    """Drop a half-made Ray Client connection before trying again."""
    try:
        ray.shutdown()
    except Exception:  # noqa: BLE001 — nothing was connected
        pass


def disconnect() -> None:
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    tunnel = _connection.pop("tunnel", None)
    if tunnel is not None:
        tunnel.close()
    _connection.clear()


atexit.register(disconnect)


# ----------------------------------------------------------------------------- the cluster

@dataclass
class Cluster:
    nodes: list[dict]            # alive nodes: {"address", "gpus", "cpus"}
    gpus: int                    # GPUs in the cluster
    free_gpus: int
    ray_version: str


def cluster_info(host: "Host", inventory: "Inventory | None") -> Cluster:
    ray = connect(host, inventory)
    nodes = [{"address": n.get("NodeManagerAddress"), "gpus": int(n["Resources"].get("GPU", 0)),
              "cpus": int(n["Resources"].get("CPU", 0))} for n in ray.nodes() if n.get("Alive")]
    return Cluster(nodes=nodes, gpus=int(ray.cluster_resources().get("GPU", 0)),
                   free_gpus=int(ray.available_resources().get("GPU", 0)), ray_version=ray.__version__)


# ----------------------------------------------------------------------------- actors as runners

class ActorRunner(Runner):
    """A :class:`~orchestrator.transport.Runner` whose commands run on a ShardNode actor's node."""

    def __init__(self, name: str, actor, info: dict, created: bool = True):
        self.name, self.actor, self.info = name, actor, info
        self.created = created      # placed by this call (not an existing shard's actor found again)

    def call(self, method: str, *args, timeout: float | None = 120):
        ray = import_ray()
        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise TransportError(f"host {self.name}: the Ray actor did not answer {method} within {timeout:g}s") from None
        except ray.exceptions.RayError as e:
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TransportError(f"host {self.name}: the Ray actor failed ({why})") from None

    def run(self, argv, *, timeout=60, check=False, input=None, env=None, cwd=None) -> Result:
        if isinstance(argv, (str, bytes)):
            raise TypeError("argv must be a list of strings")
        code, out, err = self.call("run", [str(a) for a in argv], env, cwd, as_bytes(input), timeout,
                                   timeout=None if timeout is None else timeout + 60)
        if code is None:
            raise CommandTimeout(f"host {self.name}: {argv[0]} timed out after {timeout:g}s")
        return self._finish(argv, Result(code, decode(out), decode(err)), check)

    def open_exec(self, argv, *, env=None, cwd=None) -> ExecHandle:
        return _PolledHandle(self, self.call("spawn", [str(a) for a in argv], env, cwd))

    def get_file(self, remote, local) -> None:
        data = self.call("read_bytes", remote)
        if data is None:
            raise TransportError(f"host {self.name}: no such file: {remote}")
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        Path(local).write_bytes(data)

    def read_text(self, remote) -> str:
        data = self.call("read_bytes", remote)
        if data is None:
            raise TransportError(f"host {self.name}: no such file: {remote}")
        return decode(data)

    def put_file(self, local, remote) -> None:
        self.call("write_bytes", remote, Path(local).read_bytes())

    def put_text(self, text, remote) -> None:
        self.call("write_bytes", remote, text.encode())

    def home(self) -> str:
        return self.info["home"]


class _Closed:
    def close(self) -> None:
        pass


class _PolledHandle(ExecHandle):
    """A command spawned on the actor's node; ``stdout`` yields its lines as the actor hands
    them out (Ray Client cannot stream an actor method's results)."""

    def __init__(self, runner: ActorRunner, handle: int):
        self.runner, self.handle, self.code = runner, handle, None
        self.stdin = self.stderr = _Closed()
        self.stdout = self._lines()

    def _lines(self) -> Iterator[bytes]:
        pending = b""
        while True:
            data, code = self.runner.call("poll", self.handle)
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line + b"\n"
            if code is not None and not data:
                self.code = code
                if pending:
                    yield pending
                return

    def wait(self, timeout: float | None = None) -> int:
        for _ in self.stdout:
            pass
        return self.code

    def kill(self) -> None:
        try:
            self.runner.call("kill", self.handle, timeout=30)
        except TransportError:
            pass


# ----------------------------------------------------------------------------- shards

def actor_name(run_id: str, index: int) -> str:
    return f"{run_id}/shard-{index}"


def place(host: "Host", inventory: "Inventory | None", name: str | None, num_gpus: float,
          node_id: str | None = None, strict_node: bool = False) -> ActorRunner:
    """A ShardNode actor for ``host`` holding ``num_gpus`` GPUs (``name``: detached and named,
    found again by that name if it exists; None: a short-lived pre-flight actor), on ``node_id``
    when given (a resumed shard goes back to the node whose disk holds its run folder)."""
    ray = connect(host, inventory)
    from remote.host.ray_task import ShardNode

    if name is not None:
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
            return ActorRunner(host.name, actor, ray.get(actor.placement.remote(), timeout=PLACE_TIMEOUT),
                               created=False)
        except ValueError:
            pass                        # not there (fetched, cancelled, or never started): a new one
    options = {"num_gpus": num_gpus, "num_cpus": 0, "max_concurrency": 16}   # runtime_env: the job's (connect)
    if name is not None:
        options.update(name=name, namespace=NAMESPACE, lifetime="detached")
    if node_id:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=not strict_node)
    actor = ray.remote(ShardNode).options(**options).remote()
    try:
        info = ray.get(actor.placement.remote(), timeout=PLACE_TIMEOUT)
    except ray.exceptions.GetTimeoutError:
        ray.kill(actor)
        free = int(ray.available_resources().get("GPU", 0))
        total = int(ray.cluster_resources().get("GPU", 0))
        raise RayError(f"host {host.name}: Ray did not place a worker needing {num_gpus:g} GPU(s) within "
                       f"{PLACE_TIMEOUT:g}s ({free} of the cluster's {total} GPUs free)") from None
    except ray.exceptions.RayError as e:
        ray.kill(actor)
        raise RayError(f"host {host.name}: the Ray actor did not start: {str(e).strip().splitlines()[0]}") from None
    return ActorRunner(host.name, actor, info)


def release(runner: ActorRunner) -> None:
    """Kill the actor (its GPUs go back to the cluster); a worker it started has ended by then."""
    ray = import_ray()
    try:
        ray.kill(runner.actor, no_restart=True)
    except Exception:  # noqa: BLE001 — already gone
        pass


@dataclass
class RayJob(HostJob):
    """A shard's worker on a Ray node, run through its actor; the actor ends with the job."""

    def fetch(self, local_dir: Path, required: tuple[str, ...] = ()) -> list[str]:
        got = super().fetch(local_dir, required)
        release(self.runner)
        return got

    def cancel(self) -> dict:
        state = super().cancel()
        if state.get("signalled") or state.get("state") not in ("done", "failed"):
            release(self.runner)        # a worker that had ended by itself is fetched first (fetch releases)
        return state
