"""configs/drafters.yaml loading and checkpoint name resolution (no hosts needed)."""
from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.config.catalog import (CatalogError, TrainingRun, check_name, load_catalog, parse_catalog, parse_step,
                                  resolve_checkpoint, split_label)
from orchestrator.sync import newest_run

FOLDERS = ["step_1000", "step_19000", "step_20000", "step_21000", "final-export"]
RUN = TrainingRun(name="v5", dir="v5", pattern="step_{step}")


@pytest.mark.parametrize("name,step", [("step20k", 20000), ("20000", 20000), ("step_20000", 20000),
                                       ("20k", 20000), ("20K", 20000), ("step-20000", 20000),
                                       ("1.5k", 1500), ("2m", 2_000_000), ("abc", None), ("1.5", None)])
def test_parse_step(name, step):
    assert parse_step(name) == step


@pytest.mark.parametrize("name", ["step20k", "20000", "step_20000", "20k"])
def test_step_spellings_resolve_to_the_folder(name):
    assert resolve_checkpoint(name, RUN, FOLDERS) == "step_20000"


def test_folder_name_and_zero_padded_pattern():
    assert resolve_checkpoint("final-export", RUN, FOLDERS) == "final-export"
    padded = TrainingRun(name="v6", dir="v6", pattern="ckpt-{step:08d}")
    assert padded.folder_for(20000) == "ckpt-00020000"
    assert resolve_checkpoint("20k", padded, ["ckpt-00010000", "ckpt-00020000"]) == "ckpt-00020000"


def test_unknown_name_lists_the_nearest():
    with pytest.raises(CatalogError) as e:
        resolve_checkpoint("step20500", RUN, FOLDERS)
    msg = str(e.value)
    assert "no checkpoint 'step20500' in run v5" in msg and "nearest:" in msg
    assert "step_20000" in msg and "step_21000" in msg
    with pytest.raises(CatalogError, match="nearest: final-export"):
        resolve_checkpoint("final-exprt", RUN, FOLDERS)


@pytest.mark.parametrize("bad", ["..", "../step_20000", "/etc/passwd", "a/b", "~root", ".staging-x", "",
                                 "step\n1"])
def test_escaping_names_are_refused(bad):
    with pytest.raises(CatalogError):
        resolve_checkpoint(bad, RUN, FOLDERS + [bad])
    with pytest.raises(CatalogError):
        check_name(bad)


def test_shipped_catalog_loads():
    from orchestrator.config.paths import shipped

    cat = load_catalog(shipped("drafters.yaml"))      # the example `dflash-ops init` copies
    assert cat.run("v5").pattern == "step_{step}"
    d = cat.drafter("v5:step20k")
    assert d.run == "v5" and d.format == "state_dict" and cat.target(d.target).path
    assert d.eval_path("/data/checkpoints", "step_20000") == "/data/checkpoints/v5/step_20000"
    assert cat.drafter("zlab").eval_path(None) == cat.drafter("zlab").path
    assert split_label("v5:step20k") == ("v5", "step20k")
    with pytest.raises(CatalogError):
        split_label("v5:../x")


def test_lookups_say_did_you_mean():
    cat = parse_catalog({"runs": {"v5": {}}, "drafters": {"v5": {"run": "v5"}},
                         "targets": {"qwen": {"path": "/m"}}}, Path("c.yaml"))
    with pytest.raises(CatalogError, match="did you mean 'v5'"):
        cat.run("v6")
    with pytest.raises(CatalogError, match="unknown drafter 'v4'.*did you mean 'v5'"):
        cat.drafter("v4:step1")
    with pytest.raises(CatalogError, match="did you mean 'qwen'"):
        cat.target("qwen3")


@pytest.mark.parametrize("data,err", [
    ({"runs": {"v5": {"dri": "v5"}}}, "unknown field 'dri' \\(did you mean 'dir'"),
    ({"runs": {"v5": {"pattern": "step"}}}, "exactly one \\{step\\}"),
    ({"runs": {"v5": {"dir": "../elsewhere"}}}, "must not contain '..'"),
    ({"runs": {"..": {}}}, "would leave"),
    ({"drafters": {"x": {"run": "v9"}}}, "unknown training run 'v9'"),
    ({"drafters": {"x": {"path": "/a", "run": "v5"}}, "runs": {"v5": {}}}, "exactly one of 'path' or 'run'"),
    ({"drafters": {"x": {"path": "/a", "format": "onnx"}}}, "format 'onnx'"),
    ({"drafters": {"x": {"path": "/a", "target": "nope"}}}, "unknown target 'nope'"),
    ({"rns": {}}, "unknown top-level key 'rns'"),
])
def test_bad_catalogs(data, err):
    with pytest.raises(CatalogError, match=err):
        parse_catalog(data, Path("c.yaml"))


def test_yaml_errors_and_missing_file(tmp_path):
    p = tmp_path / "d.yaml"
    p.write_text("runs: [\n")
    with pytest.raises(CatalogError, match="invalid YAML"):
        load_catalog(p)
    with pytest.raises(CatalogError, match="cannot read"):
        load_catalog(tmp_path / "missing.yaml")


def test_run_source_dir_and_newest_run():
    assert RUN.source_dir("/ckpts") == "/ckpts/v5"
    assert TrainingRun(name="a", dir="/abs/a").source_dir(None) == "/abs/a"
    with pytest.raises(CatalogError, match="no `checkpoints` root"):
        RUN.source_dir(None)
    listing = {"old": {"checkpoints": [{"mtime": 5.0}, {"mtime": 7.0}]},
               "new": {"checkpoints": [{"mtime": 9.0}]}, "empty": {"checkpoints": []}}
    assert newest_run(listing) == "new"


def test_catalog_discovery_order(tmp_path, monkeypatch):
    from orchestrator.config.paths import shipped

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DFLASH_OPS_CATALOG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    assert load_catalog().path is None and not load_catalog().drafters   # the shipped example is never read
    assert "no catalog file" in str(load_catalog().found) and shipped("drafters.yaml").exists()
    user = tmp_path / "config" / "dflash-ops" / "drafters.yaml"
    user.parent.mkdir(parents=True)
    user.write_text("runs: {user_run: {}}\n")
    assert list(load_catalog().runs) == ["user_run"]
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "drafters.yaml").write_text("runs: {cwd_run: {}}\n")
    assert list(load_catalog().runs) == ["cwd_run"]
    monkeypatch.setenv("DFLASH_OPS_CATALOG", str(user))
    assert list(load_catalog().runs) == ["user_run"]
