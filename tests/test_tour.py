"""The README's tour on the SSH lab, exactly as a user types it: a project folder with
./inventory.yaml (train host ct200, eval host ct129 with `gpus: 0`, which cannot reach each other)
and ./configs/drafters.yaml (training run v5, reference drafter zlab), then

    dflash-ops sync-ckpt step20k
    dflash-ops eval --host ct129 --prompts 2
    dflash-ops eval --host ct129 --drafter zlab --prompts 2
    dflash-ops compare zlab v5

each succeeding and saying what it resolved; after an online eval and a 12-prompt eval of v5
exist, `compare zlab v5` still picks the pair that pairs and names it.

Set DFLASH_OPS_TOUR_OUT=FILE to keep every command's output (the README shows it)."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from waiting import finished, started

pytestmark = [pytest.mark.timeout(1800), pytest.mark.worker, pytest.mark.xdist_group("tour")]


@pytest.fixture(scope="module")
def project(ssh_lab, embedded_pair, tmp_path_factory):
    """The story's lab: v5's checkpoints step_10000 and step_20000 on ct200 (the trained demo
    drafter), the target and the zlab drafter on ct129, and the user's project folder."""
    pair = {k: Path(v) for k, v in embedded_pair.items()}
    models = ssh_lab.eval.root / "models"
    shutil.copytree(pair["target"], models / "qwen-tiny", dirs_exist_ok=True)
    shutil.copytree(pair["drafter"], models / "zlab-tiny", dirs_exist_ok=True)
    for step in (10000, 20000):          # copied in whole just now: the catalog's `settle: 0` waits for nothing
        shutil.copytree(pair["drafter"], ssh_lab.train.root / "checkpoints" / "v5" / f"step_{step}", dirs_exist_ok=True)
    shutil.rmtree(ssh_lab.eval.root / "checkpoints" / "v5", ignore_errors=True)
    lab = ssh_lab.inventory_dict(train={"roles": ["train"]}, eval={"roles": ["eval"], "gpus": 0})["hosts"]
    folder = tmp_path_factory.mktemp("tour")
    (folder / "inventory.yaml").write_text(yaml.safe_dump({"hosts": {"ct200": lab["train"], "ct129": lab["eval"]}},
                                                          sort_keys=False))
    (folder / "configs").mkdir()
    (folder / "configs" / "drafters.yaml").write_text(yaml.safe_dump({
        "runs": {"v5": {"dir": "v5", "pattern": "step_{step}", "settle": 0}},
        "drafters": {"v5": {"run": "v5", "format": "zlab", "target": "qwen-tiny"},
                     "zlab": {"path": str(models / "zlab-tiny"), "format": "zlab", "target": "qwen-tiny"}},
        "targets": {"qwen-tiny": {"path": str(models / "qwen-tiny")}}}, sort_keys=False))
    return folder


def start(project: Path, *args: str) -> subprocess.Popen:
    """The command as typed in the project folder (no flag, no environment variable for the files)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_OPS_")}
    env.update(COLUMNS="80")
    return subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *args], cwd=project, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def dflash_ops(project: Path, *args: str, expect: int = 0) -> subprocess.CompletedProcess:
    return done(start(project, *args), expect)


def done(started_proc: subprocess.Popen, expect: int = 0) -> subprocess.CompletedProcess:
    """The command's end, checked: no traceback, the expected exit code; kept for the README."""
    proc = finished(started_proc)
    args = proc.args[3:]
    keep = os.environ.get("DFLASH_OPS_TOUR_OUT")
    if keep:
        with open(keep, "a") as f:
            f.write(f"$ dflash-ops {shlex.join(args)}\n{proc.stdout}{proc.stderr}(exit {proc.returncode})\n\n")
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == expect, f"dflash-ops {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def flat(text: str) -> str:
    return " ".join(text.split())


def runs(project: Path) -> dict[str, dict]:
    return {d.name: json.loads((d / "run.json").read_text()) for d in (project / "runs").iterdir()
            if (d / "run.json").exists()}


