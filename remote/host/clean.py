"""`dflash-ops clean` on a host, stdlib only, run as one file (``python -c SOURCE scan|delete ...``;
it imports nothing of remote).

``scan WORKDIR``: what the workdir holds that clean judges: the worker code folders
(``code/<digest>``) and the run folders (``runs/<id>``, each with its job folders: the folder itself
or its ``shard-*``), each entry's size and newest mtime (links never followed), whether a job runs
in it now, and the code folder and drafter each job was started with (its ``cmd.json``).

``delete WORKDIR ITEMS``: remove what the control plane chose, ITEMS a JSON list of ``[kind, root,
rel]`` (kind ``run``, ``code`` or ``ckpt``; ``rel`` a relative path under ``root``, the workdir or
the checkpoints root). Every folder below ``root`` is opened without following a link; the last
entry, when it is a link or a file, is unlinked (never followed); a folder is removed from inside
through descriptors, so a link in it is removed as a link. Checked again at the moment of removal:
no job runs in a run folder (its start lock held meanwhile), and no running job was started from a
code folder or loads a checkpoint folder. One JSON line: one result per item.
"""
import errno
import fcntl
import json
import os
import stat
import sys
import time

NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
START_LOCK = ".start.lock"      # remote/host/launch.py: held by a start until the job's pid is written
JOB_LOCK = ".job.lock"          # remote/host/launch.py: held by the job and its supervisor while either lives
MAX_CMD = 1 << 20


def walk(dfd, name):
    """(bytes, newest mtime) of entry ``name`` in folder ``dfd``: a folder's whole tree, a link's own size."""
    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    size, newest = st.st_size, st.st_mtime
    if not stat.S_ISDIR(st.st_mode):
        return size, newest
    fd = os.open(name, NOFOLLOW_DIR, dir_fd=dfd)
    try:
        for entry in os.scandir(fd):
            try:
                s, m = walk(fd, entry.name)
            except OSError:
                continue
            size, newest = size + s, max(newest, m)
    finally:
        os.close(fd)
    return size, newest


def kind_of(dfd, name):
    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    return "link" if stat.S_ISLNK(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode) else "file"


def _held(dfd, name):
    """Is the lock file ``name`` in ``dfd`` held by a process (False when there is none)?"""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _pid_alive(dfd):
    """A job whose pid file names a live process and that has no exit code yet (a job started by a
    launch without the job lock): counted as running, whoever that process is."""
    try:
        os.stat("exit_code", dir_fd=dfd, follow_symlinks=False)
        return False
    except FileNotFoundError:
        pass
    try:
        fd = os.open("pid", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
        with os.fdopen(fd) as f:
            pid = int(f.read(256).split()[0])
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, ValueError, IndexError):
        return False


def running(dfd):
    """Does a job run (or start) in job folder ``dfd``? Its start lock is taken first, so that
    looking at the job lock never races a start (which takes the job lock without waiting)."""
    try:
        lock = os.open(START_LOCK, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
    except OSError:
        return _pid_alive(dfd)        # never started by a launch that locks: no job lock either
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        return True
    try:
        return _held(dfd, JOB_LOCK) or _pid_alive(dfd)
    finally:
        os.close(lock)


def command(dfd):
    """(cwd, drafter folder) of the job's ``cmd.json`` (None where there is none or it is unreadable)."""
    try:
        fd = os.open("cmd.json", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
        with os.fdopen(fd, "rb") as f:
            cmd = json.loads(f.read(MAX_CMD))
        argv = [str(a) for a in cmd.get("argv") or []]
        drafter = argv[argv.index("--drafter") + 1] if "--drafter" in argv[:-1] else None
        return (str(cmd["cwd"]) if cmd.get("cwd") else None), drafter
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        return None, None


def identity(path):
    try:
        st = os.stat(path)
        return st.st_dev, st.st_ino
    except (OSError, ValueError):
        return None


def job_folders(rfd):
    """(name, fd) of the job folders of an open run folder: itself, then each ``shard-*`` folder."""
    out = [("", os.dup(rfd))]
    for entry in os.scandir(rfd):
        if entry.name.startswith("shard-"):
            try:
                out.append((entry.name, os.open(entry.name, NOFOLLOW_DIR, dir_fd=rfd)))
            except OSError:
                pass
    return out


def jobs(workdir):
    """Every job folder under ``workdir/runs``: (run id, shard folder, fd of it); close the fds."""
    if not workdir:
        return []
    try:
        rootfd = os.open(os.path.join(workdir, "runs"), NOFOLLOW_DIR)
    except OSError:
        return []
    found = []
    try:
        for entry in os.scandir(rootfd):
            try:
                rfd = os.open(entry.name, NOFOLLOW_DIR, dir_fd=rootfd)
            except OSError:
                continue
            try:
                found += [(entry.name, shard, fd) for shard, fd in job_folders(rfd)]
            finally:
                os.close(rfd)
    finally:
        os.close(rootfd)
    return found


def live(workdir):
    """(identities of the code folders, identities of the drafter folders) of the jobs running now."""
    code, drafters = set(), set()
    for _, _, fd in jobs(workdir):
        try:
            if running(fd):
                cwd, drafter = command(fd)
                code.add(identity(cwd) if cwd else None)
                drafters.add(identity(drafter) if drafter else None)
        finally:
            os.close(fd)
    return code - {None}, drafters - {None}


def entries(folder, problems):
    """(name, kind, size, newest mtime) of each entry of ``folder``; a link there is not followed
    (it is named in ``problems``)."""
    try:
        fd = os.open(folder, NOFOLLOW_DIR)
    except FileNotFoundError:
        return []
    except OSError as e:
        problems.append("%s: %s" % (folder, "a link or not a folder: not followed" if e.errno in (
            errno.ENOTDIR, errno.ELOOP) else e.strerror))
        return []
    out = []
    try:
        for entry in os.scandir(fd):
            try:
                size, newest = walk(fd, entry.name)
                out.append({"name": entry.name, "kind": kind_of(fd, entry.name), "size": size, "mtime": newest})
            except OSError:
                continue
    finally:
        os.close(fd)
    return out


def scan(workdir):
    problems = []
    code = entries(os.path.join(workdir, "code"), problems)
    by_identity = {identity(os.path.join(workdir, "code", c["name"])): c["name"] for c in code if c["kind"] == "dir"}
    runs = {r["name"]: dict(r, jobs=[]) for r in entries(os.path.join(workdir, "runs"), problems)}
    for rid, shard, fd in jobs(workdir):
        try:
            cwd, drafter = command(fd)
            if rid in runs:
                runs[rid]["jobs"].append({"folder": shard, "running": running(fd), "cwd": cwd,
                                          "code": by_identity.get(identity(cwd)) if cwd else None,
                                          "drafter": drafter})
        finally:
            os.close(fd)
    return {"code": code, "runs": list(runs.values()), "now": time.time(), "problems": problems}


def remove_at(dfd, name):
    """Remove entry ``name`` of folder ``dfd``: a link or a file unlinked, a folder emptied from
    inside (nothing followed) and removed."""
    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dfd)
        return
    fd = os.open(name, NOFOLLOW_DIR, dir_fd=dfd)
    try:
        for entry in list(os.scandir(fd)):
            remove_at(fd, entry.name)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dfd)


