"""Another sync of a checkpoint holding its lock on the eval host (SSH lab): `watch` waits for it
(not a failed attempt: three of those used to give the checkpoint up), and no command is told of
an option it does not have."""
from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def test_a_busy_lock_is_waited_for_by_watch_and_named_without_a_missing_option(ssh_lab, tmp_path):
    from orchestrator.names import Resolver
    from orchestrator.watch.loop import Watcher, WatchOptions
    from remote.contract.settings import EvalSettings

    run = f"r{uuid.uuid4().hex[:8]}"
    src = ssh_lab.train.root / "checkpoints" / run / "step_1"
    src.mkdir(parents=True)
    (src / "config.json").write_text("{}\n")
    (src / "model.safetensors").write_bytes(os.urandom(4096))
    inventory = ssh_lab.write_inventory(tmp_path / "inventory.yaml")
    catalog = tmp_path / "drafters.yaml"
    catalog.write_text(yaml.safe_dump({"runs": {run: {"dir": run, "pattern": "step_{step}", "settle": 0}},
                                       "drafters": {run: {"run": run, "format": "zlab", "target": "t"}},
                                       "targets": {"t": {"path": "/nonexistent"}}}))
    dst_run = ssh_lab.eval.root / "checkpoints" / run
    dst_run.mkdir(parents=True)
    held = os.open(dst_run / ".lock-step_1", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(held, fcntl.LOCK_EX)                  # another sync of step_1, still running
    said: list[tuple[str, str]] = []
    try:
        names = Resolver(str(inventory), str(catalog), tmp_path / "runs")
        opts = WatchOptions(run=run, hosts=["eval"], settings=EvalSettings(prompts=1), max_attempts=3)
        watcher = Watcher(names, opts, lambda level, msg: said.append((level, msg)),
                          sync_kw={"lock_wait": 1, "alive": (2, 3), "idle": 6.0, "stall": 20.0})
        for _ in range(3):
            watcher.watch(once=True, every_s=0)
        point = json.loads((tmp_path / "runs" / f"watch-{run}" / "state.json").read_text())["points"]["step_1"]
        assert point["status"] == "waiting" and point["attempts"] == 0, point
        busy = [m for _, m in said if "another sync of step_1 holds" in m]
        assert busy and not any("--lock-wait" in m for m in busy), said
        env = {**os.environ, "COLUMNS": "200"}
        proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "-i", str(inventory), "sync-ckpt", "1",
                               "--run", run, "--catalog", str(catalog), "--lock-wait", "1"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and "(or wait longer for it with --lock-wait)" in proc.stderr, proc.stderr
    finally:
        os.close(held)
    watcher.watch(once=True, every_s=0)                # the other sync is done: this one syncs now
    point = json.loads((tmp_path / "runs" / f"watch-{run}" / "state.json").read_text())["points"]["step_1"]
    assert (dst_run / "step_1" / "model.safetensors").exists(), point
