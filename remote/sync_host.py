"""What `dflash-ops sync-ckpt` / `ckpts` run on a host: list, lock, send, receive. Stdlib only.

Shipped as an argument of ``python -c BOOTSTRAP BLOB ARGS`` (see ``orchestrator/sync/tool.py``), not on
stdin: for ``recv`` and ``serve`` stdin carries the data stream / the control lines.

Commands (all print JSON or simple lines on stdout; errors: one line ``ERROR ...`` on stderr):

* ``list ROOT --run NAME DIR PATTERN ...``  checkpoint folders of runs (step, size, mtime, every
  top-level file name: what the completeness rule reads; ``ident`` of its files and, for a synced
  copy, ``manifest_ident`` of the files it is a copy of: equal when the copy is current)
* ``manifest DIR [--hash]``  relative path, size, mtime_ns, inode, ctime_ns and sha256 (from the
  cache ``.dflash-manifest.json`` when none of size, mtime, inode, ctime changed; ``--hash``
  computes missing ones). Refused when the folder is or holds symbolic links (never followed: they
  can point anywhere on the host) or holds unfinished ``*.part`` files
* ``state RUNDIR CKPT``  read-only view of the destination (final folder, staging, free bytes)
* ``send FILE SIZE MTIME_NS OFFSET [--hash] [--cache DIR]``  bytes [OFFSET, SIZE) on stdout, then a
  trailer ``DFLT<sha256 hex of the whole file or 64*'-'>\\n`` (hash continued over the prefix on
  resume); with ``--cache`` the hash goes into DIR's manifest cache too
* ``send-from DIR send REL SIZE MTIME_NS OFFSET [--hash]``  the forced command of ``--tunnel``'s
  one-time key: ``send`` of a file under DIR only
* ``recv RUNDIR CKPT REL SIZE OFFSET MTIME_NS TOKEN [--sha256 X] [--pull ARGV_JSON]``  (stdin, or
  the stdout of the command ``--pull`` names: the ``send`` stream) appends to
  ``.staging-CKPT/REL.part``, hashes in flight, verifies, fsyncs, renames to REL
* ``serve``  one session per host per sync, a request per line on stdin: ``LIST``, ``MANIFEST``
  (training host), ``STATE``, ``LOCK`` (the checkpoint's flock, held until the session ends),
  ``BEGIN``, ``FINALIZE <manifest json>`` (eval host), ``GRANT``/``REVOKE`` (a one-time key,
  training host), ``TUNNEL``/``PULL``/``UNTUNNEL`` (the tunnel's end, eval host), ``PING``;
  everything it set up is undone when it ends

Arguments are positional first, then flags: a file may well be called ``--sha256``. A global
``--idle S`` may come before the command.

Layout (it travels as one file, hence its length): the pieces several commands share, then one
section per command in the order above, each holding what only that command uses in the order it
runs it, then ``main`` (the dispatch). ``serve`` answers ``LIST``/``MANIFEST``/``STATE`` with the
``list``/``manifest``/``state`` sections' functions; its own requests' sections follow it.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import mmap
import os
import re
import select
import shutil
import stat
import sys
import time


# ----------------------------------------------------------------------- shared by several commands

MANIFEST = ".dflash-manifest.json"
VERIFIED = ".dflash-verified"
OWNER = ".dflash-owner"
CHUNK = 1 << 20
NO_HASH = "-" * 64
IDLE_TIMEOUT = 20.0  # stdin silent this long: give up (the link is dead); --idle S overrides


class ToolError(Exception):
    pass


def out(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def parse(args: list, names: tuple, flags: dict) -> tuple[list, dict]:
    """The positional arguments ``names`` (all required), then flags (``flags``: flag -> how many
    values it takes). Positionals are never read as flags, so any file name is safe there."""
    if len(args) < len(names):
        raise ToolError(f"missing {' '.join(names[len(args):])}")
    pos, rest, opts = list(args[:len(names)]), list(args[len(names):]), {}
    while rest:
        flag = rest.pop(0)
        if flag not in flags or len(rest) < flags[flag]:
            raise ToolError(f"unexpected argument {flag!r}")
        opts[flag] = rest.pop(0) if flags[flag] else True
    return pos, opts


def _grow_pipe(fd: int) -> None:
    try:
        fcntl.fcntl(fd, 1031, 1 << 20)  # F_SETPIPE_SZ (Linux; fewer wake-ups per MiB)
    except OSError:
        pass


class Walk:
    """What is under a checkpoint folder (dotfiles and dot-folders left out), sorted: ``files``
    (relative path, stat) of the regular files, ``links`` ("rel -> target") of the symbolic links,
    never followed, and ``parts``, unfinished ``*.part`` files."""

    def __init__(self, root: str):
        self.files, self.links, self.parts = [], [], []
        for dirpath, dirnames, filenames in os.walk(root):
            names = sorted(n for n in dirnames + filenames if not n.startswith("."))
            dirnames[:] = [d for d in sorted(dirnames) if not d.startswith(".") and
                           not os.path.islink(os.path.join(dirpath, d))]
            for name in names:
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, root)
                try:
                    st = os.lstat(full)
                except OSError:
                    continue
                if stat.S_ISLNK(st.st_mode):
                    self.links.append(f"{rel} -> {os.readlink(full)}")
                elif not stat.S_ISREG(st.st_mode):
                    continue
                elif name.endswith(".part"):
                    self.parts.append(rel)
                else:
                    self.files.append((rel, st))

    def refuse_unsafe(self, root: str) -> None:
        if self.links:
            raise ToolError(f"{root} holds symbolic links, which sync-ckpt does not follow (they can point "
                            f"anywhere on the host): {_few(self.links)}; replace each with the file it points "
                            f"to, or remove it")
        if self.parts:
            raise ToolError(f"{root} holds unfinished files (*.part): {_few(self.parts)}; is it still being "
                            f"written? Sync it once they are complete (or remove them)")


def _few(items: list, n: int = 10) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def _ident(st) -> dict:
    """What a cached sha256 is keyed by: a rewrite that keeps size and mtime still changes ctime."""
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "ctime_ns": st.st_ctime_ns}


def _matches(entry: dict, st, keys=("size", "mtime_ns", "ino", "ctime_ns")) -> bool:
    ident = _ident(st)
    return all(entry.get(k) == ident[k] for k in keys)


def sha256_file(path: str, limit: int | None = None, h=None):
    h = h or hashlib.sha256()
    left = limit
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while left is None or left > 0:
            n = f.readinto(view if left is None or left >= CHUNK else view[:left])
            if not n:
                break
            h.update(view[:n])
            if left is not None:
                left -= n
    if left:
        raise ToolError(f"{path}: shorter than {limit} bytes")
    return h


def _load_cache(d: str) -> dict:
    try:
        with open(os.path.join(d, MANIFEST)) as f:
            data = json.load(f)
        return {e["path"]: e for e in data.get("files", [])}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _write_json_atomic(path: str, data) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _cache_update(d: str, entries: list) -> None:
    """Merge ``entries`` into the folder's manifest cache: read-modify-write under a flock on the
    folder, so parallel senders of one checkpoint keep each other's entries. A read-only source
    is left as it is (the cache only saves hashing next time)."""
    try:
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        fcntl.flock(dfd, fcntl.LOCK_EX)
        cache = _load_cache(d)
        cache.update((e["path"], e) for e in entries if e.get("sha256"))
        _write_json_atomic(os.path.join(d, MANIFEST), {"files": sorted(cache.values(), key=lambda e: e["path"])})
    except OSError:
        pass
    finally:
        os.close(dfd)


def safe_rel(rel: str) -> str:
    """A relative path from a manifest, checked before it names anything in the staging folder."""
    if not rel or rel.startswith("/") or "\0" in rel or any(p in ("", ".", "..") for p in rel.split("/")):
        raise ToolError(f"refusing unsafe path {rel!r}")
    if any(p.startswith(".dflash-") for p in rel.split("/")):
        raise ToolError(f"refusing reserved name {rel!r}: .dflash-* is the sync's own bookkeeping")
    if rel.endswith(".part"):
        raise ToolError(f"refusing reserved name {rel!r}: .part marks a file still arriving")
    return rel


def safe_name(name: str) -> str:
    if not name or "/" in name or name in (".", "..") or name.startswith(".") or "\0" in name:
        raise ToolError(f"refusing unsafe checkpoint name {name!r}")
    return name


def paths(rundir: str, ckpt: str) -> dict:
    safe_name(ckpt)
    staging = os.path.join(rundir, f".staging-{ckpt}")
    return {"final": os.path.join(rundir, ckpt), "staging": staging,
            "lock": os.path.join(rundir, f".lock-{ckpt}"), "owner": os.path.join(staging, OWNER),
            "verified": os.path.join(staging, VERIFIED)}


def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------- list

def cmd_list(args: list) -> None:
    out(json.dumps(listing(args)))


def listing(args: list) -> dict:
    if not args:
        raise ToolError("list: missing ROOT")
    root, rest = args[0], args[1:]
    runs = {}
    while rest:
        if rest[0] != "--run" or len(rest) < 4:
            raise ToolError("list: expected --run NAME DIR PATTERN")
        name, d, pattern = rest[1:4]
        rest = rest[4:]
        rdir = d if os.path.isabs(d) else os.path.join(root, d)
        rx = pattern_regex(pattern)
        items = []
        try:
            names = sorted(os.listdir(rdir))
        except FileNotFoundError:
            runs[name] = {"dir": rdir, "exists": False, "checkpoints": [], "staging": []}
            continue
        staging = []
        for n in names:
            full = os.path.join(rdir, n)
            if n.startswith(".staging-") and os.path.isdir(full):
                staging.append(n[len(".staging-"):])
                continue
            if n.startswith(".") or not os.path.isdir(full):
                continue
            m = rx.match(n)
            files = Walk(full).files
            complete = os.path.exists(os.path.join(full, MANIFEST))
            items.append({
                "name": n, "step": int(m.group(1)) if m else None,
                "size": sum(st.st_size for _, st in files), "files": len(files),
                "mtime": max([st.st_mtime for _, st in files] or [os.stat(full).st_mtime]),
                "complete": complete,
                "paths": [rel for rel, _ in files if "/" not in rel],   # the completeness rule's: top level, all
                "ident": ident([(rel, st.st_size, st.st_mtime_ns) for rel, st in files]),
                "manifest_ident": ident([(e.get("path"), e.get("size"), e.get("mtime_ns"))
                                         for e in _load_cache(full).values()]) if complete else None,
            })
        runs[name] = {"dir": rdir, "exists": True, "checkpoints": items, "staging": staging}
    return {"runs": runs, "now": time.time()}


def pattern_regex(pattern: str):
    parts = re.split(r"\{step(?::0?(\d+)d)?\}", pattern)
    if len(parts) != 3:
        raise ToolError(f"pattern {pattern!r} must contain {{step}} once")
    return re.compile("^" + re.escape(parts[0]) + r"(\d+)" + re.escape(parts[2]) + "$")


def ident(entries: list) -> str:
    """What a checkpoint folder holds, in short: a digest of its files' (path, size, mtime_ns).
    Equal on the training host (its files now) and the eval host (the synced copy's manifest,
    which keeps the source's sizes and mtimes) when the copy is of the files as they are."""
    h = hashlib.sha256()
    for path, size, mtime_ns in sorted(entries, key=lambda e: str(e[0])):
        h.update(f"{path}\0{size}\0{mtime_ns}\n".encode())
    return h.hexdigest()[:32]


# ----------------------------------------------------------------------------------------- manifest

def cmd_manifest(args: list) -> None:
    (d,), opts = parse(args, ("DIR",), {"--hash": 0})
    out(json.dumps(manifest(d, "--hash" in opts)))


def manifest(d: str, compute: bool) -> dict:
    if os.path.islink(d.rstrip("/")):
        raise ToolError(f"{d} is a symbolic link (-> {os.readlink(d.rstrip('/'))}), which sync-ckpt does not follow "
                        f"(it can point anywhere on the host); sync the folder it points to under its own name, or "
                        f"replace the link with that folder")
    if not os.path.isdir(d):
        raise ToolError(f"no such checkpoint folder: {d}")
    cache = _load_cache(d)
    walk = Walk(d)
    walk.refuse_unsafe(d)
    files, hashed = [], 0
    for rel, st in walk.files:
        c = cache.get(rel) or {}
        sha = c.get("sha256") if _matches(c, st) else None
        if sha is None and compute:
            sha = sha256_file(os.path.join(d, rel)).hexdigest()
            if not _matches(_ident(st), os.lstat(os.path.join(d, rel))):
                raise ToolError(f"{rel} changed while it was hashed (is training still writing it?)")
            hashed += 1
        files.append({"path": rel, **_ident(st), "sha256": sha})
    if not files:
        raise ToolError(f"checkpoint folder {d} holds no files")
    data = {"files": files}
    if hashed:
        _cache_update(d, files)
    return dict(data, hashed=hashed, now=time.time())


# -------------------------------------------------------------------------------------------- state

def cmd_state(args: list) -> None:
    (rundir, ckpt), _ = parse(args, ("RUNDIR", "CKPT"), {})
    out(json.dumps(state(rundir, ckpt)))


def state(rundir: str, ckpt: str) -> dict:
    p = paths(rundir, ckpt)
    res = {"final": p["final"], "final_exists": os.path.exists(p["final"]), "final_manifest": None,
           "staging_exists": os.path.isdir(p["staging"]), "parts": {}, "verified": {},
           "free_bytes": _free_bytes(rundir)}
    if res["final_exists"]:
        res["final_manifest"] = list(_load_cache(p["final"]).values()) or None
    if res["staging_exists"]:
        for dirpath, dirnames, filenames in os.walk(p["staging"]):
            dirnames[:] = [d for d in dirnames if d != VERIFIED]
            for n in filenames:
                if n.endswith(".part"):
                    full = os.path.join(dirpath, n)
                    res["parts"][os.path.relpath(full, p["staging"])[:-5]] = os.path.getsize(full)
        for dirpath, _, filenames in os.walk(p["verified"]):
            for n in filenames:
                if not n.endswith(".json"):
                    continue
                try:
                    with open(os.path.join(dirpath, n)) as f:
                        rec = json.load(f)
                except (OSError, ValueError):
                    continue
                rel = rec.get("path")
                if rel and os.path.isfile(os.path.join(p["staging"], rel)) and \
                        os.path.getsize(os.path.join(p["staging"], rel)) == rec.get("size"):
                    res["verified"][rel] = rec
    return res


def _free_bytes(path: str) -> int:
    p = path
    while not os.path.exists(p):
        p = os.path.dirname(p) or "/"
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


# --------------------------------------------------------------------------------------------- send

def cmd_send(args: list) -> None:
    (path, size, mtime_ns, offset), opts = parse(args, ("FILE", "SIZE", "MTIME_NS", "OFFSET"),
                                                 {"--hash": 0, "--cache": 1})
    size, mtime_ns, offset = int(size), int(mtime_ns), int(offset)
    do_hash = "--hash" in opts
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ToolError(f"{path} is a symbolic link now; not following it") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ToolError(f"{path} is not a regular file")
    if st.st_size != size or st.st_mtime_ns != mtime_ns:
        raise ToolError(f"{path} changed since the manifest was made (size {st.st_size}, expected {size})")
    if offset > size:
        raise ToolError(f"offset {offset} beyond the end of {path}")
    h = None
    if do_hash:
        h = sha256_file(path, offset) if offset else hashlib.sha256()
    outfd = sys.stdout.fileno()
    _grow_pipe(outfd)
    pos, left = offset, size - offset
    view = None
    if h is not None and left > 0:
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        view = memoryview(mm)
    step = 4 * CHUNK
    while left > 0:  # zero-copy out (sendfile); the hash reads the same page-cache pages
        n = min(left, step)
        if view is not None:
            h.update(view[pos:pos + n])
        end = pos + n
        while pos < end:
            try:
                m = os.sendfile(outfd, fd, pos, end - pos)
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.ENOSYS):
                    raise
                os.lseek(fd, pos, os.SEEK_SET)
                m = os.write(outfd, os.read(fd, end - pos))
            if m == 0:
                raise ToolError(f"{path} ended early")
            pos += m
        left -= n
    if view is not None:
        view.release()
        mm.close()
    if not _matches(_ident(st), os.fstat(fd)):
        raise ToolError(f"{path} changed while it was sent")
    trailer = b"DFLT" + (h.hexdigest() if h is not None else NO_HASH).encode() + b"\n"
    os.write(outfd, trailer)
    cache_dir = opts.get("--cache")
    if h is not None and cache_dir:  # the next sync (or listing) of this folder needs no hashing
        rel = os.path.relpath(path, cache_dir)
        if not rel.startswith(".."):
            _cache_update(cache_dir, [{"path": rel, **_ident(st), "sha256": h.hexdigest()}])


