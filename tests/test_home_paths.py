"""`~` in inventory and catalog paths means the login user's home on that host:
sync, ckpts, hosts check and eval find and create their files there, and nothing named `~` appears
(a `~` quoted literally would make a folder called `~`)."""
from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from hostpython import host_python

from orchestrator.config.inventory import InventoryError, parse_inventory

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[1]


def test_only_a_plain_tilde_is_expanded():
    for field in ("workdir", "checkpoints", "python"):
        with pytest.raises(InventoryError, match=rf"host 'gpu': field '{field}': '~bob/x': only '~' and '~/...'"):
            parse_inventory({"hosts": {"gpu": {"address": "192.0.2.1", field: "~bob/x"}}}, Path("inv.yaml"))


@pytest.mark.worker
def test_tilde_paths_live_in_the_login_home_on_the_host(ssh_lab, embedded_pair, tmp_path):
    tag = uuid.uuid4().hex[:8]
    home = Path(pwd.getpwnam(ssh_lab.eval.user).pw_dir)          # the lab's hosts share this file system
    made = [home / f"dfl-work-{tag}", home / f"dfl-ckpts-{tag}", home / f"dfl-train-{tag}", home / f"dfl-py-{tag}"]
    strays = [home / "~", Path.cwd() / "~", REPO / "~"]
    before = {p: p.exists() for p in strays}
    try:
        host_python(home / f"dfl-py-{tag}" / "python")
        shutil.copytree(Path(embedded_pair["target"]).parent, home / f"dfl-work-{tag}" / "embedded")
        run = f"r{tag}"
        src = home / f"dfl-train-{tag}" / run / "step_5"
        src.mkdir(parents=True)
        (src / "config.json").write_text("{}\n")
        (src / "model.safetensors").write_bytes(os.urandom(1 << 16))
        inv = ssh_lab.write_inventory(tmp_path / "inventory.yaml",
                                      train={"checkpoints": f"~/dfl-train-{tag}"},
                                      eval={"workdir": f"~/dfl-work-{tag}", "checkpoints": f"~/dfl-ckpts-{tag}",
                                            "python": f"~/dfl-py-{tag}/python"})
        cat = tmp_path / "drafters.yaml"
        cat.write_text(yaml.safe_dump({"runs": {run: {"dir": run, "settle": 0}}}))
        env = {**os.environ, "DFLASH_OPS_CATALOG": str(cat), "DFLASH_OPS_RUNS": str(tmp_path / "runs"),
               "COLUMNS": "200"}

        def cli(*args):
            res = subprocess.run([sys.executable, "-m", "orchestrator.cli", "--inventory", str(inv), *args], cwd=REPO,
                                 env=env, capture_output=True, text=True, timeout=600)
            assert res.returncode == 0 and "Traceback" not in res.stderr, res.stdout + res.stderr
            return res.stdout

        cli("sync-ckpt", "5", "--run", run)
        final = home / f"dfl-ckpts-{tag}" / run / "step_5"
        assert (final / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
        assert "yes" in cli("ckpts", run)
        out = cli("hosts", "check", "eval")
        assert "passed" in out and "(missing)" not in out, out
        cli("eval", "--host", "eval", "--drafter", "embedded", "--device", "cpu", "--prompts", "1",
            "--max-new-tokens", "8", "--ddtree", "")
        (run_dir,) = [d for d in (tmp_path / "runs").iterdir() if (d / "run.json").exists()]
        shard = json.loads((run_dir / "run.json").read_text())["shards"][0]
        assert shard["run_dir"].startswith(f"{home}/dfl-work-{tag}/runs/") and shard["python"].startswith(str(home))
        assert (Path(shard["run_dir"]) / "out" / "results.jsonl").exists()
        assert {p: p.exists() for p in strays} == before, "a folder named '~' was created"
    finally:
        for p in made:
            shutil.rmtree(p, ignore_errors=True)
        for stray in strays:                            # what a failing run left behind
            for p in made:
                shutil.rmtree(stray / p.name, ignore_errors=True)
            if not before[stray] and stray.is_dir() and not any(stray.iterdir()):
                stray.rmdir()
