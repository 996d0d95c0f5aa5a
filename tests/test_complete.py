"""The completeness rule (orchestrator/sync/complete.py): a checkpoint still being written is
never synced. Unit cases of the rule, then `sync-ckpt` on the SSH lab."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.config.catalog import CatalogError, TrainingRun, parse_catalog
from orchestrator.sync import sync_checkpoint
from orchestrator.sync.complete import IncompleteCheckpoint, judge, judge_listed, judge_manifest, missing_files
from synclab import FAST, Env, identical

RUN = TrainingRun(name="v5", dir="v5", settle=30)
QUICK = TrainingRun(name="v5", dir="v5", settle=0)     # complete = the expected files are there


def test_rule_needs_config_and_weights_or_the_marker():
    assert missing_files(["config.json"], None) == ["weights (*.safetensors, *.pt, *.pth or *.bin)"]
    assert missing_files(["model.safetensors"], None) == ["config.json"]
    assert missing_files(["config.json", "model.safetensors"], None) == []
    assert missing_files(["config.json", "sub/model.pt"], None) != []  # weights at the top level only
    shards = ["config.json", "model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors",
              "model.safetensors.index.json"]
    assert missing_files(shards, None) == ["model-00002-of-00003.safetensors"]
    assert missing_files(["config.json", "model.safetensors"], "DONE") == ["DONE"]
    assert missing_files(["whatever.bin", "DONE"], "DONE") == []


def test_rule_needs_the_files_quiet_for_the_settle_time_on_the_hosts_clock():
    files = ["config.json", "model.safetensors"]
    v = judge(files, newest_mtime=1000.0, host_now=1010.0, run=RUN)
    assert not v.complete and "changed 10s ago (settle time 30s)" in v.reason and v.wait == pytest.approx(20)
    assert judge(files, newest_mtime=1000.0, host_now=1030.0, run=RUN).complete
    assert not judge(files, newest_mtime=2000.0, host_now=1000.0, run=RUN).complete  # from the future: not quiet
    v = judge(["config.json"], newest_mtime=0.0, host_now=1e9, run=RUN)
    assert not v.complete and v.wait is None and "expected files missing" in v.reason


def test_catalog_fields_of_the_rule(tmp_path):
    cat = parse_catalog({"runs": {"a": {"settle": 5, "marker": "DONE", "log": "logs/train.jsonl",
                                        "metrics": ["eval/acc_len"]}, "b": {}}}, tmp_path / "c.yaml")
    a, b = cat.run("a"), cat.run("b")
    assert (a.settle, a.marker, a.log, a.metrics, a.tau_metric) == (5.0, "DONE", "logs/train.jsonl",
                                                                    ("eval/acc_len",), "eval/acc_len")
    assert (b.settle, b.marker) == (60.0, None)
    for bad, msg in (({"settle": -1}, "settle must be"), ({"settle": "x"}, "must be int or float"),
                     ({"marker": "../x"}, "would leave"), ({"log": "../t.jsonl"}, "must not contain")):
        with pytest.raises(CatalogError, match=msg):
            parse_catalog({"runs": {"a": bad}}, tmp_path / "c.yaml")


@pytest.fixture
def env(ssh_lab, tmp_path):
    return Env(ssh_lab, tmp_path)


def _set_rule(env: Env, **rule) -> None:
    data = json.loads(env.cat_path.read_text())
    data["runs"][env.run].update(rule)
    env.cat_path.write_text(json.dumps(data))
    env.catalog = parse_catalog(data, env.cat_path)


def _age(folder, seconds: float) -> None:
    when = time.time() - seconds
    for p in folder.rglob("*"):
        os.utime(p, (when, when))


def test_a_checkpoint_with_only_its_config_is_refused_not_finalised(env):
    """Before the rule: '1 file verified' and a final folder that the next sync refuses."""
    env.ckpt(300, {"config.json": b'{"block_size": 16}\n'})
    _age(env.src_run / "step_300", 3600)
    with pytest.raises(IncompleteCheckpoint, match=r"step_300 is not complete yet: expected files missing: "
                                                   r"weights .*is training still writing it"):
        env.sync("300")
    assert not (env.dst_run / "step_300").exists()
    assert not env.staging(300).exists()
    p = env.cli("sync-ckpt", "300", "--run", env.run)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 5 and "not complete yet" in err and "Traceback" not in err, err
    # training finishes writing it: now it syncs, whole
    src = env.ckpt(300, {"model.safetensors": 2})
    res = env.sync("300")
    assert res.verified == 2
    identical(src, env.dst_run / "step_300")


def test_files_still_changing_are_refused_until_quiet_and_latest_names_the_newest_complete(env):
    settle = 3                  # quiet time is the host's (ctime): it is waited out, not faked with mtimes
    _set_rule(env, settle=settle)
    env.ckpt(100, {"config.json": b"{}\n", "model.safetensors": 1})
    time.sleep(settle)
    env.ckpt(200, {"config.json": b"{}\n", "model.safetensors": 1})  # written just now
    written = time.monotonic()
    with pytest.raises(IncompleteCheckpoint, match=r"step_200 is not complete yet: a file changed \d+s ago "
                                                   r"\(settle time 3s\).*try again in \d+s.*newest complete "
                                                   r"checkpoint is step_100"):
        env.sync("latest")
    assert not (env.dst_run / "step_200").exists() and not env.staging(200).exists()
    plans = []
    env.sync("latest", dry_run=True, on_plan=plans.append)  # a dry run shows it, refuses nothing
    assert plans[0].incomplete and "settle time 3s" in plans[0].incomplete
    assert sync_checkpoint(env.inv, env.catalog, "100", run=env.run, **FAST).verified == 2
    time.sleep(max(0.0, written + settle - time.monotonic()))
    assert env.sync("latest").plan.checkpoint == "step_200"


def test_a_marker_file_is_what_complete_means_when_the_run_names_one(env):
    _set_rule(env, marker="COMPLETE")
    d = env.ckpt(5, {"config.json": b"{}\n", "model.safetensors": 1})
    _age(d, 120)
    with pytest.raises(IncompleteCheckpoint, match="expected files missing: COMPLETE"):
        env.sync("5")
    (d / "COMPLETE").write_text("")
    _age(d, 120)
    assert env.sync("5").verified == 3


def test_a_checkpoint_of_more_than_a_thousand_files_can_be_complete(tmp_path):
    """1200 weight shards: the training host's listing names every top-level file, so the rule
    sees the whole shard set (a listing cut at 1000 paths made it incomplete for ever)."""
    from orchestrator.sync.complete import newest_complete

    ckpt = tmp_path / "v5" / "step_100"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text("{}\n")
    for k in range(1, 1201):
        (ckpt / f"model-{k:05d}-of-01200.safetensors").write_bytes(b"w")
    info = _listed(tmp_path)
    (entry,) = info["checkpoints"]
    assert judge_listed(entry, info["now"], QUICK).complete, judge_listed(entry, info["now"], QUICK).reason
    assert newest_complete(info, QUICK) == "step_100"


def _tool(*args: str) -> dict:
    """An answer of remote/sync_host.py run here (this machine as the training host)."""
    tool = Path(__file__).resolve().parents[1] / "remote" / "sync_host.py"
    res = subprocess.run([sys.executable, str(tool), *args], capture_output=True, text=True, timeout=120)
    return json.loads(res.stdout)


def _listed(root: Path) -> dict:
    answer = _tool("list", str(root), "--run", "v5", "v5", "step_{step}")
    return {**answer["runs"]["v5"], "now": answer["now"]}


def test_quiet_time_is_the_hosts_own_and_a_file_dated_behind_or_ahead_is_named(tmp_path):
    """Files written just now, dated an hour behind the training host's clock (a writer whose clock
    runs behind, or times kept as a copy arrives: `cp -p`, `rsync -a`), are not quiet: the host's
    ctime says when they changed (before: complete at once, quiet time read from the mtimes);
    an hour ahead is named as before. The sync's manifest judges the same."""
    for step, offset in ((100, -3600), (200, 3600)):
        d = tmp_path / "v5" / f"step_{step}"
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}\n")
        (d / "model.safetensors").write_bytes(b"w")
        for f in d.iterdir():
            os.utime(f, (time.time() + offset,) * 2)
    info = _listed(tmp_path)
    entries = {c["name"]: c for c in info["checkpoints"]}
    behind = judge_listed(entries["step_100"], info["now"], RUN)
    assert not behind.complete and behind.wait == pytest.approx(30, abs=5), behind
    assert re.fullmatch(r"a file changed \ds ago though its mtime says 360\ds ago \(a writer whose clock runs behind "
                        r"the training host's, or times kept from a copy\) \(settle time 30s\)", behind.reason), behind
    ahead = judge_listed(entries["step_200"], info["now"], RUN)
    assert not ahead.complete and re.match(r"a file is dated 3\d\d\ds in the future", ahead.reason), ahead
    for step, verdict in ((100, behind), (200, ahead)):
        answer = _tool("manifest", str(tmp_path / "v5" / f"step_{step}"))
        sync = judge_manifest(answer["files"], answer["now"], RUN)
        assert not sync.complete and re.sub(r"\d+", "N", sync.reason) == re.sub(r"\d+", "N", verdict.reason), sync


def test_a_file_server_clock_ahead_is_named_and_a_marker_with_settle_0_needs_no_clock():
    """Shared storage whose file server's clock runs 10 min ahead of the training host's: the
    rule says so (not 'changed 0s ago' for ever), and `marker` + `settle: 0` is complete as soon
    as the marker is there, whatever the clocks."""
    now = 1_000_000.0
    files = ["config.json", "model.safetensors", "DONE"]
    v = judge(files, now + 600, now, TrainingRun(name="v5", dir="v5", settle=30))
    assert not v.complete and "600s in the future" in v.reason and "`settle: 0`" in v.reason, v
    assert judge(files, now + 600, now, TrainingRun(name="v5", dir="v5", settle=0, marker="DONE")).complete
    assert not judge(files[:2], now + 600, now, TrainingRun(name="v5", dir="v5", settle=0, marker="DONE")).complete
    assert not judge(files, now + 5, now, RUN).complete                 # a little skew: quiet time as before
