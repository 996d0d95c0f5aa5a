"""Ship the worker package (`remote/`) to a host's workdir, content-addressed.

The bundle is a deterministic tar of ``remote/`` (Python files and suites); its sha256 names the
folder on the host, ``<workdir>/code/<digest>/remote/``. A host that already has that folder
(marked complete, and its files still hashing to the digest in its name) gets nothing; a changed
worker gets a new folder, never a half-updated one; a folder whose files no longer match its name
(edited, truncated, a file added or linked) is moved aside and installed again.
"""
from __future__ import annotations

import io
import os
import secrets
import tarfile
import tempfile
from functools import lru_cache
from pathlib import Path

import remote

from ..transport import Runner, TransportError

PACKAGE = Path(remote.__file__).resolve().parent

# The worker's files under FOLDER/remote (``*.py`` at any depth, ``suites/*.jsonl``) and their digest:
# run here on the package and on the host on an installed folder, so both count the same files the
# same way. A link or special file among them: no digest (not a folder this tool installed).
_DIGEST = r"""
import hashlib, os

def worker_files(folder):
    root, found = os.path.join(folder, "remote"), []
    for d, dirs, names in os.walk(root):
        if any(os.path.islink(os.path.join(d, x)) for x in dirs):
            return None
        for n in names:
            path = os.path.join(d, n)
            rel = "remote/" + os.path.relpath(path, root).replace(os.sep, "/")
            if n.endswith(".py") or (rel.rsplit("/", 1)[0] == "remote/suites" and n.endswith(".jsonl")):
                if os.path.islink(path) or not os.path.isfile(path):
                    return None
                found.append(rel)
    return sorted(found, key=lambda rel: rel.split("/"))

def worker_digest(folder, files):
    h = hashlib.sha256()
    for rel in files:
        with open(os.path.join(folder, rel), "rb") as f:
            h.update(rel.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()[:16]

def installed(folder, digest):
    if not os.path.isfile(os.path.join(folder, ".complete")):
        return False
    files = worker_files(folder)
    return files is not None and worker_digest(folder, files) == digest
"""

# Runs on the host: exit 0 when FOLDER holds the worker of DIGEST, marked complete.
_CHECK = _DIGEST + """
import sys
sys.exit(0 if installed(sys.argv[1], sys.argv[2]) else 1)
"""

# Runs on the host: extract the tar next to the final folder, mark it complete, rename it into
# place. A folder marked complete and matching its digest is never replaced (another eval may be
# running from it): when two ships race, the second finds the first's folder there and drops its
# own copy. One that does not match (or is unfinished) is moved aside, then removed.
_EXTRACT = _DIGEST + """
import shutil, sys, tarfile
tar, final, digest = sys.argv[1], sys.argv[2], sys.argv[3]
if not installed(final, digest):
    tmp = "%s.tmp.%d" % (final, os.getpid())
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(tar) as t:
        kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        t.extractall(tmp, **kw)
    open(os.path.join(tmp, ".complete"), "w").close()
    for attempt in range(5):
        try:
            os.rename(tmp, final)            # refused while final exists and is not empty
            break
        except OSError:
            if installed(final, digest):     # the same code, installed meanwhile by another ship
                shutil.rmtree(tmp, ignore_errors=True)
                break
            stale = "%s.stale.%d" % (final, os.getpid())
            try:                             # unfinished, or not what its name says: aside, then gone
                os.rename(final, stale)
            except FileNotFoundError:
                continue
            shutil.rmtree(stale, ignore_errors=True)
    else:
        sys.exit("cannot put the worker code in place at " + final)
os.remove(tar)
"""


@lru_cache(maxsize=1)
def bundle() -> tuple[str, bytes]:
    """(sha256 digest, tar bytes) of the worker package."""
    digest_code: dict = {}
    exec(_DIGEST, digest_code)      # the host's way of counting the files, run here on the package
    folder = str(PACKAGE.parent)
    files = digest_code["worker_files"](folder)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for rel in files:
            data = (PACKAGE.parent / rel).read_bytes()
            info = tarfile.TarInfo(rel)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return digest_code["worker_digest"](folder, files), buf.getvalue()


def ship(runner: Runner, python: str, workdir: str) -> str:
    """Make sure ``<workdir>/code/<digest>`` holds this worker; returns that folder (the
    PYTHONPATH entry on the host)."""
    digest, data = bundle()
    code_dir = f"{workdir.rstrip('/')}/code/{digest}"
    if runner.run([python, "-c", _CHECK, code_dir, digest], timeout=60).ok:
        return code_dir
    runner.run(["mkdir", "-p", f"{workdir.rstrip('/')}/code"], timeout=30, check=True)
    with tempfile.NamedTemporaryFile(suffix=".tar", delete=False) as f:
        f.write(data)
    try:
        tar_remote = f"{code_dir}.{os.getpid()}.{secrets.token_hex(4)}.tar"
        runner.put_file(f.name, tar_remote)
    finally:
        os.unlink(f.name)
    result = runner.run([python, "-c", _EXTRACT, tar_remote, code_dir, digest], timeout=120)
    if not result.ok:
        raise TransportError(f"could not install the worker in {code_dir}: {result.stderr.strip()[-500:]}")
    return code_dir
