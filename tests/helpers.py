"""Small helpers the test files share (the fixtures are in tests/conftest.py). Test files import
helpers from here and the other helper modules by their plain names (``from helpers import
wait_for``), never from another test file (tests/test_architecture.py checks it)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def wait_for(predicate, timeout: float = 240, what: str = "condition", proc: subprocess.Popen | None = None,
             interval: float = 0.05):
    """``predicate()``'s first truthy value; AssertionError after ``timeout`` s, or as soon as ``proc``
    (if given) has ended, with its last output."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            tail = proc.stdout.read()[-3000:] if proc.stdout else ""
            raise AssertionError(f"exit {proc.returncode} before {what}: {tail}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


def invoke(*args, env: dict | None = None):
    """The CLI in this process (typer's CliRunner); a traceback in its output fails the test."""
    from typer.testing import CliRunner

    from orchestrator.cli import app

    res = CliRunner().invoke(app, [str(a) for a in args], env=env)
    assert "Traceback" not in res.output, res.output
    return res


def lab_cli(eval_lab: dict, *args, inventory=None, runs=None, popen=False, timeout=600):
    """`dflash-ops` as a subprocess with the ``eval_lab`` fixture's inventory and catalog."""
    env = {**os.environ, "DFLASH_OPS_CATALOG": str(eval_lab["catalog"]),
           "DFLASH_OPS_RUNS": str(runs or eval_lab["base"] / "runs"), "COLUMNS": "160"}
    argv = [sys.executable, "-m", "orchestrator.cli", "--inventory", str(inventory or eval_lab["inventory"]),
            *map(str, args)]
    if popen:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def results(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]


def only_run(runs: Path) -> Path:
    dirs = [d for d in runs.iterdir() if (d / "run.json").exists()]
    assert len(dirs) == 1, dirs
    return dirs[0]


def remote_run_dir(eval_lab: dict, host: str, run_id: str) -> Path:
    return eval_lab["lab"].hosts[host].root / "workdir" / "runs" / run_id


def prompt_events(path: Path) -> int:
    if not path.exists():
        return 0
    return sum('"event": "prompt"' in line for line in path.read_text().splitlines())


# --------------------------------------------------------------------------- headless Chromium

def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        p = shutil.which(name)
        if p:
            return p
    return None


CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--hide-scrollbars"]

IMG_PROBE = """<script>
window.addEventListener('load', function () {
  var out = [];
  document.querySelectorAll('img').forEach(function (i) {
    out.push(i.complete + ':' + i.naturalWidth + 'x' + i.naturalHeight);
  });
  var p = document.createElement('pre'); p.id = 'imgprobe';
  p.textContent = 'IMG' + 'PROBE[' + out.join(',') + ']'; document.body.appendChild(p);
});
</script>"""


def run_chromium(exe: str, tmp: Path, args: list[str]) -> subprocess.CompletedProcess:
    profile = tmp / f"profile-{len(list(tmp.glob('profile-*')))}"
    profile.mkdir()
    return subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=120)


def assert_images_decode(exe: str, tmp_path: Path, html_path: Path, count: int) -> None:
    """The page's ``count`` embedded images decode in Chromium: naturalWidth probed from a copy
    of the page with a tiny script."""
    probe = tmp_path / "probe.html"
    probe.write_text(html_path.read_text().replace("</body>", IMG_PROBE + "</body>"))
    res = run_chromium(exe, tmp_path, ["--dump-dom", "--virtual-time-budget=5000", probe.as_uri()])
    m = re.search(r"IMGPROBE\[([^\]]*)\]", res.stdout)
    assert m, res.stdout[-500:] + res.stderr[-2000:]
    entries = m.group(1).split(",")
    assert len(entries) == count
    for e in entries:
        complete, size = e.split(":")
        w, h = map(int, size.split("x"))
        assert complete == "true" and w >= 300 and h >= 200, entries
