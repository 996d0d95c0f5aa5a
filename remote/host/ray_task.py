"""The node side of a Ray eval host: one actor per shard, a small command runner on its node.

The control side (orchestrator/eval/ray.py) wraps :class:`ShardNode` with ``ray.remote`` and
creates it as a detached, named actor holding the shard's GPUs (``num_gpus``); this package is
shipped to the cluster in the actor's runtime environment (``py_modules``). The actor runs the
same ``python -m remote.host.launch`` commands an SSH host runs, as subprocesses on its node, so the
worker is started detached in its run folder with the GPUs Ray assigned (``CUDA_VISIBLE_DEVICES``,
which Ray sets in the actor's environment and the worker inherits), and status, follow, cancel
and resume behave as on an SSH host. Ray Client cannot stream from an actor, so a long command
(``launch follow``) is started with :meth:`ShardNode.spawn` and read with :meth:`ShardNode.poll`.

Stdlib only at import time: ``ray`` is imported inside :meth:`ShardNode.placement`, which only runs
inside a Ray worker, so this module stays importable (and the worker runnable) without Ray.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

CODE_DIR = str(Path(__file__).resolve().parents[2])     # the folder holding this `remote` package


class ShardNode:
    """Commands and files on the node the actor was placed on (argv lists, never shell text)."""

    def __init__(self) -> None:
        self._spawned: dict[int, tuple[subprocess.Popen, bytearray, threading.Thread]] = {}
        self._lock = threading.Lock()

    def placement(self) -> dict:
        """Where Ray put this actor: node, GPUs, ids, and the interpreter and code folder to use."""
        import ray

        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "node": socket.gethostname(), "job_id": ctx.get_job_id(),
                "actor_id": ctx.get_actor_id(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "python": sys.executable,
                "code_dir": CODE_DIR, "home": os.path.expanduser("~")}

    @staticmethod
    def _env(env: dict[str, str] | None) -> dict[str, str]:
        return {**os.environ, **(env or {})}

    def run(self, argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None,
            input: bytes | None = None, timeout: float | None = None) -> tuple[int | None, bytes, bytes]:
        """(exit code, stdout, stderr); exit code None when it ran past ``timeout`` (then killed)."""
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self._env(env), cwd=cwd,
                                    start_new_session=True)
        except FileNotFoundError as e:
            return 127, b"", f"{e.filename}: command not found\n".encode()
        except OSError as e:
            return 126, b"", f"{e}\n".encode()
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            proc.communicate()
            return None, b"", b""
        return proc.returncode, out, err

    def spawn(self, argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None) -> int:
        """Start a long command whose stdout :meth:`poll` hands out; returns its handle."""
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                env=self._env(env), cwd=cwd, start_new_session=True)
        buf = bytearray()

        def pump() -> None:
            for chunk in iter(lambda: proc.stdout.read1(65536), b""):
                with self._lock:
                    buf.extend(chunk)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        with self._lock:
            self._spawned[proc.pid] = (proc, buf, reader)
        return proc.pid

    def poll(self, handle: int, wait: float = 2.0) -> tuple[bytes, int | None]:
        """(stdout since the last poll, exit code or None while it runs); waits up to ``wait``
        seconds for output so that a follower does not spin."""
        proc, buf, reader = self._spawned[handle]
        deadline = time.monotonic() + wait
        while not buf and reader.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is not None:
            reader.join()
        with self._lock:
            data = bytes(buf)
            buf.clear()
        code = proc.returncode if not reader.is_alive() else None
        if code is not None and not data:
            self._spawned.pop(handle, None)
        return data, code

    def kill(self, handle: int) -> None:
        entry = self._spawned.pop(handle, None)
        if entry is not None:
            _kill_group(entry[0].pid)
            entry[0].wait()

    def read_bytes(self, path: str) -> bytes | None:
        """The file's bytes, or None when it does not exist."""
        try:
            return Path(path).expanduser().read_bytes()
        except FileNotFoundError:
            return None

    def write_bytes(self, path: str, data: bytes) -> None:
        dst = Path(path).expanduser()
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
