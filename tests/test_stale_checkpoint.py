"""A checkpoint the training host saves again after it was synced (training that resumes re-saves
a step): on the SSH lab, `ckpts` calls the eval host's copy stale and `eval` refuses it, naming
what changed and how to sync it again; a file merely touched (same bytes) is not a change."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import yaml

from orchestrator.config.catalog import load_catalog
from orchestrator.config.inventory import load_inventory
from orchestrator.sync import list_checkpoints, sync_checkpoint

REPO = Path(__file__).resolve().parents[1]
FAST = dict(alive=(2, 3), idle=6.0, stall=20.0, progress=None)


def test_a_checkpoint_saved_again_after_its_sync_is_stale_and_refused(ssh_lab, tmp_path):
    run = f"r{uuid.uuid4().hex[:8]}"
    src = ssh_lab.train.root / "checkpoints" / run / "step_200"
    src.mkdir(parents=True)
    (src / "config.json").write_text("{}\n")
    (src / "model.safetensors").write_bytes(os.urandom(65536))
    inventory = ssh_lab.write_inventory(tmp_path / "inventory.yaml")
    catalog = tmp_path / "drafters.yaml"
    catalog.write_text(yaml.safe_dump({"runs": {run: {"dir": run, "pattern": "step_{step}", "settle": 0}},
                                       "drafters": {"v5": {"run": run, "format": "zlab", "target": "t"}},
                                       "targets": {"t": {"path": "/nonexistent"}}}))
    inv, cat = load_inventory(inventory), load_catalog(str(catalog))
    sync_checkpoint(inv, cat, "step_200", run=run, **FAST)

    def on_eval() -> str:
        rows, warnings = list_checkpoints(inv, cat, run)
        assert not warnings, warnings
        return rows[0].on_eval

    def evaluate() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "orchestrator.cli", "-i", str(inventory), "eval", "--host", "eval",
                               "--drafter", "v5:step_200", "--catalog", str(catalog)], cwd=REPO, capture_output=True,
                              text=True, timeout=300, env={**os.environ, "DFLASH_OPS_RUNS": str(tmp_path / "runs"),
                                                           "COLUMNS": "300"})
    assert on_eval() == "yes"
    later = time.time() + 5
    os.utime(src / "config.json", (later, later))           # touched, same bytes: still the same checkpoint
    assert on_eval() == "yes"
    (src / "model.safetensors").write_bytes(os.urandom(65536))  # training saved step 200 again
    assert on_eval() == "stale"
    proc = evaluate()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out
    assert "v5:step_200 on eval is not the one on train any more" in out and "changed: model.safetensors" in out, out
    assert "dflash-ops sync-ckpt v5:step_200 --to eval" in out, out
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())     # nothing was started
