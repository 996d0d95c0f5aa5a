"""Pre-flight in one process: the drafter/target compatibility check (:mod:`remote.inspect`), then,
when it passes, the host's libraries (:func:`runtime_problems`) and the memory plan
(:mod:`remote.memory`). One interpreter pays the torch and transformers imports once.

``python -m remote.preflight DRAFTER --target DIR [--verify-hashes] [--suite S --prompts N
--max-new-tokens M --device cuda --dtype D --target-devices N|auto --max-memory GIB]`` prints
``{"inspect": REPORT, "memory": PLAN or null}`` as JSON (the library problems are in REPORT's
``problems``); exit 0 when all pass.
"""
from __future__ import annotations

import argparse
import json

from remote.inspect import inspect
from remote.memory import add_plan_arguments, plan_for_suite
from remote.versions import TRANSFORMERS_TESTED, transformers_problem


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
    from importlib import metadata

    try:
        version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        version = None
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m remote.preflight", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("drafter")
    p.add_argument("--verify-hashes", action="store_true")
    add_plan_arguments(p)
    args = p.parse_args(argv)
    report = inspect(args.drafter, args.target, verify_hashes=args.verify_hashes)
    if report["ok"]:
        report["problems"] += runtime_problems(args.target, run_device(args.device))
        report["ok"] = not report["problems"]
    plan = None
    if report["ok"]:
        plan = plan_for_suite(args.target, args.drafter, args.suite, args.prompts, args.max_new_tokens,
                              args.device, args.dtype, args.target_devices, args.max_memory).to_dict()
    print(json.dumps({"inspect": report, "memory": plan}))
    return 0 if report["ok"] and plan and plan["fits"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
