"""`dflash-ops clean` on a host, and the leases that keep what a run may load from it; stdlib
only, run as one file (``python -c SOURCE COMMAND ...``; it imports nothing of remote).

``scan WORKDIR``: what the workdir holds that clean judges: the worker code folders
(``code/<digest>``) and the run folders (``runs/<id>``, each with its job folders: the folder itself
or its ``shard-*``), each entry's size and newest mtime (links never followed), whether a job runs
in it now, and the code folder and drafter each job was started with (its ``cmd.json``).

``judge WORKDIR ROOT ITEMS``: who uses each checkpoint folder ``ROOT/rel`` of ITEMS (a JSON list of
``{"rel", "ino", "lock", "keep": [[path, who], ...]}``): a path the control plane names (a catalog
drafter, a watch, a run it knows) that is the folder, inside it or holds it once every link is
resolved here; a live lease; a running job's drafter; a sync holding the checkpoint's lock; and
whether it is still the folder listed (its inode). One JSON line: ``[{"rel", "users"}, ...]``.

``delete WORKDIR``: remove what the control plane chose, one item per line on stdin (JSON ``[kind,
root, rel, extra]``: kind ``run``, ``code`` or ``ckpt``; ``rel`` a relative path under ``root``, the
workdir or the checkpoints root; ``extra`` a ``judge`` item for ``ckpt``), one JSON result line on
stdout per item, as it goes; it stops at the end of its input (the control plane stopped sending:
an interrupt there ends the removal after the item at hand) and ignores SIGINT (a Ctrl-C meant for
the control plane reaches it too on this machine). Every folder below ``root`` is opened without
following a link; the last entry, when it is a link or a file, is unlinked (never followed); a
folder is removed from inside through descriptors, so a link in it is removed as a link. Checked
again at the moment of removal, under the lease lock: no job runs in a run folder (its start lock
held meanwhile), no running job or live lease uses a code folder, and a checkpoint folder is the
one judged, with no user now (the sync's checkpoint lock held meanwhile).

``lease WORKDIR RUN JSON`` / ``release WORKDIR RUN``: a run's lease on this host,
``<workdir>/leases/<run>.json`` (``{"paths": [...], "code": DIGEST, "origin": ..., "created": T}``),
written by eval before its pre-flight under the lease lock (``<workdir>/leases/.lock``, the lock
each removal takes) and released when the run ends or is cancelled. A lease is live while its run
has a job here that has not ended (no exit code: running, starting, or a Slurm task waiting in the
queue) or, before the run has a folder here, for :data:`PREFLIGHT_GRACE` after it was written (its
pre-flight, the submission); a live lease keeps every folder its paths name (links resolved) and
its worker code.
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
JOB_FILE = "slurm.json"         # remote/host/slurm.py: a Slurm task's folder (its job lives on a compute node)
LEASES = "leases"               # <workdir>/leases/<run id>.json
LEASE_LOCK = ".lock"            # <workdir>/leases/.lock
LEASE_WAIT = 120.0              # s a lease's writer or a removal waits for the lease lock
PREFLIGHT_GRACE = 3 * 3600.0    # s a lease whose run has no folder here yet stays live
MAX_LEASE = 1 << 16


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


def kind_of_path(path):
    try:
        return kind_of(None, path)
    except OSError:
        return None


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
    if has(dfd, "exit_code"):
        return False
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


def ended(dfd):
    """Has the job of job folder ``dfd`` ended: its exit code is there, or (not a Slurm task, whose
    job lives on a compute node and may still wait in the queue) nothing runs or starts in it?"""
    if has(dfd, "exit_code"):
        return True
    return not has(dfd, JOB_FILE) and not running(dfd)


def has(dfd, name):
    """Is there an entry ``name`` (a link counts, never followed) in folder ``dfd``?"""
    try:
        os.stat(name, dir_fd=dfd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def run_jobs(workdir, rid):
    """fds of run ``rid``'s job folders here (its ``shard-*`` folders, else the folder itself), or
    None when it has no folder here; close them."""
    try:
        rfd = os.open(os.path.join(workdir, "runs", rid), NOFOLLOW_DIR)
    except OSError:
        return None
    try:
        found = job_folders(rfd)
    finally:
        os.close(rfd)
    if len(found) > 1:
        os.close(found.pop(0)[1])
    return [fd for _, fd in found]


def lease_state(workdir, rid, lease, now):
    """Why the lease of run ``rid`` is live, or None when it is not (its run ended here, or it
    never got a folder here and is older than :data:`PREFLIGHT_GRACE`)."""
    fds = run_jobs(workdir, rid)
    if fds is None:
        age = now - float(lease.get("created") or 0)
        return "in its pre-flight or being submitted" if age < PREFLIGHT_GRACE else None
    try:
        return "running or queued" if not all(ended(fd) for fd in fds) else None
    finally:
        for fd in fds:
            os.close(fd)


def leases(workdir, now=None):
    """The live leases here: ``[{"run", "why", "paths", "code", "origin"}, ...]`` (links never
    followed; an unreadable lease is live, naming what it is)."""
    now = time.time() if now is None else now
    if not workdir:
        return []
    try:
        fd = os.open(os.path.join(workdir, LEASES), NOFOLLOW_DIR)
    except OSError:
        return []
    out = []
    try:
        for entry in os.scandir(fd):
            if not entry.name.endswith(".json") or entry.name.startswith("."):
                continue
            rid = entry.name[:-len(".json")]
            lease = read_json_at(fd, entry.name)
            if not isinstance(lease, dict):
                out.append({"run": rid, "why": "an unreadable lease", "paths": None, "code": None, "origin": None})
                continue
            why = lease_state(workdir, rid, lease, now)
            if why:
                out.append({"run": rid, "why": why, "paths": [str(p) for p in lease.get("paths") or []],
                            "code": lease.get("code"), "origin": lease.get("origin")})
    finally:
        os.close(fd)
    return out


def read_json_at(dfd, name):
    """A small JSON file in folder ``dfd``, never read through a link (None where it is not one)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            return json.loads(f.read(MAX_LEASE))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def lease_lock(workdir, wait=LEASE_WAIT):
    """The lease lock held (an fd to close), made with its folder where missing; OSError after ``wait`` s."""
    path = os.path.join(workdir, LEASES)
    os.makedirs(path, exist_ok=True)
    dfd = os.open(path, NOFOLLOW_DIR)
    try:
        fd = os.open(LEASE_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644, dir_fd=dfd)
    finally:
        os.close(dfd)
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise OSError(errno.EAGAIN, "the lease lock %s/%s is held by another process" % (path, LEASE_LOCK))
            time.sleep(0.1)


