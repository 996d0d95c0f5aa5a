"""Pre-flight in one process: the drafter/target compatibility check (:mod:`remote.inspect`), then,
when it passes, the memory plan (:mod:`remote.memory`). One interpreter pays the torch and
transformers imports once instead of twice.

``python -m remote.preflight DRAFTER --target DIR [--verify-hashes] [--suite S --prompts N
--max-new-tokens M --device cuda --dtype D --target-devices N|auto --max-memory GIB]`` prints
``{"inspect": REPORT, "memory": PLAN or null}`` as JSON; exit 0 when both pass.
"""
from __future__ import annotations

import argparse
import json

from remote.inspect import inspect
from remote.memory import add_plan_arguments, plan_for_suite


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m remote.preflight", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("drafter")
    p.add_argument("--verify-hashes", action="store_true")
    add_plan_arguments(p)
    args = p.parse_args(argv)
    report = inspect(args.drafter, args.target, verify_hashes=args.verify_hashes)
    plan = None
    if report["ok"]:
        plan = plan_for_suite(args.target, args.drafter, args.suite, args.prompts, args.max_new_tokens,
                              args.device, args.dtype, args.target_devices, args.max_memory).to_dict()
    print(json.dumps({"inspect": report, "memory": plan}))
    return 0 if report["ok"] and plan["fits"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