# --------------------------------------------- send-from (--tunnel's forced command, training host)

def cmd_send_from(args: list) -> None:
    """The forced command of a one-time key (``--tunnel``): ``send-from DIR send REL SIZE MTIME_NS
    OFFSET [--hash]``, the words after DIR being what the eval host asked for. Only ``send`` of a
    file under DIR, with DIR's manifest cache as ``--cache``: whoever holds the key reads that
    checkpoint's files, and nothing else, on this host."""
    if len(args) < 6 or args[1] != "send":
        raise ToolError("this key only sends a checkpoint's files")
    root, rel, flags = args[0], args[2], args[6:]
    parts = rel.split("/")
    if rel.startswith("/") or any(not x or x in (".", "..") or x.startswith(".") for x in parts):
        raise ToolError(f"refusing path {rel!r}")
    if flags not in ([], ["--hash"]):
        raise ToolError(f"unexpected arguments {flags!r}")
    path = os.path.join(root, rel)
    parent, top = os.path.realpath(os.path.dirname(path)), os.path.realpath(root)
    if parent != top and not parent.startswith(top.rstrip("/") + "/"):
        raise ToolError(f"{rel} is not under {root}")
    cmd_send([path, *args[3:6], *(["--hash", "--cache", root] if flags else [])])


# --------------------------------------------------------------------------------------------- recv