def take_lease(workdir, rid, data):
    if not rid or "/" in rid or rid.startswith(".") or "\0" in rid:
        raise ValueError("not a run id: %r" % rid)
    lease = dict(json.loads(data), created=time.time())
    lock = lease_lock(workdir)
    try:
        dfd = os.open(os.path.join(workdir, LEASES), NOFOLLOW_DIR)
        try:
            tmp = "%s.json.tmp%d" % (rid, os.getpid())
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644, dir_fd=dfd)
            with os.fdopen(fd, "w") as f:
                json.dump(lease, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, rid + ".json", src_dir_fd=dfd, dst_dir_fd=dfd)
        finally:
            os.close(dfd)
    finally:
        os.close(lock)
    return {"lease": "%s/%s/%s.json" % (workdir, LEASES, rid)}


def release_lease(workdir, rid):
    try:
        dfd = os.open(os.path.join(workdir, LEASES), NOFOLLOW_DIR)
    except OSError:
        return {"released": False}
    try:
        os.unlink(rid + ".json", dir_fd=dfd)
        return {"released": True}
    except OSError:
        return {"released": False}
    finally:
        os.close(dfd)


def real(path):
    """(real path, identity) of ``path`` with every link resolved here (identity None where it is gone)."""
    r = os.path.realpath(path)
    try:
        st = os.stat(r)
        return r, (st.st_dev, st.st_ino)
    except OSError:
        return r, None


def related(a, b):
    """Is one of the resolved folders ``a`` and ``b`` (:func:`real`) the other or inside it?"""
    (ra, ia), (rb, ib) = a, b
    return (ia is not None and ia == ib) or ra == rb or ra.startswith(rb.rstrip("/") + "/") or \
        rb.startswith(ra.rstrip("/") + "/")


def running_jobs(workdir):
    """[(run id, resolved cwd, resolved drafter)] of the jobs running now."""
    out = []
    for rid, _, fd in jobs(workdir):
        try:
            if running(fd):
                cwd, drafter = command(fd)
                out.append((rid, real(cwd) if cwd else None, real(drafter) if drafter else None))
        finally:
            os.close(fd)
    return out


def users(workdir, root, item, now=None, live_leases=None, jobs_now=None):
    """Who uses checkpoint folder ``root/item["rel"]`` now (see ``judge``); a list of reasons."""
    folder = real(os.path.join(root, item["rel"]))
    found = []
    for path, who in item.get("keep") or []:
        if related(real(path), folder):
            found.append(who)
    for lease in leases(workdir, now) if live_leases is None else live_leases:
        origin = " (from %s)" % lease["origin"] if lease.get("origin") else ""
        if lease["paths"] is None:
            found.append("run %s: %s" % (lease["run"], lease["why"]))
        elif any(related(real(p), folder) for p in lease["paths"]):
            found.append("run %s%s, %s" % (lease["run"], origin, lease["why"]))
    for rid, _, drafter in running_jobs(workdir) if jobs_now is None else jobs_now:
        if drafter is not None and related(drafter, folder):
            found.append("a job running on the host (run %s)" % rid)
    if item.get("lock"):
        parent = os.path.dirname(os.path.join(root, item["rel"]))
        if _held_at(parent, item["lock"]):
            found.append("a sync of it, now")
    return found


