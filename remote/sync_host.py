"""What `dflash-ops sync-ckpt` / `ckpts` run on a host: list, lock, send, receive. Stdlib only.

Shipped as an argument of ``python -c BOOTSTRAP BLOB ARGS`` (see ``orchestrator/sync/tool.py``), not on
stdin: for ``recv`` and ``serve`` stdin carries the data stream / the control lines.

Commands (all print JSON or simple lines on stdout; errors: one line ``ERROR ...`` on stderr):

* ``list ROOT --run NAME DIR PATTERN ...``  checkpoint folders of runs (step, size, newest mtime and
  ctime, every top-level file name: what the completeness rule reads; ``ident`` of its files and,
  for a synced copy, ``manifest_ident`` of the files it is a copy of: equal when the copy is current)
* ``manifest DIR [--hash]``  relative path, size, mtime_ns, inode, ctime_ns and sha256 of every
  file, dotfiles included (from the cache ``.dflash-manifest.json`` when none of size, mtime, inode,
  ctime changed; ``--hash`` computes missing ones), and ``excluded``: what is not sent and why (the
  sync's own bookkeeping, by exact name; sockets, pipes, devices). Refused when the folder is or
  holds symbolic links (never followed: they can point anywhere on the host), unfinished ``*.part``
  files or other ``.dflash-*`` names
* ``state RUNDIR CKPT``  read-only view of the destination (final folder, staging, free bytes);
  the destination is untrusted storage: below RUNDIR nothing is followed through a link (see
  "The destination is untrusted storage" below)
* ``send FILE SIZE MTIME_NS OFFSET [--hash] [--cache DIR]``  bytes [OFFSET, SIZE) on stdout, then a
  trailer ``DFLT<sha256 hex of the whole file or 64*'-'>\\n`` (hash continued over the prefix on
  resume); with ``--cache`` the hash goes into DIR's manifest cache too
* ``send-from DIR send REL SIZE MTIME_NS OFFSET [--hash]`` (or ``send-batch SPEC``)  the forced
  command of ``--tunnel``'s one-time key: ``send`` of files under DIR only
* ``send-batch DIR SPEC``  many small files in one stream, each framed (header, bytes, trailer)
* ``recv RUNDIR CKPT REL SIZE OFFSET MTIME_NS TOKEN [--sha256 X] [--pull ARGV_JSON]``  (stdin, or
  the stdout of the command ``--pull`` names: the ``send`` stream) appends to
  ``.staging-CKPT/REL.part`` (a digest-keyed name where that exceeds NAME_MAX), hashes in flight,
  verifies, fsyncs, renames to REL; a sender's ``DFLC`` trailer (the file changed under it)
  discards what arrived
* ``recv-batch RUNDIR CKPT TOKEN [--pull ARGV_JSON]``  the files of one ``send-batch`` stream, each
  as ``recv`` receives one (the file system synced once, at the end)
* ``serve``  one session per host per sync, a request per line on stdin: ``LIST``, ``MANIFEST``
  (training host), ``STATE``, ``LOCK`` (the checkpoint's flock, held until the session ends),
  ``BEGIN``, ``DISCARD``, ``FINALIZE <manifest json>`` (eval host; with ``"replace": DIGEST`` the copy
  already there is replaced when its manifest's :func:`copy_digest` is DIGEST), ``GRANT``/``REVOKE`` (a one-time key,
  training host), ``TUNNEL``/``PULL``/``UNTUNNEL`` (the tunnel's end, eval host), ``PING``;
  ``ALIVE`` lines while a request takes long; everything it set up is undone when it ends (by its
  :class:`Guardian` if its process is killed)

RUNDIR is ``<checkpoints root>/<run>``: the run's folder must be inside its parent, the checkpoints
root (:func:`_rundir_fd`).

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
SYNCED = ".dflash-synced.json"  # written at FINALIZE: {"ino": the copy's folder inode, "digest": its copy_digest}
RESERVED = ".dflash-"  # every bookkeeping name of the sync starts so
LONG_PART = RESERVED + "part-"  # the .part of a file whose NAME.part would exceed NAME_MAX
NAME_MAX = 255
# the sync's own names at the top of a checkpoint folder: never sent (the manifest lists them as excluded)
OWN = {MANIFEST: "the sync's manifest (sha256 of each file)", VERIFIED: "the sync's verification records",
       OWNER: "the sync's lock token", SYNCED: "the sync's record of the copy it made"}
CHUNK = 1 << 20
NO_HASH = "-" * 64
TRAILER, TRAILER_CHANGED = b"DFLT", b"DFLC"  # after a file's bytes: its sha256, or "it changed meanwhile"
CHANGED = "CHANGED"  # the first word of a sender's error when the file changed under it
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
    """What is under a checkpoint folder, sorted: ``files`` (relative path, stat) of the regular
    files, dotfiles included; ``links`` ("rel -> target") of the symbolic links, never followed;
    ``parts``, unfinished ``*.part`` files; ``reserved``, names the sync keeps for its own
    bookkeeping (``.dflash-*``) found where they are not its own; and ``excluded`` (path, why): the
    sync's own bookkeeping at the top (:data:`OWN`, by exact name) and anything that is not a
    regular file, folder or link."""

    def __init__(self, root: str):
        self.files, self.links, self.parts, self.reserved, self.excluded = [], [], [], [], []
        for dirpath, dirnames, filenames in os.walk(root):
            top = dirpath == root
            names = sorted(dirnames + filenames)
            dirnames[:] = []
            for name in names:
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, root)
                if top and _own(name):
                    self.excluded.append({"path": rel, "why": OWN.get(name, OWN[MANIFEST])})
                    continue
                try:
                    st = os.lstat(full)
                except OSError:
                    continue
                if stat.S_ISLNK(st.st_mode):
                    self.links.append(f"{rel} -> {os.readlink(full)}")
                elif name.startswith(RESERVED):
                    self.reserved.append(rel)
                elif stat.S_ISDIR(st.st_mode):
                    dirnames.append(name)
                elif not stat.S_ISREG(st.st_mode):
                    self.excluded.append({"path": rel, "why": "not a regular file (a socket, pipe or device)"})
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
        if self.reserved:
            raise ToolError(f"{root} holds names that sync-ckpt reserves for its own bookkeeping ({RESERVED}*): "
                            f"{_few(self.reserved)}; rename them")


def _few(items: list, n: int = 10) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def _ident(st) -> dict:
    """What a cached sha256 is keyed by: a rewrite that keeps size and mtime still changes ctime."""
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "ctime_ns": st.st_ctime_ns}


def _matches(entry: dict, st, keys=("size", "mtime_ns", "ino", "ctime_ns")) -> bool:
    ident = _ident(st)
    return all(entry.get(k) == ident[k] for k in keys)


def _own(name: str) -> bool:
    """One of the sync's own names at the top of a checkpoint folder (their temporary files
    included: :func:`_write_at`)."""
    return name in OWN or any(name.startswith(n + ".tmp") for n in (MANIFEST, SYNCED))


def sha256_file(path: str, limit: int | None = None, h=None):
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        return sha256_fd(fd, limit, h, path)
    finally:
        os.close(fd)


def sha256_fd(fd: int, limit: int | None = None, h=None, name: str = "file"):
    """sha256 of the first ``limit`` bytes (all: None) of the open file ``fd``."""
    h = h or hashlib.sha256()
    pos, left = 0, limit
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    while left is None or left > 0:
        n = os.preadv(fd, [view if left is None or left >= CHUNK else view[:left]], pos)
        if not n:
            break
        h.update(view[:n])
        pos += n
        if left is not None:
            left -= n
    if left:
        raise ToolError(f"{name}: shorter than {limit} bytes")
    return h


def _load_cache(d: str) -> dict:
    data = _read_json_at(None, os.path.join(d, MANIFEST))
    try:
        return {e["path"]: e for e in data.get("files", [])}
    except (AttributeError, KeyError, TypeError):
        return {}


def _write_json_atomic(path: str, data) -> None:
    dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        _write_at(dfd, os.path.basename(path), json.dumps(data, indent=1, sort_keys=True).encode())
    finally:
        os.close(dfd)


def _write_at(dfd: int, name: str, data: bytes, durable: bool = True) -> None:
    """Replace ``name`` in the folder ``dfd`` with ``data`` atomically: a temporary file created
    anew (never an existing one, nor through a link), fsynced, renamed over ``name`` (a link
    there is replaced, not followed)."""
    tmp = f"{name}.tmp{os.getpid()}"
    try:
        os.unlink(tmp, dir_fd=dfd)  # a killed writer's, or planted: the name only
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dfd)
    try:
        try:
            os.write(fd, data)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dfd)
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
    return {"rundir": rundir, "ckpt": ckpt, "final": os.path.join(rundir, ckpt), "staging": staging,
            "lock": os.path.join(rundir, f".lock-{ckpt}"), "old": os.path.join(rundir, f".old-{ckpt}"),
            "owner": os.path.join(staging, OWNER),
            "verified": os.path.join(staging, VERIFIED)}


def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# The destination is untrusted storage: whoever can write the run's folder on the eval host may
# have planted a link or other file where the sync expects its own. Below the run's folder every
# name is opened relative to a folder fd the sync holds and never through a link (O_NOFOLLOW): at
# the run's level (staging folder, lock, final name) one is refused, named; inside the staging
# folder (the sync's own) it is removed, never followed, as is whatever holds ``.old-CKPT`` (the
# sync's name for a copy it replaces, set aside between its two renames).

NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


class Odd(ToolError):
    """A link or other file where the sync expects its own folder or file."""


def _odd(shown: str, st, expect: str) -> Odd:
    what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a folder" if expect == "folder" else \
        "not a regular file"
    return Odd(f"{shown} is {what}, not the sync's own {expect}; sync-ckpt does not follow or replace it: "
               f"remove it (or move it away) and run the same command again")


def _open_dir(name: str, dfd: int, shown: str, create: bool = False, replace: bool = False) -> int:
    """The folder ``name`` in ``dfd``, opened without following a link; made if missing with
    ``create``; a link or file there is removed with ``replace``, else refused (:class:`Odd`)."""
    for _ in range(3):
        try:
            return os.open(name, NOFOLLOW_DIR, dir_fd=dfd)
        except FileNotFoundError:
            if not create:
                raise
            try:
                os.mkdir(name, 0o755, dir_fd=dfd)
            except FileExistsError:
                pass
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if not replace:
                raise _odd(shown, st, "folder") from None
            os.unlink(name, dir_fd=dfd)
    raise ToolError(f"{shown} keeps changing; not using it")


def _open_parent(sfd: int, rel: str, shown: str, create: bool = False) -> tuple[int, str]:
    """The folder holding ``rel`` under the staging folder ``sfd`` (a new fd) and ``rel``'s last
    name; with ``create`` missing folders are made and links or files in their place removed."""
    parts = rel.split("/")
    fd = os.dup(sfd)
    try:
        for i, name in enumerate(parts[:-1]):
            nxt = _open_dir(name, fd, os.path.join(shown, *parts[:i + 1]), create=create, replace=create)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd, parts[-1]


def _own_file(dfd: int, name: str, flags: int = os.O_RDWR | os.O_CREAT) -> int:
    """``name`` in ``dfd`` as a regular file of the sync's own (a link or other file there is
    removed first, never followed or opened)."""
    for _ in range(3):
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644, dir_fd=dfd)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            os.unlink(name, dir_fd=dfd)
            continue
        if stat.S_ISREG(os.fstat(fd).st_mode):
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
            return fd
        os.close(fd)
        os.unlink(name, dir_fd=dfd)
    raise ToolError(f"{name} keeps changing; not using it")


def _lstat_at(dfd: int, name: str):
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _rundir_fd(p: dict, create: bool = False) -> int:
    """The run's folder, opened (made first with ``create``). RUNDIR is ``<checkpoints root>/<run>``
    (its parent is the eval host's checkpoints root) and everything the sync writes, renames or
    removes is below it: a link in its place that leads out of the root is refused, named, before
    anything is made there; one that stays inside the root is followed. What was opened is checked,
    not the name, so a folder swapped for such a link meanwhile is refused too."""
    rundir = p["rundir"]
    root = os.path.realpath(os.path.dirname(os.path.abspath(rundir)))
    if create:
        _inside_root(rundir, root, None)
        os.makedirs(rundir, exist_ok=True)
    fd = os.open(rundir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _inside_root(rundir, root, fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _inside_root(rundir: str, root: str, fd: int | None) -> None:
    where = None
    if fd is not None:
        try:
            where = os.readlink(f"/proc/self/fd/{fd}")  # the folder opened, whatever its name leads to now
        except OSError:
            st, real = os.fstat(fd), os.path.realpath(rundir)
            if (st.st_dev, st.st_ino) != (os.stat(real).st_dev, os.stat(real).st_ino):
                raise ToolError(f"{rundir} keeps changing; not using it") from None
            where = real
    where = where or os.path.realpath(rundir)
    if where.startswith(root.rstrip("/") + "/"):
        return
    link = os.path.islink(rundir)
    raise Odd(f"{rundir} {'is a symbolic link to' if link else 'leads to'} {where}, outside the checkpoints root "
              f"{root}; sync-ckpt writes a run's checkpoints only inside that root: make {rundir} a folder there "
              f"(or a link to one inside {root}) and run the same command again")


def _staging(p: dict, create: bool = False) -> int:
    """The staging folder's fd (refused, named, when it is a link or not a folder)."""
    rfd = _rundir_fd(p)
    try:
        return _open_dir(os.path.basename(p["staging"]), rfd, p["staging"], create=create)
    finally:
        os.close(rfd)


def part_name(name: str) -> str:
    """The name a file arrives under: NAME.part, or where that exceeds NAME_MAX a digest of NAME."""
    if len(os.fsencode(name)) + len(".part") <= NAME_MAX:
        return name + ".part"
    return LONG_PART + _digest(name)


def record_name(rel: str) -> str:
    """A file's verification record in the staging folder's VERIFIED: keyed by a digest of its path."""
    return _digest(rel) + ".json"


def _digest(text: str) -> str:
    return hashlib.sha256(os.fsencode(text)).hexdigest()[:32]


def _discard(sfd: int, rel: str, shown: str) -> None:
    """Remove what the staging folder holds of ``rel``: the file, its .part, its record."""
    try:
        dfd, base = _open_parent(sfd, rel, shown)
    except (FileNotFoundError, Odd):
        dfd, base = None, None
    if dfd is not None:
        try:
            for n in (base, part_name(base)):
                try:
                    os.unlink(n, dir_fd=dfd)
                except FileNotFoundError:
                    pass
        finally:
            os.close(dfd)
    try:
        vfd = os.open(VERIFIED, NOFOLLOW_DIR, dir_fd=sfd)
    except OSError:
        return
    try:
        os.unlink(record_name(rel), dir_fd=vfd)
    except FileNotFoundError:
        pass
    finally:
        os.close(vfd)


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
        except OSError as e:
            runs[name] = {"dir": rdir, "exists": True, "unreadable": e.strerror or str(e), "checkpoints": [],
                          "staging": []}
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
            try:
                files = Walk(full).files
                fst, lst = os.stat(full), os.lstat(full)
            except OSError as e:
                runs[name] = {"dir": rdir, "exists": True, "unreadable": f"{n}: {e.strerror or e}",
                              "checkpoints": [], "staging": []}
                break
            complete = os.path.exists(os.path.join(full, MANIFEST))
            items.append({
                "name": n, "step": int(m.group(1)) if m else None,
                "size": sum(st.st_size for _, st in files), "files": len(files),
                "mtime": max([st.st_mtime for _, st in files] or [fst.st_mtime]),
                "ctime": max([st.st_ctime for _, st in files] or [fst.st_ctime]),  # this host's clock
                "complete": complete,
                "paths": [rel for rel, _ in files if "/" not in rel],   # the completeness rule's: top level, all
                "ident": ident([(rel, st.st_size, st.st_mtime_ns) for rel, st in files]),
                "manifest_ident": ident([(e.get("path"), e.get("size"), e.get("mtime_ns"))
                                         for e in _load_cache(full).values()]) if complete else None,
                "ino": lst.st_ino, "synced": complete and synced_here(full, lst),
                "lock": os.path.basename(paths(rdir, n)["lock"]),
            })
        else:
            runs[name] = {"dir": rdir, "exists": True, "checkpoints": items, "staging": staging}
    return {"runs": runs, "now": time.time()}


def synced_here(folder: str, lst) -> bool:
    """Did a sync make this folder here: its :data:`SYNCED` record names this very folder (its
    inode: a copy made by hand gets another) and the digest of the manifest it holds? A link is
    never a sync's copy."""
    if not stat.S_ISDIR(lst.st_mode):
        return False
    rec = _read_json_at(None, os.path.join(folder, SYNCED))
    return isinstance(rec, dict) and rec.get("ino") == lst.st_ino and \
        rec.get("digest") == copy_digest(list(_load_cache(folder).values()))


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
    if hashed:
        _cache_update(d, files)
    return {"files": files, "excluded": walk.excluded, "hashed": hashed, "now": time.time()}


# -------------------------------------------------------------------------------------------- state

def cmd_state(args: list) -> None:
    (rundir, ckpt), _ = parse(args, ("RUNDIR", "CKPT"), {})
    out(json.dumps(state(rundir, ckpt)))


def state(rundir: str, ckpt: str, rels: list | None = None) -> dict:
    """What the destination holds of the checkpoint. ``rels``, the manifest's paths, name the
    .part files of long names (:func:`part_name`). Verification records are only the plan's hint
    (which files need not be sent): :func:`finalize` trusts none it did not see written."""
    p = paths(rundir, ckpt)
    if _lstat_at(None, rundir) is not None:
        os.close(_rundir_fd(p))
    fst, sst = (_lstat_at(None, p[k]) for k in ("final", "staging"))
    for k, st in (("final", fst), ("staging", sst)):
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise _odd(p[k], st, "checkpoint folder" if k == "final" else "staging folder")
    res = {"final": p["final"], "final_exists": fst is not None, "final_manifest": None,
           "staging_exists": sst is not None, "parts": {}, "verified": {},
           "free_bytes": _free_bytes(rundir)}
    if fst is not None:
        res["final_manifest"] = list(_load_cache(p["final"]).values()) or None
        res["final_digest"] = copy_digest(res["final_manifest"])
    if sst is None:
        return res
    long = {}
    for rel in rels or []:
        d, _, base = rel.rpartition("/")
        if part_name(base).startswith(LONG_PART):
            long[os.path.join(d, part_name(base))] = rel
    sfd = _staging(p)
    try:
        for dirpath, dirnames, filenames, dfd in os.fwalk(".", dir_fd=sfd):
            if dirpath == ".":
                dirnames[:] = [d for d in dirnames if d != VERIFIED]
            for n in filenames:
                rel = os.path.normpath(os.path.join(dirpath, n))
                st = _lstat_at(dfd, n)
                if st is None or not stat.S_ISREG(st.st_mode):
                    continue
                if n.endswith(".part"):
                    res["parts"][rel[:-5]] = st.st_size
                elif rel in long:
                    res["parts"][long[rel]] = st.st_size
        try:
            vfd = os.open(VERIFIED, NOFOLLOW_DIR, dir_fd=sfd)
        except OSError:
            return res
        try:
            for n in os.listdir(vfd):
                rec = _read_json_at(vfd, n) if n.endswith(".json") else None
                rel = rec.get("path") if isinstance(rec, dict) else None
                if not isinstance(rel, str) or n != record_name(rel):
                    continue
                try:
                    dfd, base = _open_parent(sfd, safe_rel(rel), p["staging"])
                except (OSError, ToolError):
                    continue
                try:
                    st = _lstat_at(dfd, base)
                finally:
                    os.close(dfd)
                if st is not None and stat.S_ISREG(st.st_mode) and st.st_size == rec.get("size"):
                    res["verified"][rel] = rec
        finally:
            os.close(vfd)
    finally:
        os.close(sfd)
    return res


def copy_digest(entries: list | None) -> str | None:
    """What a synced copy is a copy of, in one sha256: its manifest's path, size, mtime and sha256
    of every file (None without a manifest). A caller that recorded it for a copy it made may have
    that copy replaced (``FINALIZE``'s ``replace``)."""
    if not entries:
        return None
    h = hashlib.sha256()
    for e in sorted(entries, key=lambda e: str(e.get("path"))):
        h.update(json.dumps([e.get("path"), e.get("size"), e.get("mtime_ns"), e.get("sha256")]).encode() + b"\n")
    return h.hexdigest()


def _read_json_at(dfd: int | None, name: str):
    """A JSON file of the sync's own, or None: never read through a link, nor from a pipe."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


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
    outfd = sys.stdout.fileno()
    _grow_pipe(outfd)
    st, digest = send_file(path, int(size), int(mtime_ns), int(offset), "--hash" in opts, outfd)
    cache_dir = opts.get("--cache")
    if digest and cache_dir:  # the next sync (or listing) of this folder needs no hashing
        rel = os.path.relpath(path, cache_dir)
        if not rel.startswith(".."):
            _cache_update(cache_dir, [{"path": rel, **_ident(st), "sha256": digest}])


class Changed(ToolError):
    """The file changed under its sender (after ``send_file(framed=True)`` sent its frame)."""


def send_file(path: str, size: int, mtime_ns: int, offset: int, do_hash: bool, outfd: int,
              framed: bool = False) -> tuple:
    """Bytes [offset, size) of ``path`` to ``outfd``, then its trailer; (stat, sha256 hex or None).
    A file that changed under it fails with a ``CHANGED`` error; ``framed`` (``send-batch``): the
    stream keeps its framing first (zeros for the bytes not sent, a ``DFLC`` trailer: the
    receiver discards them) and :class:`Changed` is raised."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ToolError(f"{path} is a symbolic link now; not following it") from None
        raise
    try:
        return _send_fd(fd, path, size, mtime_ns, offset, do_hash, outfd)
    except _Cut as e:
        if framed:
            _write_zeros(outfd, size - e.pos)
            os.write(outfd, TRAILER_CHANGED + NO_HASH.encode() + b"\n")
            raise Changed(str(e)) from None
        if e.pos == size:  # every byte out: the trailer says it changed
            os.write(outfd, TRAILER_CHANGED + NO_HASH.encode() + b"\n")
        raise ToolError(str(e)) from None
    finally:
        os.close(fd)


class _Cut(ToolError):
    """The file changed while ``pos`` bytes of the stream's were out."""

    def __init__(self, message: str, pos: int):
        super().__init__(message)
        self.pos = pos


def _write_zeros(outfd: int, n: int) -> None:
    zeros = bytes(min(n, CHUNK))
    while n > 0:
        n -= os.write(outfd, zeros[:min(n, CHUNK)])


def _send_fd(fd: int, path: str, size: int, mtime_ns: int, offset: int, do_hash: bool, outfd: int) -> tuple:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ToolError(f"{path} is not a regular file")
    if offset > size:
        raise ToolError(f"offset {offset} beyond the end of {path}")
    if st.st_size != size or st.st_mtime_ns != mtime_ns:
        raise _Cut(f"{CHANGED} {path} changed since the manifest was made (size {st.st_size}, expected {size})",
                   offset)
    h = None
    if do_hash:
        h = sha256_fd(fd, offset, name=path) if offset else hashlib.sha256()
    pos, left = offset, size - offset
    view = None
    if h is not None and left > 0:
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        view = memoryview(mm)
    step = 4 * CHUNK
    try:
        while left > 0:  # zero-copy out (sendfile); the hash reads the same page-cache pages
            n = min(left, step)
            if view is not None:
                if os.fstat(fd).st_size < pos + n:  # truncated: reading the map there would be SIGBUS
                    raise _Cut(f"{CHANGED} {path} changed while it was sent (it is shorter now)", pos)
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
                    raise _Cut(f"{CHANGED} {path} changed while it was sent (it ended early)", pos)
                pos += m
            left -= n
    finally:
        if view is not None:
            view.release()
            mm.close()
    if not _matches(_ident(st), os.fstat(fd)):
        raise _Cut(f"{CHANGED} {path} changed while it was sent", pos)
    digest = h.hexdigest() if h is not None else None
    os.write(outfd, TRAILER + (digest or NO_HASH).encode() + b"\n")
    return st, digest


# ------------------------------------------------------------------------------------- send-batch

BATCH_HEAD, BATCH_END = b"DFLH", b"DFLE00000000"  # then the header's length (8 hex digits) and the header


def cmd_send_batch(args: list) -> None:
    """``send-batch DIR SPEC``: many small files in one stream (one process pair for all, not one
    per file). SPEC: base64 of zlib'd JSON ``[[REL, SIZE, MTIME_NS, OFFSET], ...]`` (REL under DIR).
    Each file goes as a header ``DFLH`` LENGTH (8 hex digits) ``[REL, SIZE, MTIME_NS, OFFSET]``, its bytes and its
    trailer (sha256 always: they are small; a file that changed goes as zeros and ``DFLC``), then
    ``DFLE``; DIR's manifest cache gets every sha256 at the end, at once."""
    (root, spec), _ = parse(args, ("DIR", "SPEC"), {})
    outfd = sys.stdout.fileno()
    _grow_pipe(outfd)
    entries, changed = [], []
    for rel, size, mtime_ns, offset in batch_spec(spec):
        head = json.dumps([rel, size, mtime_ns, offset]).encode()
        os.write(outfd, BATCH_HEAD + b"%08x" % len(head) + head)
        try:
            st, digest = send_file(under(root, rel), size, mtime_ns, offset, True, outfd, framed=True)
        except Changed as e:
            changed.append(str(e))
            continue
        entries.append({"path": rel, **_ident(st), "sha256": digest})
    os.write(outfd, BATCH_END)
    _cache_update(root, entries)
    if changed:
        sys.stderr.write("".join(f"ERROR {c}\n" for c in changed))


def batch_spec(spec: str) -> list:
    import base64
    import zlib

    files = json.loads(zlib.decompress(base64.b64decode(spec)))
    for rel, size, mtime_ns, offset in files:
        if not isinstance(rel, str) or not all(isinstance(v, int) and v >= 0 for v in (size, mtime_ns, offset)) \
                or offset > size:
            raise ToolError(f"malformed batch entry for {rel!r}")
    return files


# --------------------------------------------- send-from (--tunnel's forced command, training host)

def cmd_send_from(args: list) -> None:
    """The forced command of a one-time key (``--tunnel``): ``send-from DIR send REL SIZE MTIME_NS
    OFFSET [--hash]`` or ``send-from DIR send-batch SPEC``, the words after DIR being what the eval
    host asked for. Only ``send`` or ``send-batch`` of files under DIR (dotfiles too; not the
    sync's own ``.dflash-*``), with DIR's manifest cache as ``--cache``: whoever holds the key reads
    that checkpoint's files, and nothing else, on this host."""
    if len(args) == 3 and args[1] == "send-batch":
        return cmd_send_batch([args[0], args[2]])
    if len(args) < 6 or args[1] != "send":
        raise ToolError("this key only sends a checkpoint's files")
    root, rel, flags = args[0], args[2], args[6:]
    if flags not in ([], ["--hash"]):
        raise ToolError(f"unexpected arguments {flags!r}")
    path = under(root, rel)
    cmd_send([path, *args[3:6], *(["--hash", "--cache", root] if flags else [])])


def under(root: str, rel: str) -> str:
    """``root/rel``, refused unless it names a file under ``root`` (no ``..``, no link on the way
    out of it, none of the sync's own ``.dflash-*`` names)."""
    parts = rel.split("/")
    if rel.startswith("/") or any(not x or x in (".", "..") or x.startswith(RESERVED) for x in parts):
        raise ToolError(f"refusing path {rel!r}")
    path = os.path.join(root, rel)
    parent, top = os.path.realpath(os.path.dirname(path)), os.path.realpath(root)
    if parent != top and not parent.startswith(top.rstrip("/") + "/"):
        raise ToolError(f"{rel} is not under {root}")
    return path


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
    part = [None]  # the open .part, once there is one
    try:
        return _recv(args, part)
    except OSError as e:
        if e.errno not in NO_SPACE:
            raise
        try:
            arrived = os.fstat(part[0]).st_size if part[0] is not None else 0
        except OSError:
            arrived = 0
        out(f"NOSPACE {arrived}")
        return 7


def _recv(args: list, part: list) -> int:
    pos, opts = parse(args, RECV_ARGS, RECV_FLAGS)
    pull = Pull(json.loads(opts["--pull"])) if "--pull" in opts else None
    rc = 1
    try:
        rc = _receive(pos, opts, pull.fd if pull else sys.stdin.fileno(), part)
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
        """Wait ``grace`` s for the command to end (then kill it); its exit status goes to stderr
        as ``PULLRC N``: an OpenSSH client that exits 255 and says nothing saw the sender killed."""
        deadline = time.monotonic() + grace
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.relay.join(2)
        sys.stderr.write(f"PULLRC {self.proc.returncode}\n")
        sys.stderr.flush()


def _receive(pos: list, opts: dict, inp: int, opened: list) -> int:
    rundir, ckpt, rel, size, offset, mtime_ns, token = pos
    rel, size, offset, mtime_ns = safe_rel(rel), int(size), int(offset), int(mtime_ns)
    expected = opts.get("--sha256")
    p = paths(rundir, ckpt)
    sfd = _staging(p)
    try:
        if not _still_owner(p, token, sfd):
            raise ToolError("this sync does not hold the checkpoint lock")
        dfd, base = _open_parent(sfd, rel, p["staging"], create=True)
        try:
            vfd = _open_dir(VERIFIED, sfd, p["verified"], create=True, replace=True)
            try:
                return _receive_into(p, sfd, dfd, base, vfd, rel, size, offset, mtime_ns, token, expected,
                                     inp, opened)
            finally:
                os.close(vfd)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


def _receive_into(p, sfd, dfd, base, vfd, rel, size, offset, mtime_ns, token, expected, inp, opened,
                  durable: bool = True) -> int:
    """``_receive`` with the staging folder (``sfd``), the file's folder there (``dfd``) and the
    records' folder (``vfd``) open: every name below is opened relative to them. Not ``durable``
    (``recv-batch``): no fsync per file; the batch syncs the file system once at its end."""
    part = part_name(base)
    for d, stale in ((dfd, base), (vfd, record_name(rel))):
        st = _lstat_at(d, stale)
        if st is not None and stat.S_ISDIR(st.st_mode):
            raise _odd(os.path.join(p["staging"], rel), st, "file")
        if st is not None:
            os.unlink(stale, dir_fd=d)
    fd = _own_file(dfd, part)
    opened[0] = fd
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ToolError(f"{rel}.part is being written by another process")
    have = os.fstat(fd).st_size
    if offset == 0 and have:
        os.ftruncate(fd, 0)
        have = 0
    if have != offset:
        os.close(fd)
        raise ToolError(f"{rel}.part holds {have} bytes, the plan expected {offset}; rerun")
    h = sha256_fd(fd, offset, name=f"{rel}.part") if offset else hashlib.sha256()  # the prefix, read once
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
            if not _still_owner(p, token, sfd):
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
    if trailer.startswith(TRAILER_CHANGED):  # the source changed under its sender: what came is no one file
        os.close(fd)
        os.unlink(part, dir_fd=dfd)
        out("CHANGED")
        return 8
    if not trailer.startswith(TRAILER):
        os.close(fd)
        os.unlink(part, dir_fd=dfd)
        out("BAD stream framing")
        return 9
    sent = trailer[4:68].decode()
    digest = h.hexdigest()
    want = [x for x in (expected, None if sent == NO_HASH else sent) if x]
    if not want:
        os.close(fd)
        raise ToolError("no checksum to verify against")
    if any(w != digest for w in want):
        os.close(fd)
        os.unlink(part, dir_fd=dfd)  # the bad bytes go: the file is re-sent from zero
        out(f"BAD {digest} {want[0]}")
        return 3
    if durable:
        os.fsync(fd)
    os.close(fd)
    os.rename(part, base, src_dir_fd=dfd, dst_dir_fd=dfd)
    if durable:
        os.fsync(dfd)
    st = os.stat(base, dir_fd=dfd, follow_symlinks=False)
    # what finalize trusts without reading the file again: written by this sync (token), this inode,
    # unchanged since (ctime)
    _write_at(vfd, record_name(rel), json.dumps({"path": rel, "size": size, "mtime_ns": mtime_ns, "sha256": digest,
                                                 "token": token, "ino": st.st_ino,
                                                 "ctime_ns": st.st_ctime_ns}).encode(), durable)
    out(f"P {got}")
    out(f"OK {digest}")
    return 0


def _still_owner(p: dict, token: str, sfd: int) -> bool:
    """Does the sync that started us still hold the lock? (the holder is alive and is ours)"""
    if (_read_text_at(sfd, OWNER) or "").strip() != token:
        return False
    try:
        fd = os.open(p["lock"], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True  # held exclusively: by our holder (the token says so)
    finally:
        os.close(fd)
    return False  # nobody holds it: our holder is gone


def _read_text_at(dfd: int, name: str) -> str | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
    except OSError:
        return None
    try:
        return os.read(fd, 4096).decode(errors="replace") if stat.S_ISREG(os.fstat(fd).st_mode) else None
    finally:
        os.close(fd)


def cmd_recv_batch(args: list) -> int:
    """``recv-batch RUNDIR CKPT TOKEN [--pull ARGV_JSON]``: the files of one ``send-batch`` stream,
    each as ``recv`` receives one; per file ``F REL``, then its ``P``/``OK``/``BAD``/``CHANGED``
    lines; ``END`` once the stream ended whole (the file system synced). A full disk: ``NOSPACE``."""
    part = [None]
    try:
        return _recv_batch(args, part)
    except OSError as e:
        if e.errno not in NO_SPACE:
            raise
        out("NOSPACE 0")
        return 7


def _recv_batch(args: list, opened: list) -> int:
    (rundir, ckpt, token), opts = parse(args, ("RUNDIR", "CKPT", "TOKEN"), {"--pull": 1})
    pull = Pull(json.loads(opts["--pull"])) if "--pull" in opts else None
    inp = pull.fd if pull else sys.stdin.fileno()
    rc = 1
    p = paths(rundir, ckpt)
    sfd = _staging(p)
    try:
        if not _still_owner(p, token, sfd):
            raise ToolError("this sync does not hold the checkpoint lock")
        vfd = _open_dir(VERIFIED, sfd, p["verified"], create=True, replace=True)
        try:
            while True:
                frame = _read_exact(inp, len(BATCH_END))
                if frame == BATCH_END:
                    _syncfs(sfd)
                    out("END")
                    rc = 0
                    return rc
                head = _read_exact(inp, int(frame[4:], 16)) if frame and frame.startswith(BATCH_HEAD) and \
                    re.fullmatch(rb"[0-9a-f]{8}", frame[4:]) and int(frame[4:], 16) <= 1 << 16 else None
                if head is None:
                    out("SHORT 0" if frame is None else "BAD stream framing")
                    rc = 4
                    return rc
                rel, size, mtime_ns, offset = json.loads(head)
                rel = safe_rel(rel)
                out(f"F {rel}")
                dfd, base = _open_parent(sfd, rel, p["staging"], create=True)
                try:
                    rc = _receive_into(p, sfd, dfd, base, vfd, rel, int(size), int(offset), int(mtime_ns), token,
                                       None, inp, opened, durable=False)
                finally:
                    os.close(dfd)
                if rc not in (0, 3, 8):  # a bad or changed file ends whole: the stream goes on
                    return rc
        finally:
            os.close(vfd)
    finally:
        os.close(sfd)
        if pull is not None:
            pull.close(grace=5.0 if rc == 0 else 0.0)


def _read_exact(inp: int, n: int):
    """``n`` bytes of the stream, or None where it ends (or stays silent for IDLE_TIMEOUT) first."""
    got = b""
    while len(got) < n:
        r, _, _ = select.select([inp], [], [], IDLE_TIMEOUT)
        chunk = os.read(inp, n - len(got)) if r else b""
        if not chunk:
            return None
        got += chunk
    return got


def _syncfs(fd: int) -> None:
    """Everything written to the file system holding ``fd`` reaches the disk (one call for a batch)."""
    try:
        import ctypes
        if ctypes.CDLL(None, use_errno=True).syncfs(fd) == 0:
            return
    except (OSError, AttributeError):
        pass
    os.sync()


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
    if "fn" not in _WRITEBACK:
        _WRITEBACK["fn"] = _load_writeback()
    return _WRITEBACK["fn"]


_WRITEBACK: dict = {}


def _load_writeback():
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
    IDLE_TIMEOUT; then undo what the session set up (:class:`Serve`). A request that takes longer
    than a beat (:func:`_beat`) is accompanied by ``ALIVE`` lines until its answer: the orchestrator
    tells a session that works (hashing a checkpoint) from one that is stopped or hung."""
    parse(args, (), {})
    import signal
    import threading

    session = Serve()  # forks its guardian: before any thread or signal handler of ours
    reader = session.reader = LineReader()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop)
    lock, busy = threading.Lock(), threading.Event()

    def say(line: str) -> None:
        with lock:
            out(line)
    threading.Thread(target=_beat, args=(busy, say), daemon=True).start()
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
            busy.set()
            try:
                answer = f"{verb} {session.handle(verb, rest)}".rstrip()
            except Busy as e:
                answer = f"BUSY {e}"
            except (ToolError, OSError, ValueError, KeyError, TypeError) as e:
                answer = f"ERROR {e}"
            busy.clear()
            say(answer)
    finally:
        session.close()


def _beat(busy, say) -> None:
    """``ALIVE`` every :func:`beat` while a request is being answered, from the first beat on: the
    orchestrator's wait for an answer gives up after IDLE_TIMEOUT without a line (a stopped or hung
    session, a stalled link), not after the request's whole time limit."""
    while True:
        busy.wait()
        time.sleep(beat())
        if busy.is_set():
            say("ALIVE")


def beat() -> float:
    return min(2.0, IDLE_TIMEOUT / 4)


class Serve:
    """What one ``serve`` process holds for a sync, and gives back when it ends however it ends
    (stdin closed, silent for IDLE_TIMEOUT, SIGTERM/SIGHUP; SIGKILL: its :class:`Guardian`): the
    destination lock (eval host: the kernel drops it with the process), the one-time key (training
    host), the tunnel (eval host)."""

    def __init__(self):
        self.reader: LineReader | None = None
        self.p = self.token = None
        self.lock_fd = -1
        self.grant: Grant | None = None
        self.tunnel: Tunnel | None = None
        self.guardian = Guardian()

    def handle(self, verb: str, arg: str) -> str:
        """What follows ``VERB`` in the answer to a request."""
        a = json.loads(arg) if arg else {}
        if verb == "LIST":
            return json.dumps(listing(a))
        if verb == "MANIFEST":
            return json.dumps(manifest(a["dir"], bool(a.get("hash"))))
        if verb == "STATE":
            return json.dumps(state(a["rundir"], a["ckpt"], a.get("paths")))
        if verb == "LOCK":
            if self.p is not None:
                raise ToolError("already locked")
            p = paths(a["rundir"], a["ckpt"])
            rfd = _rundir_fd(p, create=True)
            try:
                fd = _lock(p, rfd, float(a["wait"]))
            finally:
                os.close(rfd)
            if fd < 0:
                raise Busy(f"another sync of {a['ckpt']} holds {p['lock']} (waited {float(a['wait']):g}s)")
            self.p, self.token, self.lock_fd = p, a["token"], fd
            _drain_writers(p, self.token)
            _tidy_final(p)  # a crash right after an earlier final rename
            return ""
        if verb in ("BEGIN", "DISCARD", "FINALIZE") and self.p is None:
            raise ToolError(f"{verb} without the lock")
        if verb == "BEGIN":
            sfd = _staging(self.p, create=True)
            try:
                _write_at(sfd, OWNER, self.token.encode())
            finally:
                os.close(sfd)
            return ""
        if verb == "DISCARD":  # files that changed on the training host while they were sent
            sfd = _staging(self.p)
            try:
                for rel in a["paths"]:
                    _discard(sfd, safe_rel(rel), self.p["staging"])
            finally:
                os.close(sfd)
            return ""
        if verb == "FINALIZE":
            return finalize(self.p, a, self.token, self.given_up)
        if verb == "GRANT":
            if self.grant is not None:
                raise ToolError("a key is already granted")
            self.grant = Grant(a["file"], a["key"], a["command"], a["token"])
            self.guardian.hold("grant", self.grant.held())  # before the line is there: a kill meanwhile is covered
            return json.dumps(self.grant.add())
        if verb == "REVOKE":
            if self.grant is not None:
                self.grant.remove()
                self.grant = None
                self.guardian.hold("grant", None)
            return ""
        if verb == "TUNNEL":
            if self.tunnel is not None:
                raise ToolError("a tunnel is already set up")
            self.tunnel = Tunnel(a["token"], lambda held: self.guardian.hold("tunnel", held))
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
                self.guardian.hold("tunnel", None)
            return ""
        raise ToolError(f"unknown request {verb}")

    def given_up(self) -> bool:
        """May the orchestrator have given up on this session? Its input ended, or has been silent
        (it pings every few seconds) for so long that the orchestrator, hearing nothing from here
        over the same link, has stopped waiting: it does after IDLE_TIMEOUT without a line, and the
        last ``ALIVE`` it could have heard left here a beat before the silence began."""
        return self.reader.ended() or self.reader.silent_for() > IDLE_TIMEOUT - beat()

    def close(self) -> None:
        for kind, undo in (("tunnel", self.tunnel), ("grant", self.grant)):
            if undo is None:
                continue
            try:
                undo.close() if isinstance(undo, Tunnel) else undo.remove()
                self.guardian.hold(kind, None)
            except Exception as e:  # noqa: BLE001 - the other one is still undone
                sys.stderr.write(f"ERROR cleaning up: {e}\n")
        self.tunnel = self.grant = None
        self.guardian.close()


class Guardian:
    """Undoes what its ``serve`` process set up on the host (the one-time key, the tunnel) if that
    process dies without doing so itself (SIGKILL, the OOM killer). It is a process of its own
    (forked, in its own session, its standard streams on /dev/null, so it holds nothing of the
    session: not its connection, not the lock) reading a pipe that only the ``serve`` process writes:
    ``[KIND, WHAT]`` when the session set something up (``WHAT`` None: undone). The pipe's end
    (the ``serve`` process gone, however) with something still held: it undoes that and exits."""

    def __init__(self):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # a child that forks the guardian and exits at once: nobody has to wait for it
            try:
                os.close(w)
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                os.setsid()
                if os.fork() == 0:
                    _guard(r)
            finally:
                os._exit(0)
        os.close(r)
        os.waitpid(pid, 0)
        self.w: int | None = w

    def hold(self, kind: str, what) -> None:
        if self.w is not None:
            os.write(self.w, (json.dumps([kind, what]) + "\n").encode())

    def close(self) -> None:
        if self.w is not None:
            os.close(self.w)
            self.w = None


def _guard(r: int) -> None:
    import signal

    for sig in (signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    os.closerange(3, r)
    os.closerange(r + 1, 1 << 16)
    held, buf = {}, b""
    while True:
        chunk = os.read(r, 1 << 16)
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            kind, what = json.loads(line)
            held[kind] = what
    for kind, what in held.items():
        if what is None:
            continue
        try:
            (Grant.revoke_held if kind == "grant" else Tunnel.close_held)(what)
        except Exception:  # noqa: BLE001 - the other one is still undone
            pass


def _stop(signum, frame):
    raise SystemExit(128 + signum)


class LineReader:
    """Lines from fd 0, read by a thread of their own as they come: the session knows when the
    orchestrator last spoke (:meth:`silent_for`) and whether its input has ended, also while it
    works on a request."""

    def __init__(self):
        import queue
        import threading

        self.lines: queue.Queue = queue.Queue()
        self.eof = False
        self.last = time.monotonic()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(0, 1 << 16)
            except OSError:
                chunk = b""
            self.last = time.monotonic()
            if not chunk:
                if buf:
                    self.lines.put(buf.decode(errors="replace"))  # a last line without its newline
                self.eof = True
                self.lines.put("")
                return
            *lines, buf = (buf + chunk).split(b"\n")
            for line in lines:
                self.lines.put(line.decode(errors="replace") + "\n")

    def readline(self, timeout: float):
        """The next line (with its newline), "" once the input ended, None after ``timeout`` s."""
        import queue

        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return None

    def ended(self) -> bool:
        """Has stdin ended (the orchestrator gone, or given up on this session)?"""
        return self.eof

    def silent_for(self) -> float:
        return time.monotonic() - self.last


# ---------------------------------------------------- serve: LOCK (the destination lock, eval host)

def _lock(p: dict, rfd: int, wait: float) -> int:
    name = os.path.basename(p["lock"])
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644, dir_fd=rfd)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise _odd(p["lock"], _lstat_at(rfd, name), "lock file") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _odd(p["lock"], _lstat_at(rfd, name), "lock file")
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
    if _lstat_at(None, p["staging"]) is None:
        return
    sfd = _staging(p)
    try:
        _write_at(sfd, OWNER, token.encode())
        for dirpath, dirnames, filenames, dfd in os.fwalk(".", dir_fd=sfd):
            for n in filenames:
                if not (n.endswith(".part") or n.startswith(LONG_PART)):
                    continue
                try:
                    fd = os.open(n, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
                except OSError:
                    continue  # a link: the receiver removes it
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
    finally:
        os.close(sfd)


# ---------------------------------------------------------------------- serve: FINALIZE (eval host)

def finalize(p: dict, manifest_data: dict, token: str, abandoned=lambda: False) -> str:
    """Rename the staging folder to the checkpoint's name once every file in the manifest is
    there with the manifest's sha256: a file whose record this sync wrote (``token``) for this
    very inode, unchanged since (ctime), is taken as verified; any other (left by an earlier sync,
    or planted: the folder is untrusted) is hashed now, and one that differs is removed (the rerun
    sends it). Nothing is renamed once ``abandoned()`` (the orchestrator gave up waiting). The
    records stay until after the rename, so a crash at any point here leaves either a staging
    folder whose files a rerun skips, or the finished checkpoint (with records that the next
    ``LOCK`` tidies away)."""
    files = [{k: v for k, v in e.items() if k not in ("ino", "ctime_ns")}  # the source host's, not ours
             for e in manifest_data["files"]]
    excluded = manifest_data.get("excluded") or []
    replace = manifest_data.get("replace")
    rfd = _rundir_fd(p)
    try:
        fst = _lstat_at(rfd, p["ckpt"])
        if fst is not None and not replace:
            raise ToolError(f"{p['final']} appeared meanwhile; not replacing it")
        if fst is not None and not stat.S_ISDIR(fst.st_mode):
            raise _odd(p["final"], fst, "checkpoint folder")
        if fst is not None and copy_digest(list(_load_cache(p["final"]).values())) != replace:
            raise ToolError(f"{p['final']} is not the copy this sync was to replace (it changed meanwhile); "
                            f"not replacing it")
        sfd = _staging(p)
        try:
            _verify_staged(p, sfd, files, token)
            _sweep(sfd, {e["path"] for e in files})
            _write_at(sfd, MANIFEST, json.dumps({"files": files, **({"excluded": excluded} if excluded else {})},
                                                indent=1, sort_keys=True).encode())
            _write_at(sfd, SYNCED, json.dumps({"ino": os.fstat(sfd).st_ino, "digest": copy_digest(files)}).encode())
            for _, _, _, dfd in os.fwalk(".", dir_fd=sfd):
                os.fsync(dfd)
        finally:
            os.close(sfd)
        if abandoned():
            raise ToolError("the sync was given up before its final rename; not finalizing")
        if fst is not None:  # the copy replaced goes aside, removed below (or by the next LOCK after a crash)
            _remove_at(rfd, os.path.basename(p["old"]))
            os.rename(p["ckpt"], os.path.basename(p["old"]), src_dir_fd=rfd, dst_dir_fd=rfd)
        os.rename(os.path.basename(p["staging"]), p["ckpt"], src_dir_fd=rfd, dst_dir_fd=rfd)
        os.fsync(rfd)  # the checkpoint appears under its name only now, complete
    finally:
        os.close(rfd)
    _tidy_final(p)
    return json.dumps({"final": p["final"], "digest": copy_digest(files)})


def _verify_staged(p: dict, sfd: int, files: list, token: str) -> None:
    try:
        vfd = os.open(VERIFIED, NOFOLLOW_DIR, dir_fd=sfd)
    except OSError:
        vfd = None
    missing, bad = [], []
    try:
        for e in files:
            rel = safe_rel(e["path"])
            rec = _read_json_at(vfd, record_name(rel)) if vfd is not None else None
            try:
                dfd, base = _open_parent(sfd, rel, p["staging"])
            except (FileNotFoundError, Odd):
                missing.append(rel)
                continue
            try:
                fd = os.open(base, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
            except OSError:
                fd = None
            finally:
                os.close(dfd)
            if fd is None or not stat.S_ISREG(os.fstat(fd).st_mode):
                missing.append(rel)
            else:
                st = os.fstat(fd)
                ours = isinstance(rec, dict) and rec.get("token") == token and rec.get("ino") == st.st_ino and \
                    rec.get("ctime_ns") == st.st_ctime_ns and rec.get("sha256") == e["sha256"]
                if st.st_size != e["size"] or (not ours and sha256_fd(fd).hexdigest() != e["sha256"]):
                    bad.append(rel)
            if fd is not None:
                os.close(fd)
    finally:
        if vfd is not None:
            os.close(vfd)
    for rel in missing + bad:
        _discard(sfd, rel, p["staging"])
    if bad:
        raise ToolError(f"{_few(bad)} in the staging folder {'is' if len(bad) == 1 else 'are'} not the training "
                        f"host's file (its sha256 differs): removed; run the same command again to send "
                        f"{'it' if len(bad) == 1 else 'them'}")
    if missing:
        raise ToolError(f"{_few(missing)} {'was' if len(missing) == 1 else 'were'} not received and verified "
                        f"(discarded); run the same command again to send {'it' if len(missing) == 1 else 'them'}")


def _sweep(sfd: int, wanted: set) -> None:
    """Remove what the staging folder holds besides the manifest's files and the sync's own
    bookkeeping (.part files of files no longer in the checkpoint, links): nothing is followed."""
    for dirpath, dirnames, filenames, dfd in os.fwalk(".", dir_fd=sfd):
        top = dirpath == "."
        if top:
            dirnames[:] = [d for d in dirnames if d != VERIFIED]
        for n in list(dirnames):
            st = _lstat_at(dfd, n)
            if st is not None and not stat.S_ISDIR(st.st_mode):  # a link to a folder
                os.unlink(n, dir_fd=dfd)
                dirnames.remove(n)
        for n in filenames:
            rel = os.path.normpath(os.path.join(dirpath, n))
            if rel not in wanted and not (top and n == OWNER):
                os.unlink(n, dir_fd=dfd)
    folders = {os.path.dirname(w) for w in wanted}
    folders |= {f.rsplit("/", i)[0] for f in list(folders) for i in range(1, f.count("/") + 1)}
    for dirpath, dirnames, _, dfd in os.fwalk(".", topdown=False, dir_fd=sfd):
        for n in dirnames:
            rel = os.path.normpath(os.path.join(dirpath, n))
            if rel not in folders and rel != VERIFIED:
                try:
                    os.rmdir(n, dir_fd=dfd)  # emptied above
                except OSError:
                    pass


def _tidy_final(p: dict) -> None:
    """Drop the staging bookkeeping that a finished checkpoint carried through the rename, and the
    copy it replaced."""
    try:
        rfd = os.open(p["rundir"], os.O_RDONLY | os.O_DIRECTORY)
        try:
            _remove_at(rfd, os.path.basename(p["old"]))
        finally:
            os.close(rfd)
    except OSError:
        pass
    st = _lstat_at(None, p["final"])
    if st is None or not stat.S_ISDIR(st.st_mode):
        return
    try:
        ffd = os.open(p["final"], NOFOLLOW_DIR)
    except OSError:
        return
    try:
        st = _lstat_at(ffd, VERIFIED)
        if st is not None and stat.S_ISDIR(st.st_mode):
            _remove_at(ffd, VERIFIED)
        if _lstat_at(ffd, OWNER) is not None:
            os.unlink(OWNER, dir_fd=ffd)
    except OSError:
        pass
    finally:
        os.close(ffd)


def _remove_at(dfd: int, name: str) -> None:
    """Remove ``name`` in the folder ``dfd`` and everything below it; a link is removed, never followed."""
    st = _lstat_at(dfd, name)
    if st is None:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dfd)
        return
    fd = os.open(name, NOFOLLOW_DIR, dir_fd=dfd)
    try:
        for _, dirnames, filenames, sub in os.fwalk(".", topdown=False, dir_fd=fd):
            for n in filenames:
                os.unlink(n, dir_fd=sub)
            for n in dirnames:
                st = _lstat_at(sub, n)
                os.rmdir(n, dir_fd=sub) if stat.S_ISDIR(st.st_mode) else os.unlink(n, dir_fd=sub)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dfd)


# --------------------------- serve: GRANT, REVOKE (the one-time key on the training host, --tunnel)

KEY_TAG = "dflash-ops-sync-"  # the comment of every one-time key line this tool writes
KEY_TTL = 300.0  # backstop: sshd refuses the key after this long even if nothing removed the line


MADE = "# made by dflash-ops sync-ckpt, removed with its last one-time key: "  # then the folders made for it (JSON)


class Grant:
    """A one-time key in the training host's ``authorized_keys`` that the eval host's OpenSSH
    client logs in with through the tunnel: ``restrict`` (no forwarding, no pty), ``from`` this
    machine's address as the control connection came in, an ``expiry-time`` minutes away, and a
    forced ``command`` (the orchestrator's: ``send-from`` of one checkpoint folder, the tool's code
    pinned by its hash). The file is edited under a flock of its folder and replaced atomically,
    keeping its mode; the line goes first, so the user's lines stay byte for byte (a last line
    without a newline too, whatever other grants come and go); ``remove`` takes it out again (and
    expired lines of earlier syncs). A file that a grant created starts with a :data:`MADE` line
    naming the folders made for it, which every grant keeps while any holds a line: the grant that
    removes the last line removes the file and those folders, whichever grant made them."""

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
        self.added = False

    def held(self) -> dict:
        """What :meth:`revoke_held` needs to take the line out again (the session's guardian)."""
        return {"path": self.path, "comment": self.comment}

    @classmethod
    def revoke_held(cls, held: dict) -> None:
        g = cls.__new__(cls)
        g.path, g.comment, g.added = held["path"], held["comment"], True
        g.remove()

    def _folders(self) -> list:
        """The file's missing folders made (0700); those this call made, deepest first."""
        missing, up = [], os.path.dirname(self.path)
        while not os.path.isdir(up):
            missing.append(up)
            up = os.path.dirname(up)
        made = []
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o700)
                made.insert(0, d)
            except FileExistsError:
                pass
        return made

    def _edit(self, change, make: bool = False) -> None:
        """``change(text or None, folders made now) -> (new text or None, folders to remove)``,
        under a flock of the file's folder (checked to be still the folder of that name once
        locked: the grant that removed the last line may have removed it meanwhile)."""
        d = os.path.dirname(self.path)
        made: list = []
        for _ in range(10):
            made += [x for x in (self._folders() if make else []) if x not in made]
            try:
                dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:
                if make:
                    continue
                return
            try:
                fcntl.flock(dfd, fcntl.LOCK_EX)
                try:
                    now = os.stat(d)
                except FileNotFoundError:
                    now = None
                held = os.fstat(dfd)
                if now is None or (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
                    continue
                try:
                    st = os.stat(self.path)
                    with open(self.path, "rb") as f:
                        text = f.read().decode("utf-8", "surrogateescape")
                except FileNotFoundError:
                    st, text = None, None
                if st is not None and st.st_uid != os.getuid():
                    raise ToolError(f"{self.path} belongs to another user; not editing it")
                new, gone = change(text, sorted(made, key=lambda x: -x.count("/")))
                if new != text:
                    self._write(d, dfd, st, new)
                for x in gone:  # deepest first, the file's own folder (held and locked here) too
                    try:
                        os.rmdir(x)
                    except OSError:
                        break
                return
            finally:
                os.close(dfd)
        raise ToolError(f"{d} keeps disappearing; not editing {self.path}")

    def _write(self, d: str, dfd: int, st, new: str | None) -> None:
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

    def add(self) -> dict:
        def change(text, made):
            dirs, rest = _made(text)
            rest = [ln for ln in rest if not _expired(ln, time.time())]
            if text is None:
                dirs = made
            elif dirs is not None:
                dirs = sorted(set(dirs) | set(made), key=lambda x: -x.count("/"))
            head = MADE + json.dumps(dirs) + "\n" if dirs is not None else ""
            # first: the user's lines stay byte for byte (a last line without a newline too)
            return head + self.line + "\n" + "".join(rest), []
        self._edit(change, make=True)
        self.added = True
        import pwd
        return {"user": pwd.getpwuid(os.getuid()).pw_name, "from": self.source}

    def remove(self) -> None:
        if not self.added:
            return

        def change(text, made):
            if text is None:
                return None, []
            now = time.time()
            dirs, rest = _made(text)
            kept = [ln for ln in rest if ln.split()[-1:] != [self.comment] and not _expired(ln, now)]
            if dirs is None:
                return "".join(kept), []
            if not kept:  # a grant made the file and nothing but grants ever held a line: gone with them
                return None, dirs
            grants = any(ln.split()[-1:] and ln.split()[-1].startswith(KEY_TAG) for ln in kept)
            return (MADE + json.dumps(dirs) + "\n" if grants else "") + "".join(kept), []
        self._edit(change)
        self.added = False


def _made(text: str | None) -> tuple:
    """An authorized_keys text as (the folders its :data:`MADE` line names, or None without one;
    its other lines)."""
    lines = text.splitlines(True) if text is not None else []
    if not lines or not lines[0].startswith(MADE):
        return None, lines
    try:
        dirs = json.loads(lines[0][len(MADE):])
    except ValueError:
        dirs = []
    return [x for x in dirs if isinstance(x, str)] if isinstance(dirs, list) else [], lines[1:]


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

    def __init__(self, token: str, report=lambda held: None):
        import tempfile

        self.ssh, keygen = shutil.which("ssh"), shutil.which("ssh-keygen")
        if not self.ssh or not keygen:
            raise ToolError("NOSSH this host has no OpenSSH client (ssh, ssh-keygen) on its PATH")
        tmp = tempfile.gettempdir()
        _sweep_tunnels(tmp)
        self.dir = tempfile.mkdtemp(prefix=TUNNEL_PREFIX, dir=tmp)
        self.master = None
        self.report = report  # what close_held needs, each time it changes (the session's guardian)
        report({"dir": self.dir, "master": None})
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
        self.report({"dir": self.dir, "master": self.master.pid})
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

    @staticmethod
    def close_held(held: dict) -> None:
        """What :meth:`close` does, for a session that died: its master connection (its own process
        group, and still ours: its command line names our folder) ended, the folder removed."""
        import signal

        pid = held.get("master")
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                ours = os.fsencode(held["dir"]) in f.read()
        except (OSError, TypeError):
            ours = False
        if ours:
            try:
                os.killpg(pid, signal.SIGTERM)
            except OSError:
                pass
        shutil.rmtree(held["dir"], ignore_errors=True)


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
            "send-from": cmd_send_from, "send-batch": cmd_send_batch, "recv": cmd_recv,
            "recv-batch": cmd_recv_batch, "serve": cmd_serve}


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