RECV_ARGS = ("RUNDIR", "CKPT", "REL", "SIZE", "OFFSET", "MTIME_NS", "TOKEN")
RECV_FLAGS = {"--sha256": 1, "--pull": 1}
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
TRAILER_LEN = 4 + 64 + 1
CHECK_EVERY = 0.5  # recv: how often to check it still belongs to the lock holder
PROGRESS_EVERY = 0.25
ALIGN = 4096  # direct writes: offsets and lengths in whole blocks
RECV_BUF, FLUSH_AT = 8 << 20, 4 << 20  # recv reads into RECV_BUF, writes once FLUSH_AT arrived
PARK = 0.2  # recv: a stream silent this long has what arrived written out (then IDLE_TIMEOUT)


def cmd_recv(args: list) -> int:
    """Receive one file; a full disk is answered ``NOSPACE ARRIVED`` (the bytes of the file now in
    its .part, kept for the resume), not left to surface as the sender's broken pipe."""
    try:
        return _recv(args)
    except OSError as e:
        if e.errno not in NO_SPACE:
            raise
        (rundir, ckpt, rel, *_), _ = parse(args, RECV_ARGS, RECV_FLAGS)
        part = os.path.join(paths(rundir, ckpt)["staging"], safe_rel(rel)) + ".part"
        try:
            arrived = os.stat(part).st_size
        except OSError:
            arrived = 0
        out(f"NOSPACE {arrived}")
        return 7