def _held_at(folder, name):
    try:
        dfd = os.open(folder, NOFOLLOW_DIR)
    except OSError:
        return False
    try:
        return _held(dfd, name)
    finally:
        os.close(dfd)


def judge(workdir, root, items):
    now = time.time()
    live_leases, jobs_now = leases(workdir, now), running_jobs(workdir)
    out = []
    for item in items:
        try:
            st = os.lstat(os.path.join(root, item["rel"]))
            same = stat.S_ISDIR(st.st_mode) and st.st_ino == item.get("ino")
        except OSError:
            same = False
        out.append({"rel": item["rel"], "same": same,
                    "users": users(workdir, root, item, now, live_leases, jobs_now)})
    return out


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
    for c in code:      # a ship's: it marks what it installed complete
        c["shipped"] = c["kind"] == "dir" and kind_of_path(os.path.join(workdir, "code", c["name"], ".complete")) == "file"
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


def delete_one(workdir, kind, root, rel, extra=None):
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
        elif is_dir and kind == "code":
            folder = real(os.path.join(root, rel))
            if any(cwd is not None and related(cwd, folder) for _, cwd, _ in running_jobs(workdir)):
                return {"rel": rel, "ok": False, "why": "a running job was started from it"}
            lease = next((le for le in leases(workdir) if le["code"] == name or le["paths"] is None), None)
            if lease:
                return {"rel": rel, "ok": False, "why": "run %s uses it (%s)" % (lease["run"], lease["why"])}
        elif kind == "ckpt":
            item = dict(extra or {}, rel=rel)
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode) or st.st_ino != item.get("ino"):
                return {"rel": rel, "ok": False, "why": "not the folder judged any more (replaced since)"}
            if item.get("lock"):           # no sync of it meanwhile: its checkpoint lock held until it is gone
                lk = os.open(item["lock"], os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644, dir_fd=dfd)
                locks.append(lk)
                try:
                    fcntl.flock(lk, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return {"rel": rel, "ok": False, "why": "a sync of it runs now"}
                item = dict(item, lock=None)
            now_users = users(workdir, root, item)
            if now_users:
                return {"rel": rel, "ok": False, "why": "in use now: " + "; ".join(now_users)}
        remove_at(dfd, name)
        return {"rel": rel, "ok": True}
    except OSError as e:
        return {"rel": rel, "ok": False, "why": "%s: %s" % (e.filename or rel, e.strerror)}
    finally:
        for fd in locks:
            os.close(fd)
        os.close(dfd)


def delete(workdir, lines, write):
    """``delete``: each item of ``lines`` removed under the lease lock (taken per item, so that an
    eval's lease waits at most one removal), its result written at once."""
    for line in lines:
        if not line.strip():
            continue
        kind, root, rel, *extra = json.loads(line)
        try:
            lock = lease_lock(workdir) if workdir else None
        except OSError as e:
            write({"rel": rel, "ok": False, "why": str(e)})
            continue
        try:
            result = delete_one(workdir, kind, root, rel, extra[0] if extra else None)
        finally:
            if lock is not None:
                os.close(lock)
        write(result)


def main(argv):
    if len(argv) >= 2 and argv[0] == "scan":
        print(json.dumps(dict(scan(argv[1]), leases=leases(argv[1]))))
    elif len(argv) == 4 and argv[0] == "judge":
        print(json.dumps(judge(argv[1], argv[2], json.loads(argv[3]))))
    elif len(argv) == 2 and argv[0] == "delete":
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)

        def write(result):
            sys.stdout.write(json.dumps(result) + "\n")
            sys.stdout.flush()
        try:
            delete(argv[1], iter(sys.stdin.readline, ""), write)
        except BrokenPipeError:
            pass
    elif len(argv) == 4 and argv[0] == "lease":
        print(json.dumps(take_lease(argv[1], argv[2], argv[3])))
    elif len(argv) == 3 and argv[0] == "release":
        print(json.dumps(release_lease(argv[1], argv[2])))
    else:
        sys.exit("usage: clean.py scan WORKDIR | judge WORKDIR ROOT ITEMS | delete WORKDIR (items on stdin) | "
                 "lease WORKDIR RUN JSON | release WORKDIR RUN")


if __name__ == "__main__":
    main(sys.argv[1:])
