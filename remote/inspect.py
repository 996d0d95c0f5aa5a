"""``python -m remote.inspect DRAFTER_DIR [--target TARGET_DIR] [--block-size N] [--verify-hashes] [--json]``

Prints the detected format, the variant (DFlash / DFlash2) and the rules it was found to follow
(mask rule per layer, RoPE, vocabulary, block layout, knobs), the normalised config, the formats
``python -m remote.export`` can write it in (or why not) and, with a target, the compatibility
verdict.
Exit status: 0 ok, 1 checkpoint or compatibility problem, 2 usage. Reads the configs, the tensor
headers and, once they pass, every weight once to name those holding NaN or an infinity (a
memory-mapped pass over the bits: :func:`remote.drafters.checkpoint.nonfinite_tensors`), cheap
enough to run as a pre-flight check before GPU time. What a library prints goes to stderr: stdout
holds the report only.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from remote.drafters.checkpoint import (CheckpointError, check_tensors, completeness_problems, nonfinite_problem,
                                       number_problem, open_checkpoint, read_json, read_tensors, refuse_special_files)
from remote.drafters.compat import TargetInfo, compatibility_problems, read_target_config
from remote.drafters.export import export_refusals
from remote.target.model import remote_code_problem


def read_target(target: str) -> TargetInfo:
    """:func:`read_target_config` of a target folder whose files are safe to read: regular files
    only, a config of finite numbers (epsilons and RoPE bases positive) that asks for no code of its
    own (:func:`remote_code_problem`); :class:`CheckpointError` naming what is not."""
    folder = Path(target).expanduser()
    cfg_path = folder / "config.json"
    if folder.is_dir():
        refuse_special_files(folder, "target")
        if cfg_path.exists():
            raw = read_json(cfg_path)
            problem = number_problem(raw) or remote_code_problem(raw)
            if problem:
                raise CheckpointError(f"{cfg_path}: {problem}")
    try:
        return read_target_config(folder)
    except CheckpointError:
        raise
    except (ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{cfg_path}: cannot read the target's config ({type(e).__name__}: {e})") from None


def inspect(drafter: str, target: str | None = None, block_size: int | None = None,
            verify_hashes: bool = False) -> dict:
    """The inspection report as a dict: ``ok`` plus ``problems`` (never raises for bad input)."""
    report: dict = {"drafter": drafter, "ok": False, "problems": []}
    try:
        folder = Path(drafter).expanduser()
        if not folder.exists():
            report["drafter_missing"] = True
            parent = folder.parent
            there = sorted(p.name for p in parent.iterdir()) if parent.is_dir() else []
            raise CheckpointError(f"drafter not found: {folder}" + (
                f" ({parent} holds: {', '.join(there[:20])}{' ...' if len(there) > 20 else ''})" if there
                else f" ({parent} does not exist either)"))
        if folder.is_dir():
            refuse_special_files(folder, "drafter")
            report["problems"] += completeness_problems(folder, verify_hashes)
        ckpt = open_checkpoint(drafter)
        report["config"] = ckpt.describe()
        report["format"] = ckpt.format
        shapes = read_tensors(ckpt, shapes_only=True)
        fc_shape = shapes.get("fc.weight")
        tinfo = None
        if target is not None:
            tinfo = read_target(target)
            report["target"] = tinfo.describe()
            report["problems"] += compatibility_problems(ckpt, tinfo, fc_shape, block_size)
        report["exports"] = export_refusals(ckpt, num_target_layers=tinfo.num_hidden_layers if tinfo else None)
        if not report["problems"]:  # tensor check after the more specific compatibility messages
            kept, ignored = check_tensors(ckpt, shapes)
            if ignored:
                report["config"]["notes"].append(f"ignored tensors: {ignored}")
            nonfinite = nonfinite_problem(ckpt, kept)
            if nonfinite:
                report["problems"].append(nonfinite)
    except CheckpointError as e:
        report["problems"].append(str(e))
    report["ok"] = not report["problems"]
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m remote.inspect", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("drafter")
    p.add_argument("--target")
    p.add_argument("--block-size", type=int)
    p.add_argument("--verify-hashes", action="store_true", help="check weights against the sync manifest's sha256")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    with contextlib.redirect_stdout(sys.stderr):     # what a library prints never mixes with the report
        report = inspect(args.drafter, args.target, args.block_size, args.verify_hashes)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        cfg = report.get("config")
        if cfg:
            print(f"drafter   {cfg['path']}")
            print(f"format    {cfg['format']}  ({', '.join(cfg['weight_files'])})")
            print(f"block     {cfg['block_size']}   mask_token_id {cfg['mask_token_id']}")
            print(f"layers    {cfg['num_hidden_layers']} x hidden {cfg['hidden_size']}   types {cfg['layer_types']}"
                  + (f"   sliding_window {cfg['sliding_window']}" if cfg["sliding_window"] else ""))
            print(f"target layer ids (z-lab convention, feature = hidden_states[i+1]): {cfg['target_layer_ids']}")
            v = cfg["variant"]
            print(f"variant   {v['architecture']}   mask rule {v['mask_rule']}   drafts per block {v['drafts_per_block']}"
                  + ("   (sample_from_anchor: slot k predicts token p+k+1)" if v["sample_from_anchor"] else ""))
            for i, rule in enumerate(v["layers"]):
                print(f"layer {i}   {cfg['layer_types'][i]}: {rule}")
            print(f"rope      {v['rope']}")
            print(f"vocab     {v['vocab']}")
            print(f"knobs     {', '.join(f'{k}={x}' for k, x in v['knobs'].items())}")
            if v["family"] != "dflash":
                print(f"family    {v['family']} (SpecForge): drafts each block's tokens in order"
                      + ("; confidence head: yes" if v["confidence_head"] else "; confidence head: no"))
                for head in v["heads"]:
                    print(f"head      {head}")
            if v["architecture"] == "dflash2":
                print(f"dflash2   conv kernel {v['conv_kernel_size']} x group {v['conv_group_size']}, selector rank "
                      f"{v['selector_rank']} top-{v['selector_top_k']}")
            for note in cfg["notes"]:
                print(f"note      {note}")
        for fmt, refusal in (report.get("exports") or {}).items():
            print(f"export    {fmt}: " + ("yes" if refusal is None else f"no ({refusal})"))
        if "target" in report:
            t = report["target"]
            print(f"target    {t['path']}  ({t['model_type']}, {t['num_hidden_layers']} layers, hidden "
                  f"{t['hidden_size']}, vocab {t['vocab_size']})")
        if report["ok"]:
            print("verdict   compatible" if "target" in report else "verdict   checkpoint ok")
        else:
            for problem in report["problems"]:
                print(f"error     {problem}", file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
