"""Deterministic test builds (trained tiny models, the embedded pair), kept on disk and shared by
every test process and session.

A build lives in ``ROOT/<name>-<key>/``, where ``key`` hashes its stamp: the recipe the caller
gives, the source of the worker package (``remote/``) and of the test modules that build models,
and the versions of torch, transformers and the reference packages. Any change to what a build
depends on names another folder, so a stale build is never used. A build is made in a staging
folder and renamed into place (atomic), under a lock file: processes that need the same build at
once (pytest-xdist workers) build it once and the others wait for it.

ROOT is ``$DFLASH_OPS_TEST_CACHE``, else ``$XDG_CACHE_HOME/dflash-ops-tests``, else
``~/.cache/dflash-ops-tests``; delete it to rebuild everything.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
from functools import lru_cache
from pathlib import Path
from typing import Callable

from remote.contract.versions import installed_versions

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
# what a build may depend on besides its recipe: the worker package and the test modules that build
SOURCES = (REPO / "remote", TESTS / "models.py", TESTS / "references.py", TESTS / "buildcache.py")
PACKAGES = ("torch", "transformers", "safetensors", "tokenizers", "dflash", "speculators")


def root() -> Path:
    explicit = os.environ.get("DFLASH_OPS_TEST_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache") / "dflash-ops-tests"


@lru_cache(maxsize=None)
def code_stamp() -> dict:
    """The sources' digest and the versions found first on the path (.ci/transformers-check puts
    another transformers release there)."""
    digest = hashlib.sha256()
    for source in SOURCES:
        files = sorted(p for p in source.rglob("*") if p.is_file() and "__pycache__" not in p.parts) \
            if source.is_dir() else [source]
        for f in files:
            digest.update(f.relative_to(REPO).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return {"sources": digest.hexdigest(), "versions": installed_versions(PACKAGES), "python": sys.version.split()[0]}


def folder(name: str, recipe: dict) -> Path:
    """Where the build ``name`` with ``recipe`` lives (built or not)."""
    stamp = {"name": name, "recipe": recipe, **code_stamp()}
    key = hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:16]
    return root() / f"{name}-{key}"


def built(name: str, recipe: dict, build: Callable[[Path], None]) -> Path:
    """The folder of build ``name``: ``build(staging)`` writes it the first time (in any process);
    later calls, here or elsewhere, return it as it is."""
    out = folder(name, recipe)
    stamp = out / "stamp.json"
    if stamp.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists():
            return out
        for stale in out.parent.glob(f".{out.name}.staging-*"):    # of builds that were cut short
            shutil.rmtree(stale, ignore_errors=True)
        staging = out.with_name(f".{out.name}.staging-{os.getpid()}")
        staging.mkdir()
        build(staging)
        (staging / "stamp.json").write_text(json.dumps({"name": name, "recipe": recipe, **code_stamp()}, indent=1))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(staging, out)
    return out
