"""Shipping the worker code (orchestrator/eval/ship.py) to a host's workdir, content-addressed:
evals that ship the same code at once all get one folder, never replaced under a running one."""
from __future__ import annotations

import os
import threading

from orchestrator.eval.ship import ship
from orchestrator.transport.local import LocalRunner


def test_evals_shipping_the_same_code_at_once_share_one_folder_never_replaced(tmp_path):
    """Six evals of one host ship at once: each gets the same code folder, none fails, and the
    folder the first of them got (and may already run from) is the one that stays: its inode
    and files do not change while the others finish. No temporary folder or tar is left."""
    workdir = tmp_path / "workdir"
    results, errors, seen = [], [], []
    barrier = threading.Barrier(6)

    def one() -> None:
        barrier.wait()
        try:
            code_dir = ship(LocalRunner(), __import__("sys").executable, str(workdir))
            st = os.stat(os.path.join(code_dir, "remote", "host", "launch.py"))
            seen.append((os.stat(code_dir).st_ino, st.st_ino))
            results.append(code_dir)
        except Exception as e:  # noqa: BLE001 — collected for the assertion
            errors.append(repr(e))
    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [], errors
    assert len(set(results)) == 1
    code_dir = results[0]
    final = (os.stat(code_dir).st_ino, os.stat(os.path.join(code_dir, "remote", "host", "launch.py")).st_ino)
    assert set(seen) == {final}, "a shipped code folder was replaced while in use"
    assert os.path.exists(os.path.join(code_dir, ".complete"))
    assert sorted(os.listdir(workdir / "code")) == [os.path.basename(code_dir)]


def test_a_shipped_folder_that_no_longer_matches_its_name_is_installed_again(tmp_path):
    """A complete folder whose files were changed after it was installed (a module edited, one
    added, a suite replaced by a link) is not trusted by its name: the next ship moves it aside and
    installs the worker again; an untouched one is reused as it is (same inode)."""
    import io
    import sys
    import tarfile

    from orchestrator.eval.ship import bundle

    shipped = tarfile.open(fileobj=io.BytesIO(bundle()[1])).extractfile("remote/host/launch.py").read()
    workdir = str(tmp_path / "workdir")
    code_dir = ship(LocalRunner(), sys.executable, workdir)
    launch = os.path.join(code_dir, "remote", "host", "launch.py")
    inode = os.stat(code_dir).st_ino
    assert ship(LocalRunner(), sys.executable, workdir) == code_dir and os.stat(code_dir).st_ino == inode
    tampered = {
        "edited": lambda: open(launch, "a").write("\nimport os; os.system('true')\n"),
        "added": lambda: open(os.path.join(code_dir, "remote", "sitecustomize.py"), "w").write("x = 1\n"),
        "linked": lambda: (os.remove(os.path.join(code_dir, "remote", "suites", "default.jsonl")),
                           os.symlink("/etc/hostname", os.path.join(code_dir, "remote", "suites", "default.jsonl"))),
    }
    for name, tamper in tampered.items():
        tamper()
        assert ship(LocalRunner(), sys.executable, workdir) == code_dir, name
        assert open(launch, "rb").read() == shipped, name
        assert not os.path.exists(os.path.join(code_dir, "remote", "sitecustomize.py")), name
        assert not os.path.islink(os.path.join(code_dir, "remote", "suites", "default.jsonl")), name
        assert sorted(os.listdir(os.path.join(workdir, "code"))) == [os.path.basename(code_dir)], name