def _recv(args: list) -> int:
    pos, opts = parse(args, RECV_ARGS, RECV_FLAGS)
    pull = Pull(json.loads(opts["--pull"])) if "--pull" in opts else None
    rc = 1
    try:
        rc = _receive(pos, opts, pull.fd if pull else sys.stdin.fileno())
        return rc
    finally:
        if pull is not None:
            pull.close(grace=5.0 if rc == 0 else 0.0)  # a failed stream's sender is stopped now


class Pull:
    """``recv --pull ARGV``: the stream comes from a command this host runs (an OpenSSH client that
    starts the sender on the training host: ``--tunnel``, ``--direct``), not from stdin. Its stderr
    is passed on line by line as ``PULL ...``, so the orchestrator tells the training host's leg
    from the receiver's own failures."""

    def __init__(self, argv: list):
        import subprocess
        import threading

        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise ToolError("--pull: expected a JSON list of strings")
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE)
        except OSError as e:
            raise ToolError(f"cannot run {argv[0]}: {e.strerror}") from None
        self.fd = self.proc.stdout.fileno()
        self.relay = threading.Thread(target=self._relay, daemon=True)
        self.relay.start()

    def _relay(self) -> None:
        for raw in iter(self.proc.stderr.readline, b""):
            sys.stderr.write("PULL " + raw.decode(errors="replace").rstrip("\n") + "\n")
            sys.stderr.flush()

    def close(self, grace: float = 5.0) -> None:
        deadline = time.monotonic() + grace
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.relay.join(2)


