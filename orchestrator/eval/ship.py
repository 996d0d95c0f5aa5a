"""Ship the worker package (`remote/`) to a host's workdir, content-addressed.

The bundle is a deterministic tar of ``remote/`` (Python files and suites); its sha256 names the
folder on the host, ``<workdir>/code/<digest>/remote/``. A host that already has that folder
(marked complete) gets nothing; a changed worker gets a new folder, never a half-updated one.
"""
from __future__ import annotations

import hashlib
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
SHIPPED = ("**/*.py", "suites/*.jsonl")

# Runs on the host: extract the tar next to the final folder, mark it complete, rename it into
# place. A folder marked complete is never replaced (another eval may be running from it): when
# two ships race, the second finds the first's folder there and drops its own copy.
_EXTRACT = """
import os, shutil, sys, tarfile
tar, final = sys.argv[1], sys.argv[2]
done = os.path.join(final, ".complete")
if not os.path.exists(done):
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
            if os.path.exists(done):         # the same code, installed meanwhile by another ship
                shutil.rmtree(tmp, ignore_errors=True)
                break
            stale = "%s.stale.%d" % (final, os.getpid())
            try:                             # an unfinished folder (no .complete): aside, then gone
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
        tar_remote = f"{code_dir}.{os.getpid()}.{secrets.token_hex(4)}.tar"
        runner.put_file(f.name, tar_remote)
    finally:
        os.unlink(f.name)
    result = runner.run([python, "-c", _EXTRACT, tar_remote, code_dir], timeout=120)
    if not result.ok:
        raise TransportError(f"could not install the worker in {code_dir}: {result.stderr.strip()[-500:]}")
    return code_dir