def parent_of(root, rel):
    """(fd of the folder holding the last part of ``rel`` under ``root``, that part): each folder
    below ``root`` opened without following a link."""
    parts = rel.split("/")
    if any(p in ("", ".", "..") or "\0" in p for p in parts):
        raise ValueError("not a plain relative path: %r" % rel)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for p in parts[:-1]:
            nxt = os.open(p, NOFOLLOW_DIR, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except OSError:
        os.close(fd)
        raise
    return fd, parts[-1]


def delete_one(workdir, kind, root, rel):
    try:
        dfd, name = parent_of(root, rel)
    except ValueError as e:
        return {"rel": rel, "ok": False, "why": str(e)}
    except OSError as e:
        why = "a link or not a folder on the way" if e.errno in (errno.ENOTDIR, errno.ELOOP) else e.strerror
        return {"rel": rel, "ok": False, "why": "%s: %s" % (rel, why)}
    locks = []
    try:
        try:
            is_dir = kind_of(dfd, name) == "dir"
        except FileNotFoundError:
            return {"rel": rel, "ok": True, "why": "already gone"}
        if is_dir and kind == "run":
            fd = os.open(name, NOFOLLOW_DIR, dir_fd=dfd)
            try:
                for _, jfd in job_folders(fd):
                    locks.append(jfd)
                    try:                  # no start meanwhile: its start lock held until the folder is gone
                        lk = os.open(START_LOCK, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=jfd)
                        locks.append(lk)
                        fcntl.flock(lk, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except FileNotFoundError:
                        pass
                    except BlockingIOError:
                        return {"rel": rel, "ok": False, "why": "a job is starting in it now"}
                    if _held(jfd, JOB_LOCK) or _pid_alive(jfd):
                        return {"rel": rel, "ok": False, "why": "a job runs in it now"}
            finally:
                os.close(fd)
        elif is_dir and kind in ("code", "ckpt"):
            fd = os.open(name, NOFOLLOW_DIR, dir_fd=dfd)
            try:
                st = os.fstat(fd)
            finally:
                os.close(fd)
            code, drafters = live(workdir)
            if (st.st_dev, st.st_ino) in (code if kind == "code" else drafters):
                return {"rel": rel, "ok": False, "why": "a running job " + ("was started from it" if kind == "code"
                                                                          else "loads it")}
        remove_at(dfd, name)
        return {"rel": rel, "ok": True}
    except OSError as e:
        return {"rel": rel, "ok": False, "why": "%s: %s" % (e.filename or rel, e.strerror)}
    finally:
        for fd in locks:
            os.close(fd)
        os.close(dfd)


def main(argv):
    if len(argv) >= 2 and argv[0] == "scan":
        print(json.dumps(scan(argv[1])))
    elif len(argv) == 3 and argv[0] == "delete":
        print(json.dumps([delete_one(argv[1], *item) for item in json.loads(argv[2])]))
    else:
        sys.exit("usage: clean.py scan WORKDIR | delete WORKDIR ITEMS")


if __name__ == "__main__":
    main(sys.argv[1:])
