"""``python -m remote.export SRC --to zlab|speculators|specforge [--out DIR] [--force] [--verifier NAME_OR_PATH]
[--num-target-layers N]``

Writes the drafter checkpoint SRC in another format (:mod:`remote.drafters.export` says what maps
to what, what is refused and how the folder is written).

Output: one JSON line on stdout, ``{"ok": true, "out": ..., "files": [...], ...}`` or
``{"ok": false, "error": ..., "kind": ..., "refusals": [...]}``; on failure also one line
``error: ...`` on stderr. Nothing else is on stdout (what a library prints goes to stderr). Exit
status: 0 written, 1 refused or the checkpoint cannot be read or written, 2 usage (bad arguments, a
destination that exists or is, holds or lies inside the source or the verifier).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys

from remote.drafters.checkpoint import CheckpointError
from remote.drafters.export import FORMATS, DestinationError, ExportRefused, export


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m remote.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="the checkpoint folder (any format dflash-ops reads)")
    p.add_argument("--to", required=True, choices=FORMATS, dest="fmt")
    p.add_argument("--out", help="the new checkpoint folder (default: beside SRC, named SRC.<format>)")
    p.add_argument("--force", action="store_true", help="replace an existing destination")
    p.add_argument("--verifier", help="the target model (folder or model id): recorded in a speculators "
                                      "config; a folder also gives num_target_layers")
    p.add_argument("--num-target-layers", type=int, help="decoder layers of the target (when the source does not "
                                                         "record them and z-lab output needs them)")
    args = p.parse_args(argv)
    base = {"ok": False, "source": args.source, "format": args.fmt}
    try:
        with contextlib.redirect_stdout(sys.stderr):     # what a library prints never mixes with the answer
            result = export(args.source, args.fmt, args.out, args.force, args.verifier, args.num_target_layers)
    except ExportRefused as e:
        return _fail({**base, "kind": "refused", "refusals": e.reasons}, str(e), 1)
    except DestinationError as e:
        return _fail({**base, "kind": "destination"}, str(e), 2)
    except CheckpointError as e:
        return _fail({**base, "kind": "checkpoint"}, str(e), 1)
    except OSError as e:
        return _fail({**base, "kind": "io"}, f"{e.filename or args.source}: {e.strerror or e}", 1)
    print(json.dumps(result))
    return 0


def _fail(result: dict, message: str, code: int) -> int:
    print(json.dumps({**result, "error": message}))
    print(f"error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
