"""A host's `python` for fault-injection tests: ``faultpy.py SPEC -c CODE ARGS...`` runs
``python -c CODE ARGS...`` (how the orchestrator starts sync_host on a host) with pause points
planted in it, so a test can put a real fault (SIGKILL, a cut link, a full disk) at an exact point
of a real sync. The inventory names a two-line shell script that execs this; nothing in the product
knows about it.

SPEC (JSON): ``{"dir": D, "pause": {"at": "send", "file": NAME, "bytes": N}}`` pauses the sender of
NAME once N bytes are out (the sender sends 256 KiB per call, so N is exact; ``--tunnel``'s forced
sender too), or
``{"dir": D, "pause": {"at": "rename", "ckpt": NAME}}`` pauses the lock holder (the eval host's
``serve`` session) just before it renames the staging folder to NAME. At the pause the process writes ``D/paused`` ("WHAT PID") and waits for
``D/release`` (60 s at most), then goes on.

``{"dir": D, "throttle": {"at": "send", "file": NAME, "seconds": S}}`` makes the sender of NAME wait
S seconds before each 256 KiB: a slow link that never goes silent (no stall rule fires), for a
test that must act while the transfer is moving.

``{"impostor": {"file": NAME, "with": PATH}}`` makes the sender of NAME send PATH instead (same size
and mtime, other bytes, a trailer that matches them): what a host answering the data path in the
training host's place would do.
"""
import json
import os
import sys
import time

STEP = 256 << 10


def pause(spec: dict, what: str) -> None:
    marker = os.path.join(spec["dir"], "paused")
    with open(marker + ".tmp", "w") as f:
        f.write(f"{what} {os.getpid()}\n")
    os.replace(marker + ".tmp", marker)
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(spec["dir"], "release")) and time.monotonic() < deadline:
        time.sleep(0.02)


def plant(spec: dict, args: list) -> None:
    """Plant the spec's pause or impostor in the tool run with ``args`` (the blob, then its arguments;
    changed in place)."""
    first = 3 if args[1:2] == ["--idle"] else 1
    tool_args = args[first:]
    forced = "SSH_ORIGINAL_COMMAND" in os.environ and len(args) == 2  # --tunnel's forced sender: HASH DIR
    if forced:
        import shlex
        tool_args = shlex.split(os.environ["SSH_ORIGINAL_COMMAND"])[1:]  # what the eval host asked for
    imp = spec.get("impostor")
    if imp and not forced and tool_args[:1] == ["send"] and os.path.basename(tool_args[1]) == imp["file"]:
        args[first + 1] = imp["with"]
    slow = spec.get("throttle") or {}
    if slow.get("at") == "send" and tool_args[:1] == ["send"] and os.path.basename(tool_args[1]) == slow["file"]:
        real_send = os.sendfile

        def throttled(out_fd, in_fd, offset, count):
            time.sleep(slow["seconds"])
            return real_send(out_fd, in_fd, offset, min(count, STEP))
        os.sendfile = throttled
    p = spec.get("pause") or {}
    if p.get("at") == "send" and tool_args[:1] == ["send"] and os.path.basename(tool_args[1]) == p["file"]:
        real, sent, done = os.sendfile, [int(tool_args[4])], []

        def sendfile(out_fd, in_fd, offset, count):
            if sent[0] >= p["bytes"] and not done:
                done.append(1)
                pause(spec, "send")
            n = real(out_fd, in_fd, offset, min(count, STEP))
            sent[0] += n
            return n
        os.sendfile = sendfile
    elif p.get("at") == "rename" and tool_args[:1] == ["serve"]:
        real_rename = os.rename

        def rename(src, dst, *a, **kw):
            if os.path.basename(str(src)).startswith(".staging-") and os.path.basename(str(dst)) == p["ckpt"]:
                pause(spec, "rename")
            return real_rename(src, dst, *a, **kw)
        os.rename = rename


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    argv = sys.argv[2:]
    if argv[:1] == ["-S"]:  # the tool runs as `python -S -c` (no site-packages)
        argv = argv[1:]
    if argv[0] != "-c":
        raise SystemExit("faultpy: expected SPEC [-S] -c CODE ARGS")
    code, args = argv[1], argv[2:]
    plant(spec, args)                # args[0] is the tool itself (sync_host's bootstrap pops it)
    sys.argv = ["-c", *args]
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})


if __name__ == "__main__":
    main()