def _receive(pos: list, opts: dict, inp: int) -> int:
    rundir, ckpt, rel, size, offset, mtime_ns, token = pos
    rel, size, offset, mtime_ns = safe_rel(rel), int(size), int(offset), int(mtime_ns)
    expected = opts.get("--sha256")
    p = paths(rundir, ckpt)
    if not _still_owner(p, token):
        raise ToolError("this sync does not hold the checkpoint lock")
    final = os.path.join(p["staging"], rel)
    part = final + ".part"
    os.makedirs(os.path.dirname(part), exist_ok=True)
    for stale in (final, os.path.join(p["verified"], rel + ".json")):
        if os.path.exists(stale):
            os.unlink(stale)
    fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise ToolError(f"{rel}.part is being written by another process")
    have = os.fstat(fd).st_size
    if offset == 0 and have:
        os.ftruncate(fd, 0)
        have = 0
    if have != offset:
        raise ToolError(f"{rel}.part holds {have} bytes, the plan expected {offset}; rerun")
    h = sha256_file(part, offset) if offset else hashlib.sha256()  # the prefix, read once
    os.lseek(fd, offset, os.SEEK_SET)
    _grow_pipe(inp)
    disk = Appender(fd, offset)
    buf = mmap.mmap(-1, RECV_BUF)  # page-aligned, as direct writes need
    view = memoryview(buf)
    left, got, fill = size - offset, 0, 0
    last_report = last_check = time.monotonic()
    out(f"P {got}")

    def stop(word: str, rc: int) -> int:
        disk.write(view, fill, final=True)  # what arrived is kept for the resume
        os.fsync(fd)
        out(f"{word} {got}")
        return rc
    while left > 0:
        r, _, _ = select.select([inp], [], [], PARK if fill else IDLE_TIMEOUT)
        if not r:
            if fill:  # the stream paused: what arrived goes to disk now
                fill = disk.write(view, fill, final=True)
                continue
            return stop("IDLE", 5)
        n = os.readv(inp, [view[fill:fill + min(left, RECV_BUF - fill)]])
        if n == 0:
            return stop("SHORT", 4)
        h.update(view[fill:fill + n])
        fill += n
        left -= n
        got += n
        if fill >= FLUSH_AT or left == 0:
            fill = disk.write(view, fill, final=left == 0)
        now = time.monotonic()
        if now - last_report >= PROGRESS_EVERY:
            out(f"P {got}")
            last_report = now
        if now - last_check >= CHECK_EVERY:
            last_check = now
            if not _still_owner(p, token):
                return stop("LOST", 6)
    trailer = b""
    while len(trailer) < TRAILER_LEN:
        r, _, _ = select.select([inp], [], [], IDLE_TIMEOUT)
        chunk = os.read(inp, TRAILER_LEN - len(trailer)) if r else b""
        if not chunk:
            os.fsync(fd)
            out(f"SHORT {got}")
            return 4
        trailer += chunk
    if not trailer.startswith(b"DFLT"):
        os.close(fd)
        os.unlink(part)
        out("BAD stream framing")
        return 3
    sent = trailer[4:68].decode()
    digest = h.hexdigest()
    want = [x for x in (expected, None if sent == NO_HASH else sent) if x]
    if not want:
        raise ToolError("no checksum to verify against")
    if any(w != digest for w in want):
        os.close(fd)
        os.unlink(part)  # the bad bytes go: the file is re-sent from zero
        out(f"BAD {digest} {want[0]}")
        return 3
    os.fsync(fd)
    os.close(fd)
    os.rename(part, final)
    _fsync_dir(os.path.dirname(final))
    vpath = os.path.join(p["verified"], rel + ".json")
    os.makedirs(os.path.dirname(vpath), exist_ok=True)
    _write_json_atomic(vpath, {"path": rel, "size": size, "mtime_ns": mtime_ns, "sha256": digest})
    out(f"P {got}")
    out(f"OK {digest}")
    return 0