def test_the_three_everyday_commands_work_as_typed(project, ssh_lab):
    out = dflash_ops(project, "sync-ckpt", "step20k").stdout
    assert "step20k → v5:step_20000 (ct200 → ct129)" in out
    assert (ssh_lab.eval.root / "checkpoints" / "v5" / "step_20000" / "model.safetensors").exists()
    assert "nothing to move" in dflash_ops(project, "sync-ckpt", "step20k").stdout     # a rerun moves nothing

    out = dflash_ops(project, "hosts", "check").stdout                 # readable at 80 columns
    assert "ct200" in out and "ct129" in out and all(len(line.rstrip()) <= 80 for line in out.splitlines()), out

    out = dflash_ops(project, "eval", "--host", "ct129", "--prompts", "2").stdout
    assert "v5 → v5:step_20000" in out and "on ct129" in out, out     # the default drafter, said
    (v5,) = runs(project).values()
    assert (v5["drafter"], v5["checkpoint"], v5["step"], v5["mode"]) == ("v5", "step_20000", 20000, "offline")
    assert v5["shards"][0]["drafter_path"].endswith("/checkpoints/v5/step_20000")
    # no --device: `gpus: 0` in the inventory ran the worker on CPU (pre-flight asked for no GPU)
    assert v5["request"]["settings"]["device"] is None
    cmd = json.loads((ssh_lab.eval.root / "workdir" / "runs" / v5["id"] / "cmd.json").read_text())["argv"]
    assert cmd[cmd.index("--device") + 1] == "cpu"

    out = dflash_ops(project, "eval", "--host", "ct129", "--drafter", "zlab", "--prompts", "2").stdout
    assert "zlab → zlab" in out
    out = flat(dflash_ops(project, "compare", "zlab", "v5").stdout)
    zlab = next(r for r in runs(project).values() if r["drafter"] == "zlab")
    assert f"zlab → {zlab['id']} (the newest zlab run)" in out and f"v5 → {v5['id']} (the newest v5 run)" in out, out

    # runs of this checkpoint are found by every spelling of it
    shows = [start(project, "show", spelling, "--json") for spelling in ("v5:step20k", "v5:20000", "v5:step_20000")]
    for show in shows:
        assert json.loads(done(show).stdout)["id"] == v5["id"]

    # an online eval and a 12-prompt eval are newer, and pair with no zlab run (run side by side)
    before = set(runs(project))
    first = start(project, "eval", "--host", "ct129", "--prompts", "2", "--mode", "online")
    online = started(project / "runs", first, ssh_lab.eval.root / "workdir" / "code", known=before)
    second = start(project, "eval", "--host", "ct129", "--prompts", "12", "--max-new-tokens", "32")
    done(first)
    done(second)
    (twelve,) = set(runs(project)) - before - {online}
    assert runs(project)[online]["mode"] == "online" and runs(project)[twelve]["prompts"] == 12
    out = flat(dflash_ops(project, "compare", "zlab", "v5").stdout)
    assert (f"v5 → {v5['id']} (the newest v5 run that pairs with {zlab['id']}; skipped newer: "
            f"{twelve} (prompts 12 vs 2, max_new_tokens 32 vs 256), {online} (mode online vs offline))") in out, out
    listing = dflash_ops(project, "runs").stdout
    assert all(len(line.rstrip()) <= 80 for line in listing.splitlines()), listing
    for rid in runs(project):
        assert rid in listing, (rid, listing)
    assert "online" in listing and "offline" in listing

    # a checkpoint on the training host only: refused with the way to sync it, then --sync syncs and runs it
    err = flat(dflash_ops(project, "eval", "--host", "ct129", "--drafter", "v5:step10k", expect=2).stderr)
    assert err == ("error: v5:step_10000 is on ct200 but not on ct129: add --sync to copy it first, or run "
                   "`dflash-ops sync-ckpt v5:step_10000 --to ct129`"), err
    out = flat(dflash_ops(project, "eval", "--host", "ct129", "--drafter", "v5:step10k", "--sync", "--prompts", "1",
                          "--max-new-tokens", "16", "--ddtree", "").stdout)
    assert "v5:step10k → v5:step_10000 (ct200 → ct129)" in out and "2 file(s) verified" in out, out
    assert "v5:step10k → v5:step_10000 on ct129" in out, out
    assert {r["step"] for r in runs(project).values() if r["drafter"] == "v5"} == {10000, 20000}
