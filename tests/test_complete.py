"""The completeness rule (orchestrator/sync/complete.py): a checkpoint still being written is
never synced. Unit cases of the rule, then `sync-ckpt` on the SSH lab."""
from __future__ import annotations

import json
import os
import time

import pytest

from orchestrator.config.catalog import CatalogError, TrainingRun, parse_catalog
from orchestrator.sync import sync_checkpoint
from orchestrator.sync.complete import IncompleteCheckpoint, judge, missing_files
from synclab import FAST, Env, identical

RUN = TrainingRun(name="v5", dir="v5", settle=30)


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
    _set_rule(env, settle=30)
    old = env.ckpt(100, {"config.json": b"{}\n", "model.safetensors": 1})
    _age(old, 600)
    env.ckpt(200, {"config.json": b"{}\n", "model.safetensors": 1})  # written just now
    with pytest.raises(IncompleteCheckpoint, match=r"step_200 is not complete yet: a file changed \d+s ago "
                                                   r"\(settle time 30s\).*try again in \d+s.*newest complete "
                                                   r"checkpoint is step_100"):
        env.sync("latest")
    assert not (env.dst_run / "step_200").exists() and not env.staging(200).exists()
    plans = []
    env.sync("latest", dry_run=True, on_plan=plans.append)  # a dry run shows it, refuses nothing
    assert plans[0].incomplete and "settle time 30s" in plans[0].incomplete
    assert sync_checkpoint(env.inv, env.catalog, "100", run=env.run, **FAST).verified == 2
    _age(env.src_run / "step_200", 60)
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