def _still_owner(p: dict, token: str) -> bool:
    """Does the sync that started us still hold the lock? (the holder is alive and is ours)"""
    try:
        with open(p["owner"]) as f:
            if f.read().strip() != token:
                return False
    except OSError:
        return False
    fd = os.open(p["lock"], os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True  # held exclusively: by our holder (the token says so)
    finally:
        os.close(fd)
    return False  # nobody holds it: our holder is gone


class Appender:
    """Appends what ``recv`` received to the ``.part`` (fd) from position ``pos``. O_DIRECT where
    the file system takes it: the bytes go from our buffer to the disk, never copied into the page
    cache (on this project's 2-core machines that copy was the costliest and least steady part of
    recv). Direct writes must start and end on ALIGN boundaries, so ``write`` keeps an unaligned
    tail for the next call unless ``final``; elsewhere (or once unaligned) writes are buffered, and
    writeback starts as they go (sync_file_range), so the final fsync waits only for the tail."""

    def __init__(self, fd: int, pos: int):
        self.fd, self.pos, self.flushed = fd, pos, pos
        self.sync_range = _writeback()
        self.direct = pos % ALIGN == 0 and self._set_direct(True)

    def _set_direct(self, on: bool) -> bool:
        flag = getattr(os, "O_DIRECT", 0)
        try:
            fl = fcntl.fcntl(self.fd, fcntl.F_GETFL)
            fcntl.fcntl(self.fd, fcntl.F_SETFL, (fl | flag) if on else (fl & ~flag))
        except OSError:
            return False
        return on and bool(flag)

    def write(self, view: memoryview, n: int, final: bool = False) -> int:
        """Write ``view[:n]`` (without ``final``, only its whole blocks when direct); move what
        is left to the front of ``view``; return its length."""
        w = n if final or not self.direct else n - n % ALIGN
        done = 0
        while done < w:
            end = done + (w - done) // ALIGN * ALIGN if self.direct else w
            if end == done:  # less than a block left (final): buffered from here
                self.direct = self._set_direct(False)
                continue
            try:
                m = os.write(self.fd, view[done:end])
            except OSError as e:
                if not (self.direct and e.errno == errno.EINVAL):
                    raise
                self.direct = self._set_direct(False)  # the file system refused after all
                continue
            done += m
            self.pos += m
            if self.direct and m % ALIGN:
                self.direct = self._set_direct(False)
        if not self.direct and self.sync_range is not None and self.pos - self.flushed >= (16 << 20):
            self.sync_range(self.fd, self.flushed, self.pos - self.flushed)
            self.flushed = self.pos
        if w < n:
            view[:n - w] = view[w:n]
        return n - w


def _writeback():
    """sync_file_range(fd, off, n, SYNC_FILE_RANGE_WRITE), or None where unavailable."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
        fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
        return lambda fd, off, n: fn(fd, off, n, 2)
    except (OSError, AttributeError):
        return None


# -------------------------------------------------------- serve: the session, one per host per sync

class Busy(ToolError):
    """Another sync holds the lock (after waiting for it)."""


def cmd_serve(args: list) -> int:
    """Answer one request per line on stdin (``VERB [JSON]``) with one line on stdout (``VERB
    [ANSWER]``, ``BUSY ...`` or ``ERROR ...``; ``PING`` gets none) until stdin closes or stays silent for
    IDLE_TIMEOUT; then undo what the session set up (:class:`Serve`)."""
    parse(args, (), {})
    import signal

    session = Serve()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop)
    reader = LineReader()
    try:
        while True:
            line = reader.readline(IDLE_TIMEOUT)
            if line is None:
                return 5  # the orchestrator went silent (dead link): give everything back
            if not line:
                return 0
            verb, _, rest = line.strip().partition(" ")
            if verb == "PING":
                continue
            try:
                out(f"{verb} {session.handle(verb, rest)}".rstrip())
            except Busy as e:
                out(f"BUSY {e}")
            except (ToolError, OSError, ValueError, KeyError, TypeError) as e:
                out(f"ERROR {e}")
    finally:
        session.close()


class Serve:
    """What one ``serve`` process holds for a sync, and gives back when it ends however it ends
    (stdin closed, silent for IDLE_TIMEOUT, SIGTERM/SIGHUP): the destination lock (eval host), the
    one-time key (training host), the tunnel (eval host)."""

    def __init__(self):
        self.p = self.token = None
        self.lock_fd = -1
        self.grant: Grant | None = None
        self.tunnel: Tunnel | None = None

    def handle(self, verb: str, arg: str) -> str:
        """What follows ``VERB`` in the answer to a request."""
        a = json.loads(arg) if arg else {}
        if verb == "LIST":
            return json.dumps(listing(a))
        if verb == "MANIFEST":
            return json.dumps(manifest(a["dir"], bool(a.get("hash"))))
        if verb == "STATE":
            return json.dumps(state(a["rundir"], a["ckpt"]))
        if verb == "LOCK":
            if self.p is not None:
                raise ToolError("already locked")
            p = paths(a["rundir"], a["ckpt"])
            os.makedirs(a["rundir"], exist_ok=True)
            fd = _lock(p, float(a["wait"]))
            if fd < 0:
                raise Busy(f"another sync of {a['ckpt']} holds {p['lock']} (waited {float(a['wait']):g}s)")
            self.p, self.token, self.lock_fd = p, a["token"], fd
            _drain_writers(p, self.token)
            _tidy_final(p)  # a crash right after an earlier final rename
            return ""
        if verb in ("BEGIN", "FINALIZE") and self.p is None:
            raise ToolError(f"{verb} without the lock")
        if verb == "BEGIN":
            os.makedirs(self.p["staging"], exist_ok=True)
            with open(self.p["owner"], "w") as f:
                f.write(self.token)
            return ""
        if verb == "FINALIZE":
            return finalize(self.p, a)
        if verb == "GRANT":
            if self.grant is not None:
                raise ToolError("a key is already granted")
            self.grant = Grant(a["file"], a["key"], a["command"], a["token"])
            return json.dumps(self.grant.add())
        if verb == "REVOKE":
            if self.grant is not None:
                self.grant.remove()
                self.grant = None
            return ""
        if verb == "TUNNEL":
            if self.tunnel is not None:
                raise ToolError("a tunnel is already set up")
            self.tunnel = Tunnel(a["token"])
            return json.dumps(self.tunnel.describe())
        if verb == "PULL":
            if self.tunnel is None:
                raise ToolError("PULL without TUNNEL")
            self.tunnel.pull(a["argv"], a["known_hosts"], float(a.get("timeout", 30)))
            return ""
        if verb == "UNTUNNEL":
            if self.tunnel is not None:
                self.tunnel.close()
                self.tunnel = None
            return ""
        raise ToolError(f"unknown request {verb}")

    def close(self) -> None:
        for undo in (self.tunnel, self.grant):
            if undo is None:
                continue
            try:
                undo.close() if isinstance(undo, Tunnel) else undo.remove()
            except Exception as e:  # noqa: BLE001 - the other one is still undone
                sys.stderr.write(f"ERROR cleaning up: {e}\n")
        self.tunnel = self.grant = None


def _stop(signum, frame):
    raise SystemExit(128 + signum)


class LineReader:
    """Lines from fd 0 with a timeout (no hidden buffering behind select())."""

    def __init__(self):
        self.buf = b""

    def readline(self, timeout: float):
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            r, _, _ = select.select([0], [], [], max(deadline - time.monotonic(), 0))
            if not r:
                return None
            chunk = os.read(0, 1 << 16)
            if not chunk:
                line, self.buf = self.buf, b""
                return line.decode()
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode() + "\n"


# ---------------------------------------------------- serve: LOCK (the destination lock, eval host)

def _lock(p: dict, wait: float) -> int:
    fd = os.open(p["lock"], os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return -1
            time.sleep(0.2)


def _drain_writers(p: dict, token: str) -> None:
    """Orphan recv processes of a killed sync see the new token and stop; wait for their flocks."""
    if not os.path.isdir(p["staging"]):
        return
    with open(p["owner"], "w") as f:
        f.write(token)
    for dirpath, dirnames, filenames in os.walk(p["staging"]):
        for n in filenames:
            if not n.endswith(".part"):
                continue
            fd = os.open(os.path.join(dirpath, n), os.O_RDONLY)
            try:
                deadline = time.monotonic() + 10
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except OSError:
                        if time.monotonic() > deadline:
                            raise ToolError(f"{n} is still being written by another process")
                        time.sleep(0.1)
            finally:
                os.close(fd)


# ---------------------------------------------------------------------- serve: FINALIZE (eval host)

def finalize(p: dict, manifest_data: dict) -> str:
    """Rename the staging folder to the checkpoint's name once every file in the manifest was
    received and verified. The verification records stay until after the rename, so a crash at
    any point here leaves either a staging folder whose files a rerun skips, or the finished
    checkpoint (with records that the next ``hold`` tidies away)."""
    files = [{k: v for k, v in e.items() if k not in ("ino", "ctime_ns")}  # the source host's, not ours
             for e in manifest_data["files"]]
    staging = p["staging"]
    if os.path.exists(p["final"]):
        raise ToolError(f"{p['final']} appeared meanwhile; not replacing it")
    for e in files:
        rel = safe_rel(e["path"])
        try:
            with open(os.path.join(p["verified"], rel + ".json")) as f:
                rec = json.load(f)
        except (OSError, ValueError):
            raise ToolError(f"{rel} was not received and verified")
        if rec.get("sha256") != e["sha256"] or rec.get("size") != e["size"] or \
                os.path.getsize(os.path.join(staging, rel)) != e["size"]:
            raise ToolError(f"{rel} in staging does not match the manifest")
    wanted = {e["path"] for e in files}
    for dirpath, dirnames, filenames in os.walk(staging):
        if dirpath == staging:
            dirnames[:] = [d for d in dirnames if d != VERIFIED]
        for n in filenames:
            rel = os.path.relpath(os.path.join(dirpath, n), staging)
            if rel not in wanted and rel != OWNER:
                os.unlink(os.path.join(dirpath, n))  # leftovers (.part of files no longer in the ckpt)
    _write_json_atomic(os.path.join(staging, MANIFEST), {"files": files})
    for dirpath, _, _ in os.walk(staging):
        _fsync_dir(dirpath)
    os.rename(staging, p["final"])  # the checkpoint appears under its name only now, complete
    _fsync_dir(os.path.dirname(p["final"]))
    _tidy_final(p)
    return p["final"]


def _tidy_final(p: dict) -> None:
    """Drop the staging bookkeeping that a finished checkpoint carried through the rename."""
    if os.path.isdir(p["final"]):
        shutil.rmtree(os.path.join(p["final"], VERIFIED), ignore_errors=True)
        try:
            os.unlink(os.path.join(p["final"], OWNER))
        except FileNotFoundError:
            pass


# --------------------------- serve: GRANT, REVOKE (the one-time key on the training host, --tunnel)

KEY_TAG = "dflash-ops-sync-"  # the comment of every one-time key line this tool writes
KEY_TTL = 300.0  # backstop: sshd refuses the key after this long even if nothing removed the line


class Grant:
    """A one-time key in the training host's ``authorized_keys`` that the eval host's OpenSSH
    client logs in with through the tunnel: ``restrict`` (no forwarding, no pty), ``from`` this
    machine's address as the control connection came in, an ``expiry-time`` minutes away, and a
    forced ``command`` (the orchestrator's: ``send-from`` of one checkpoint folder, the tool's code
    pinned by its hash). The file is edited under a flock of its folder and replaced atomically,
    keeping its mode; ``remove`` takes the line out again (and expired lines of earlier syncs), and
    the file and folder if this grant created them."""

    def __init__(self, path: str, key: str, command: str, token: str):
        if any(c in key + command for c in "\r\n\0") or len(key.split()) != 2 or not token.isalnum():
            raise ToolError("refusing a malformed one-time key line")
        ip = (os.environ.get("SSH_CONNECTION") or "").split()[:1]
        if ip and not re.fullmatch(r"[0-9A-Fa-f.:]+", ip[0]):
            raise ToolError(f"unexpected client address {ip[0]!r} in SSH_CONNECTION")
        self.comment = KEY_TAG + token
        self.path = os.path.realpath(os.path.expanduser(path))
        self.source = ip[0] if ip else None
        opts = ["restrict"] + ([f'from="{self.source}"'] if self.source else []) + \
            [f'expiry-time="{_host_stamp(time.time() + KEY_TTL)}"', command]
        self.line = f"{','.join(opts)} {key} {self.comment}"
        self.made_dir = self.made_file = self.joined = False
        self.added = False

    def _edit(self, change) -> None:
        d = os.path.dirname(self.path)
        if not os.path.isdir(d):
            os.makedirs(d, mode=0o700)
            self.made_dir = True
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(dfd, fcntl.LOCK_EX)
            try:
                st = os.stat(self.path)
                with open(self.path, "rb") as f:
                    text = f.read().decode("utf-8", "surrogateescape")
            except FileNotFoundError:
                st, text = None, None
            if st is not None and st.st_uid != os.getuid():
                raise ToolError(f"{self.path} belongs to another user; not editing it")
            new = change(text)
            if new == text:
                return
            if new is None:
                os.unlink(self.path)
            else:
                tmp = os.path.join(d, f".{os.path.basename(self.path)}.dflash-{os.getpid()}")
                mode = stat.S_IMODE(st.st_mode) if st is not None else 0o600
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
                try:
                    os.write(fd, new.encode("utf-8", "surrogateescape"))
                    os.fchmod(fd, mode)
                    os.fsync(fd)
                    os.close(fd)
                    os.rename(tmp, self.path)
                except BaseException:
                    try:
                        os.unlink(tmp)
                    except OSError:
                        pass
                    raise
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def add(self) -> dict:
        def change(text):
            self.made_file = text is None
            text = "".join(ln for ln in (text or "").splitlines(True) if not _expired(ln, time.time()))
            self.joined = bool(text) and not text.endswith("\n")
            return text + ("\n" if self.joined else "") + self.line + "\n"
        self._edit(change)
        self.added = True
        import pwd
        return {"user": pwd.getpwuid(os.getuid()).pw_name, "from": self.source}

    def remove(self) -> None:
        if not self.added:
            return

        def change(text):
            if text is None:
                return None
            now = time.time()
            kept = [ln for ln in text.splitlines(True)
                    if ln.split()[-1:] != [self.comment] and not _expired(ln, now)]
            rest = "".join(kept)
            if self.joined and rest.endswith("\n"):  # the line break this grant added before its line
                rest = rest[:-1]
            return None if self.made_file and not rest.strip() else rest
        self._edit(change)
        self.added = False
        if self.made_dir:
            try:
                os.rmdir(os.path.dirname(self.path))
            except OSError:
                pass


def _host_stamp(t: float) -> str:
    """``t`` as sshd reads an ``expiry-time`` without a zone: the system's time zone (the login
    session's TZ, which sshd does not see, is dropped)."""
    os.environ.pop("TZ", None)
    time.tzset()
    return time.strftime("%Y%m%d%H%M%S", time.localtime(t))


def _expired(line: str, now: float) -> bool:
    """A one-time key line of this tool whose ``expiry-time`` has passed (left by a killed sync)."""
    words = line.split()
    m = re.search(r'expiry-time="(\d{14})"', line)
    if not words or not words[-1].startswith(KEY_TAG) or not m:
        return False
    os.environ.pop("TZ", None)
    time.tzset()
    return time.mktime(time.strptime(m.group(1), "%Y%m%d%H%M%S")) < now


# -------------------------------- serve: TUNNEL, PULL, UNTUNNEL (the tunnel's end on the eval host)

TUNNEL_PREFIX = "dflash-t-"


class Tunnel:
    """The eval host's end of ``--tunnel``, owned by one ``serve`` process: a private folder
    (0700, a short path: it holds Unix sockets) with a one-time key pair made here (the private key
    never leaves this host and is deleted once the connection is authenticated), the socket this
    machine's forward to the training host listens on (``t``), the training host's pinned key
    (``known_hosts``), and an OpenSSH master connection to the training host through that socket
    (``m``) that every file's sender rides. ``close`` ends the master and removes the folder."""

    def __init__(self, token: str):
        import tempfile

        self.ssh, keygen = shutil.which("ssh"), shutil.which("ssh-keygen")
        if not self.ssh or not keygen:
            raise ToolError("NOSSH this host has no OpenSSH client (ssh, ssh-keygen) on its PATH")
        tmp = tempfile.gettempdir()
        _sweep_tunnels(tmp)
        self.dir = tempfile.mkdtemp(prefix=TUNNEL_PREFIX, dir=tmp)
        self.master = None
        try:
            with open(os.path.join(self.dir, "pid"), "w") as f:
                f.write(str(os.getpid()))
            self.paths = {k: os.path.join(self.dir, v) for k, v in
                          (("socket", "t"), ("control", "m"), ("identity", "id"), ("known_hosts", "known_hosts"))}
            import subprocess
            res = subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-C", KEY_TAG + token, "-f",
                                  self.paths["identity"]], stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
            if res.returncode:
                raise ToolError(f"ssh-keygen failed: {res.stderr.decode(errors='replace').strip()}")
            with open(self.paths["identity"] + ".pub") as f:
                self.key = " ".join(f.read().split()[:2])
        except BaseException:
            self.close()
            raise

    def describe(self) -> dict:
        return dict(self.paths, dir=self.dir, key=self.key, ssh=self.ssh)

    def pull(self, argv: list, known_hosts: str, timeout: float) -> None:
        """Start the master connection to the training host (``argv``, built by the orchestrator)
        and wait until it is authenticated (its control socket appears)."""
        import subprocess

        if self.master is not None:
            raise ToolError("the tunnel's connection is already up")
        if "\n" in known_hosts.strip() or not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise ToolError("malformed PULL request")
        fd = os.open(self.paths["known_hosts"], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(known_hosts.strip() + "\n")
        log = os.path.join(self.dir, "log")
        with open(log, "wb") as err:
            self.master = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                           start_new_session=True)
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.paths["control"]):
            if self.master.poll() is not None or time.monotonic() > deadline:
                with open(log, "rb") as f:
                    lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
                why = lines[-1] if lines else (f"exit {self.master.returncode}" if self.master.poll() is not None
                                               else f"no connection after {timeout:g}s")
                raise ToolError(f"PULLFAIL {why}")
            time.sleep(0.02)
        for path in (self.paths["identity"], self.paths["identity"] + ".pub"):  # authenticated: done with it
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        m, self.master = self.master, None
        if m is not None and m.poll() is None:
            m.terminate()
            try:
                m.wait(3)
            except Exception:
                m.kill()
                m.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _sweep_tunnels(tmp: str) -> None:
    """Remove tunnel folders of this user whose ``serve`` process is gone (killed with SIGKILL)."""
    try:
        names = os.listdir(tmp)
    except OSError:
        return
    for n in names:
        d = os.path.join(tmp, n)
        if not n.startswith(TUNNEL_PREFIX):
            continue
        try:
            if os.lstat(d).st_uid != os.getuid():
                continue
            with open(os.path.join(d, "pid")) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if not _pid_alive(pid):
            shutil.rmtree(d, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ------------------------------------------------------------------------------- main: the dispatch

COMMANDS = {"list": cmd_list, "manifest": cmd_manifest, "state": cmd_state, "send": cmd_send,
            "send-from": cmd_send_from, "recv": cmd_recv, "serve": cmd_serve}


def main(argv: list) -> int:
    global IDLE_TIMEOUT
    if argv[:1] == ["--idle"] and len(argv) > 1:
        IDLE_TIMEOUT = float(argv[1])
        argv = argv[2:]
    if not argv or argv[0] not in COMMANDS:
        sys.stderr.write(f"ERROR usage: sync_host.py {{{','.join(COMMANDS)}}} ARGS\n")
        return 2
    try:
        return COMMANDS[argv[0]](argv[1:]) or 0
    except (ToolError, OSError, ValueError, IndexError) as e:
        sys.stderr.write(f"ERROR {e}\n")
        return 1
    except BrokenPipeError:
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
