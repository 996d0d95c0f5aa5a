"""Bad input gives one clean line that names the file and the field, never a traceback: a non-UTF-8 inventory or catalog, a jump with a bad port, ssh_config `Port abc`, a corrupt
run.json, a drafter config.json with fields of the wrong type; and the `{step:08d}` pattern the
shipped catalog documents works."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestrator.cli import app

pytestmark = pytest.mark.timeout(120)


def one_red_line(args: list[str], code: int, *wanted: str, env: dict | None = None) -> str:
    res = CliRunner().invoke(app, args, env=env)
    assert "Traceback" not in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.exit_code == code, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for w in wanted:
        assert w in lines[0], lines[0]
    return lines[0]


def test_non_utf8_inventory_names_the_file(tmp_path):
    inv = tmp_path / "inventory.yaml"
    inv.write_bytes(b"hosts:\n  ct129:\n    address: caf\xe9.example\n")
    for args in (["hosts"], ["hosts", "check"]):
        one_red_line(["--inventory", str(inv), *args], 2, str(inv), "not UTF-8", "line 3")


def test_non_utf8_catalog_names_the_file(tmp_path, monkeypatch):
    cat = tmp_path / "drafters.yaml"
    cat.write_bytes(b"runs:\n  v5: {dir: v5}\n# \xff\xfe\n")
    monkeypatch.delenv("DFLASH_OPS_INVENTORY", raising=False)
    monkeypatch.chdir(tmp_path)
    one_red_line(["ckpts", "--catalog", str(cat)], 2, str(cat), "not UTF-8", "line 3")


@pytest.mark.parametrize("jump, why", [("u@h:notaport", "'notaport' is not a port"),
                                       ("bastion:70000", "port 70000"), ("u@:22", "no host")])
def test_jump_with_a_bad_port_is_refused_by_every_command(tmp_path, jump, why):
    inv = tmp_path / "inventory.yaml"
    inv.write_text(f"hosts:\n  ct129:\n    address: 192.0.2.1\n    jump: '{jump}'\n")
    for args in (["hosts"], ["hosts", "check"]):
        one_red_line(["--inventory", str(inv), *args], 2, str(inv), "host 'ct129'", "field 'jump'", why)


def test_ssh_config_bad_port_names_the_line(tmp_path):
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Host box\n    HostName 192.0.2.1\n    Port abc\n")
    inv = tmp_path / "inventory.yaml"
    inv.write_text("hosts:\n  box:\n    ssh_config: box\n")
    from orchestrator.config.inventory import InventoryError, load_inventory

    with pytest.raises(InventoryError) as e:
        load_inventory(inv, ssh_config_path=cfg)
    msg = str(e.value)
    assert str(inv) in msg and "host 'box'" in msg and "line 3" in msg and "Bad port 'abc'" in msg, msg


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b'{"id": "x"}', b"\xff\xfe",
                                     b'{"id": "r", "shards": "eval"}'])
@pytest.mark.parametrize("command", ["attach", "cancel", "eval --resume"])
def test_corrupt_run_json_is_one_line(tmp_path, content, command):
    run = tmp_path / "runs" / "20261202-210130-v5-ct129"
    run.mkdir(parents=True)
    (run / "run.json").write_bytes(content)
    args = [*command.split(), run.name, "--runs-dir", str(tmp_path / "runs")]
    one_red_line(args, 2, str(run / "run.json"))


def test_step_pattern_with_zero_padding_works_as_documented():
    from orchestrator.config.catalog import load_catalog, parse_catalog, resolve_checkpoint
    from orchestrator.config.paths import shipped
    from remote.sync_host import pattern_regex

    cat = parse_catalog({"runs": {"v6": {"dir": "v6", "pattern": "ckpt-{step:08d}"}}}, Path("drafters.yaml"))
    run = cat.run("v6")
    assert run.folder_for(20000) == "ckpt-00020000" and run.step_of("ckpt-00020000") == 20000
    assert resolve_checkpoint("step20k", run, ["ckpt-00010000", "ckpt-00020000"]) == "ckpt-00020000"
    assert pattern_regex("ckpt-{step:08d}").match("ckpt-00020000").group(1) == "00020000"
    assert "{step:08d}" in shipped("drafters.yaml").read_text()      # the example that documents it
    load_catalog(shipped("drafters.yaml"))
    with pytest.raises(Exception, match="exactly one"):
        parse_catalog({"runs": {"v7": {"pattern": "s{step}-{step:08d}"}}}, Path("drafters.yaml"))


# --- a drafter config.json with fields of the wrong type ------------------------------------------


@pytest.fixture(scope="module")
def drafter_dir(embedded_pair):
    return Path(embedded_pair["drafter"])


def broken_drafter(drafter_dir: Path, tmp_path: Path, path: tuple, value) -> Path:
    d = tmp_path / "drafter"
    shutil.copytree(drafter_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    node = cfg
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("path, value", [
    (("block_size",), [8]), (("block_size",), "eight"), (("vocab_size",), "256"),
    (("dflash_config",), [1]), (("dflash_config", "mask_token_id"), "x"),
    (("dflash_config", "target_layer_ids"), "0,1"), (("dflash_config", "target_layer_ids"), [0, "one"]),
    (("architectures",), "DFlashDraftModel"), (("num_target_layers",), {"n": 4}),
    (("dflash_config", "output_multiplier"), "big"),
])
def test_drafter_config_with_a_wrong_type_names_the_file_and_field(drafter_dir, tmp_path, path, value):
    from remote.inspect import inspect

    d = broken_drafter(drafter_dir, tmp_path, path, value)
    report = inspect(str(d))
    assert not report["ok"]
    (problem,) = report["problems"]
    assert str(d / "config.json") in problem and repr(path[-1]) in problem, problem


@pytest.mark.worker
def test_inspect_command_prints_the_config_problem_in_one_line(drafter_dir, tmp_path):
    import subprocess

    d = broken_drafter(drafter_dir, tmp_path, ("dflash_config", "mask_token_id"), "x")
    res = subprocess.run([sys.executable, "-m", "remote.inspect", str(d)], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip() == f"error     {d / 'config.json'}: field 'mask_token_id' in dflash_config must be " \
                                 f"an integer, got \"x\""
