"""Ship the worker package (`remote/`) to a host's workdir, content-addressed.

The bundle is a deterministic tar of ``remote/`` (Python files and suites); its sha256 names the
folder on the host, ``<workdir>/code/<digest>/remote/``. A host that already has that folder
(marked complete) gets nothing; a changed worker gets a new folder, never a half-updated one.
"""
from __future__ import annotations

import hashlib
import io
import os
import tarfile
import tempfile
from functools import lru_cache
from pathlib import Path

import remote

from ..transport import Runner, TransportError

PACKAGE = Path(remote.__file__).resolve().parent
SHIPPED = ("*.py", "suites/*.jsonl")

# Runs on the host: extract the tar next to the final folder, mark it complete, rename into place.
_EXTRACT = """
import os, shutil, sys, tarfile
tar, final = sys.argv[1], sys.argv[2]
if not os.path.exists(os.path.join(final, ".complete")):
    tmp = final + ".tmp.%d" % os.getpid()
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(tar) as t:
        kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        t.extractall(tmp, **kw)
    open(os.path.join(tmp, ".complete"), "w").close()
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
os.remove(tar)
"""


@lru_cache(maxsize=1)
def bundle() -> tuple[str, bytes]:
    """(sha256 digest, tar bytes) of the worker package."""
    files = sorted({p for pattern in SHIPPED for p in PACKAGE.glob(pattern) if p.is_file()})
    buf = io.BytesIO()
    digest = hashlib.sha256()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in files:
            rel = f"remote/{path.relative_to(PACKAGE).as_posix()}"
            data = path.read_bytes()
            digest.update(rel.encode() + b"\0" + data + b"\0")
            info = tarfile.TarInfo(rel)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return digest.hexdigest()[:16], buf.getvalue()


def ship(runner: Runner, python: str, workdir: str) -> str:
    """Make sure ``<workdir>/code/<digest>`` holds this worker; returns that folder (the
    PYTHONPATH entry on the host)."""
    digest, data = bundle()
    code_dir = f"{workdir.rstrip('/')}/code/{digest}"
    if runner.run(["test", "-f", f"{code_dir}/.complete"], timeout=30).ok:
        return code_dir
    runner.run(["mkdir", "-p", f"{workdir.rstrip('/')}/code"], timeout=30, check=True)
    with tempfile.NamedTemporaryFile(suffix=".tar", delete=False) as f:
        f.write(data)
    try:
        tar_remote = f"{code_dir}.{os.getpid()}.tar"
        runner.put_file(f.name, tar_remote)
    finally:
        os.unlink(f.name)
    result = runner.run([python, "-c", _EXTRACT, tar_remote, code_dir], timeout=120)
    if not result.ok:
        raise TransportError(f"could not install the worker in {code_dir}: {result.stderr.strip()[-500:]}")
    return code_dir
