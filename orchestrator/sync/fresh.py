"""Is a checkpoint already on the eval host still the one on the training host? Training that
resumes often saves a step again; a copy synced before is then of other weights.

Cheap first: the listings' ``ident`` (the training host's files: path, size, mtime) against the
copy's ``manifest_ident`` (the same of the files it was synced from). Only when they differ are
hashes compared: the training host's manifest with sha256 (its cache hashes only what changed)
against the copy's manifest, so a file merely touched does not make the copy stale.
"""
from __future__ import annotations

from .tool import run_tool


def differs(src_entry: dict, dst_entry: dict) -> bool:
    """Do two listing entries (training host, eval host) say the copy may not be current?"""
    return src_entry.get("ident") != dst_entry.get("manifest_ident")


def changed_files(srun, src, src_dir: str, drun, dst, dst_rundir: str, ckpt: str) -> list[str]:
    """The files in which the eval host's copy ``dst_rundir/ckpt`` differs from the training
    host's checkpoint ``src_dir`` as it is now (changed, added or gone); empty when it is current."""
    now = {e["path"]: e.get("sha256") for e in run_tool(srun, src, "manifest", src_dir, "--hash", timeout=3600)["files"]}
    copy = {e["path"]: e.get("sha256") for e in
            run_tool(drun, dst, "state", dst_rundir, ckpt, timeout=120).get("final_manifest") or []}
    return sorted(p for p in now.keys() | copy.keys() if now.get(p) != copy.get(p))


def describe(files: list[str]) -> str:
    return ", ".join(files[:5]) + (f" and {len(files) - 5} more" if len(files) > 5 else "")
