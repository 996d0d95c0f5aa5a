"""One resolver for every name: the same wrong name fails the same way in every command (one red
line, the same message, exit 2, before any host is contacted); config discovery is stated and
`init` writes the examples; tables fit 80 columns with every run id whole."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from orchestrator.cli import app
from orchestrator.config.paths import shipped
from runfixtures import make_run

pytestmark = pytest.mark.timeout(120)

# TEST-NET-1 addresses: nothing answers there, so a command that tried to connect would hang
# until its timeout and fail with exit 1 instead of the name error.
UNREACHABLE = {"ct200": "192.0.2.200", "ct129": "192.0.2.129"}
ZLAB, V5, V5_ONLINE = "20261202-0900-zlab-ct129", "20261202-1000-v5-step20k-ct129", "20261203-1100-v5-step20k-ct129"
V5_OLD = "20261201-0800-v5-step10k-ct129"


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A folder as a user has it: ./inventory.yaml (ct200 train, ct129 eval, `gpus: 0`),
    ./configs/drafters.yaml (v5 + zlab) and ./runs with three runs."""
    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump({"hosts": {
        "ct200": {"address": UNREACHABLE["ct200"], "roles": ["train"], "checkpoints": "/ckpt", "gpus": 0},
        "ct129": {"address": UNREACHABLE["ct129"], "roles": ["eval"], "checkpoints": "/ckpt", "gpus": 0,
                  "workdir": "/w"}}}, sort_keys=False))
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "drafters.yaml").write_text(yaml.safe_dump({
        "runs": {"v5": {"dir": "v5"}},
        "drafters": {"zlab": {"path": "/models/zlab", "target": "tiny"}, "v5": {"run": "v5", "target": "tiny"}},
        "targets": {"tiny": {"path": "/models/tiny"}}}, sort_keys=False))
    runs = tmp_path / "runs"
    make_run(runs, ZLAB, "zlab", prompts=6)
    make_run(runs, V5_OLD, "v5", "step_10000", prompts=6, meta={"step": 10000})
    make_run(runs, V5, "v5", "step_20000", prompts=6, meta={"step": 20000})
    make_run(runs, V5_ONLINE, "v5", "step_20000", prompts=6, mode="online", meta={"step": 20000})
    for var in ("DFLASH_OPS_INVENTORY", "DFLASH_OPS_CATALOG", "DFLASH_OPS_RUNS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run(*args: str, columns: int = 200):
    res = CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns)})
    assert "Traceback" not in res.output, res.output
    return res


def error_line(*args: str) -> tuple[int, str]:
    started = time.monotonic()
    res = run(*args)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), (args, res.output)
    assert time.monotonic() - started < 10, f"{args} took {time.monotonic() - started:.1f}s: it contacted a host"
    return res.exit_code, lines[0]


SAME_MISTAKE = {
    "host": [["eval", "--host", "ct12"], ["hosts", "check", "ct12"], ["sync-ckpt", "step20k", "--to", "ct12"],
             ["ckpts", "--to", "ct12"], ["sync-ckpt", "step20k", "--from", "ct12"], ["runs", "--host", "ct12"]],
    "role": [["eval", "--host", "ct200"], ["sync-ckpt", "step20k", "--to", "ct200"], ["ckpts", "--to", "ct200"]],
    "training run": [["ckpts", "v6"], ["sync-ckpt", "v6:step20k"], ["sync-ckpt", "step20k", "--run", "v6"]],
    "run": [["show", "zlb"], ["parity", "zlb"], ["attach", "zlb"], ["cancel", "zlb"], ["compare", "zlb", "v5"],
            ["eval", "--resume", "zlb"], ["runs", "--drafter", "zlb"]],
    "run checkpoint": [["show", "v5:step30k"], ["attach", "v5:step30k"], ["compare", "zlab", "v5:step30k"],
                       ["parity", "v5:step30k"], ["runs", "--drafter", "v5:step30k"]],
}
WANT = {
    "host": "unknown host 'ct12' (did you mean 'ct129'?); known hosts: local, ct200, ct129; "
            "inventory: inventory.yaml (from the current directory)",
    "role": "host ct200 is not an eval host (roles: train); eval hosts: local, ct129; "
            "inventory: inventory.yaml (from the current directory)",
    "training run": "unknown training run 'v6' (did you mean 'v5'?); known training runs: v5; "
                    "catalog: configs/drafters.yaml (from the current directory)",
    "run": "no run matches 'zlb' in runs (did you mean 'zlab'?); `dflash-ops runs` lists them",
    "run checkpoint": "no run matches 'v5:step30k' in runs (did you mean 'v5:step_20000'?); "
                      "v5 has runs of step_10000, step_20000; `dflash-ops runs` lists them",
}


@pytest.mark.parametrize("kind", list(SAME_MISTAKE))
def test_the_same_wrong_name_fails_the_same_way_everywhere(project, kind):
    seen = {tuple(args): error_line(*args) for args in SAME_MISTAKE[kind]}
    assert set(seen.values()) == {(2, f"error: {WANT[kind]}")}, json.dumps(
        {" ".join(a): v for a, v in seen.items()}, indent=1)


def test_eval_resolves_before_any_host_is_contacted(project):
    assert error_line("eval", "--host", "ct129", "--drafter", "v6") == (
        2, "error: unknown drafter 'v6' (did you mean 'v5'?); known drafters: zlab, v5, embedded; "
           "catalog: configs/drafters.yaml (from the current directory)")
    code, line = error_line("eval", "--host", "ct129", "--drafter", "zlab:step20k")
    assert code == 2 and "drafter zlab is a folder (/models/zlab), not a training run" in line


