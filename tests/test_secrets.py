"""Credentials in an SGLang URL (`http://user:pass@host`) stay where the user put them, the
inventory: they reach the probe and the worker by stdin and environment, and are
in no file the run writes (run.json, cmd.json, env.json, events, logs), no process's argv (`ps`) and
no output of `hosts` / `hosts check` / `eval`."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(400)
REPO = Path(__file__).resolve().parents[1]


class ArgvWatch:
    """Scans every process's argv (what `ps` shows) for a string while it runs."""

    def __init__(self, needle: str):
        self.needle, self.seen, self.stop = needle.encode(), [], threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop.is_set():
            for pid in os.listdir("/proc"):
                if pid.isdigit():
                    try:
                        with open(f"/proc/{pid}/cmdline", "rb") as f:
                            argv = f.read()
                    except OSError:
                        continue
                    if self.needle in argv:
                        self.seen.append(argv.replace(b"\0", b" ").decode(errors="replace")[:300])
            self.stop.wait(0.05)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(5)


def files_holding(root: Path, needle: str) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


@pytest.mark.worker
def test_sglang_credentials_never_leave_the_inventory(ssh_lab, embedded_pair, tmp_path):
    from remote.target.model import load_target
    from sglang_server import serve_sglang
    from transformers import AutoTokenizer

    secret = f"s3cret-{uuid.uuid4().hex[:10]}"
    bind = ssh_lab.eval.address.rsplit(".", 1)[0] + ".1" if ssh_lab.isolated else "127.0.0.1"  # seen from eval
    workdir = ssh_lab.eval.root / "workdir"
    shutil.copytree(Path(embedded_pair["target"]).parent, workdir / "embedded", dirs_exist_ok=True)
    target = load_target(embedded_pair["target"], "cpu")
    hits: list = []
    with serve_sglang(target, AutoTokenizer.from_pretrained(embedded_pair["target"]), host=bind,
                      auth=f"alice:{secret}", hits=hits) as url:
        inv = ssh_lab.write_inventory(tmp_path / "inventory.yaml",
                                      eval={"sglang": url.replace("http://", f"http://alice:{secret}@") + "/"})
        env = {**os.environ, "DFLASH_OPS_RUNS": str(tmp_path / "runs"), "COLUMNS": "200"}

        def cli(*args, code=0):
            res = subprocess.run([sys.executable, "-m", "orchestrator.cli", "--inventory", str(inv), *args],
                                 cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
            assert res.returncode == code, res.stdout + res.stderr
            assert secret not in res.stdout + res.stderr, res.stdout + res.stderr
            return res.stdout + res.stderr

        with ArgvWatch(secret) as watch:
            assert url in cli("hosts")
            listed = json.loads(cli("hosts", "--json"))
            assert [h["sglang"] for h in listed["hosts"] if h["name"] == "eval"] == [url]
            assert "healthy" in cli("hosts", "check", "eval")          # the probe authenticated
            cli("eval", "--host", "eval", "--drafter", "embedded", "--device", "cpu", "--prompts", "2",
                "--max-new-tokens", "16", "--ddtree", "")
        assert not watch.seen, watch.seen
    (run_dir,) = [d for d in (tmp_path / "runs").iterdir() if (d / "run.json").exists()]
    rows = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]
    assert [r["reference"] for r in rows] == ["sglang", "sglang"]
    assert ("POST", "/generate", True) in hits and not [h for h in hits if not h[2]]   # every request authorized
    assert json.loads((run_dir / "env.json").read_text())["settings"]["sglang_url"] == url
    remote_run = workdir / "runs" / run_dir.name
    assert (remote_run / "cmd.json").exists()
    assert not files_holding(run_dir, secret) and not files_holding(remote_run, secret)


def test_credentials_on_the_command_line_are_refused(tmp_path):
    from typer.testing import CliRunner

    from orchestrator.cli import app

    res = CliRunner().invoke(app, ["eval", "--host", "local", "--sglang", "http://bob:hunter2@gpu:30000",
                                   "--runs-dir", str(tmp_path)])
    assert res.exit_code == 2 and "hunter2" not in res.output and "Traceback" not in res.output, res.output
    assert "--sglang: the URL holds credentials" in res.stderr and "DFLASH_OPS_SGLANG_AUTH" in res.stderr
    assert not any(tmp_path.iterdir())