def test_every_spelling_of_a_checkpoint_finds_the_recorded_run(project):
    for spellings, want in ((("v5:step20k", "v5:20000", "v5:step_20000", "v5:20k", "v5", "step20k"), V5_ONLINE),
                            (("v5:step10k", "v5:10000", "v5:step_10000", "v5:10k", "step_10000"), V5_OLD)):
        for spelling in spellings:
            res = run("show", spelling, "--json")
            assert res.exit_code == 0, res.output
            assert json.loads(res.stdout)["id"] == want, spelling     # the newest run of that checkpoint
    res = run("runs", "--drafter", "v5:step20k", "--json")
    assert {r["id"] for r in json.loads(res.stdout)} == {V5, V5_ONLINE}
    assert {r["step"] for r in json.loads(res.stdout)} == {20000}
    assert json.loads(run("show", "latest", "--json").stdout)["id"] == V5_ONLINE


def test_unknown_names_say_which_files_were_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                       # no ./inventory.yaml, no ./configs/drafters.yaml
    for var in ("DFLASH_OPS_INVENTORY", "DFLASH_OPS_CATALOG"):
        monkeypatch.delenv(var, raising=False)
    code, line = error_line("eval", "--host", "ct129")
    assert code == 2 and line.startswith("error: unknown host 'ct129'; known hosts: local; no inventory file")
    assert "./inventory.yaml" in line and "dflash-ops/inventory.yaml" in line and "dflash-ops init" in line
    # the catalog shipped in the package is an example for `init`, never read silently
    code, line = error_line("eval", "--host", "local", "--drafter", "zlab")
    assert code == 2 and "unknown drafter 'zlab'; known drafters: embedded; no catalog file" in line


def test_init_writes_the_commented_examples_and_config_states_the_discovery(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for var in ("DFLASH_OPS_INVENTORY", "DFLASH_OPS_CATALOG"):
        monkeypatch.delenv(var, raising=False)
    user = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(user))
    res = run("init")
    assert res.exit_code == 0, res.output
    for name in ("inventory.yaml", "drafters.yaml"):
        written = user / "dflash-ops" / name
        assert written.read_text() == shipped(name).read_text() and written.read_text().startswith("#")
    assert error_line("init") == (2, f"error: {user / 'dflash-ops' / 'inventory.yaml'}, "
                                     f"{user / 'dflash-ops' / 'drafters.yaml'} already exists: edit it, or pass "
                                     "--force to replace it with the commented example")
    found = json.loads(run("config", "--json").stdout)
    assert found["inventory"] == {"path": str(user / "dflash-ops" / "inventory.yaml"), "source": "user config folder",
                                  "looked_for": found["inventory"]["looked_for"]}
    assert found["catalog"]["source"] == "user config folder"
    assert run("init", "--dir", "proj").exit_code == 0
    monkeypatch.chdir(tmp_path / "proj")           # the project layout is found from its folder
    found = json.loads(run("config", "--json").stdout)
    assert (found["inventory"]["path"], found["inventory"]["source"]) == ("inventory.yaml", "current directory")
    assert (found["catalog"]["path"], found["catalog"]["source"]) == ("configs/drafters.yaml", "current directory")
    monkeypatch.setenv("DFLASH_OPS_CATALOG", str(tmp_path / "nowhere.yaml"))
    Path("x.yaml").write_text("runs: {x: {}}\n")
    assert json.loads(run("config", "--json", "--catalog", "x.yaml").stdout)["catalog"]["source"] == "--catalog"
    code, line = error_line("config")
    assert code == 2 and "nowhere.yaml: cannot read the catalog" in line


IDS = [ZLAB, V5, V5_ONLINE, V5_OLD]


@pytest.mark.parametrize("args", [["runs"], ["show", V5], ["compare", "zlab", "v5", "--resamples", "200"],
                                  ["hosts"], ["config"]])
def test_output_fits_80_columns_with_ids_whole(project, args):
    res = run(*args, columns=80)
    assert res.exit_code == 0, res.output
    too_long = [ln for ln in res.stdout.splitlines() if len(ln.rstrip()) > 80]
    assert not too_long, "\n".join(too_long)
    for rid in IDS:
        if args[0] == "runs" or rid in args or (args[0] == "compare" and rid in (ZLAB, V5)):
            assert re.search(rf"(^|[\s(]){re.escape(rid)}([\s)]|$)", res.stdout), (rid, res.stdout)


def test_eval_default_drafter_from_the_catalog(project):
    from orchestrator.names import Resolver

    names = Resolver()
    ct129 = names.host("ct129", role="eval")
    choice = names.drafter(None, ct129)          # no `default:`: the catalog's one training run, located later
    assert (choice.label, choice.run.name, choice.checkpoint) == ("v5", "v5", None)
    assert choice.why == "no --drafter: the newest synced checkpoint of training run v5"
    assert names.drafter(None, names.host("local")).label == "embedded"
    cat = project / "configs" / "drafters.yaml"
    cat.write_text(cat.read_text() + "default: zlab\n")
    choice = Resolver().drafter(None, ct129)
    assert (choice.label, choice.path, choice.target, choice.why) == ("zlab", "/models/zlab", "tiny",
                                                                      "the catalog's default")
    assert choice.statement("ct129") == "zlab → zlab (/models/zlab) on ct129, target tiny (the catalog's default)"
    cat.write_text(cat.read_text().replace("default: zlab", "default: v6"))
    code, line = error_line("eval", "--host", "ct129")
    assert code == 2 and "configs/drafters.yaml: default: unknown drafter 'v6'" in line, line
