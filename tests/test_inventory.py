"""Inventory loading and validation: every bad case names the file, the host and the field."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestrator.cli import app
from orchestrator.config.inventory import InventoryError, load_inventory
from orchestrator.transport import runner_for

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "orchestrator" / "config" / "inventory.yaml"   # the example `dflash-ops init` copies


def write(tmp_path: Path, text: str, name: str = "inventory.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def error_of(path: Path, **kw) -> str:
    with pytest.raises(InventoryError) as e:
        load_inventory(path, **kw)
    return str(e.value)


def test_repo_inventory_describes_the_story():
    inv = load_inventory(EXAMPLE)
    ct200, ct129 = inv.get("ct200"), inv.get("ct129")
    assert ct200.roles == ("train",) and ct200.gpus == 8 and ct200.checkpoints == "/data/dflash/checkpoints"
    assert ct129.roles == ("eval",) and ct129.sglang == "http://127.0.0.1:30000" and ct129.gpus == 1
    assert [h.name for h in inv.with_role("eval")] == ["local", "ct129"]
    assert inv.get("local").is_local


def test_builtin_local_without_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DFLASH_OPS_INVENTORY", raising=False)
    monkeypatch.setenv("DFLASH_OPS_HOME", str(tmp_path / "home"))
    inv = load_inventory()
    assert inv.names() == ["local"] and inv.path is None
    local = inv.get("local")
    assert local.is_local and local.python == sys.executable and set(local.roles) == {"train", "eval"}
    assert local.workdir == str(tmp_path / "home")


def test_resolution_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "hosts: {cwdhost: {address: a}}\n")
    env = write(tmp_path, "hosts: {envhost: {address: b}}\n", "env.yaml")
    explicit = write(tmp_path, "hosts: {explicit: {address: c}}\n", "explicit.yaml")
    monkeypatch.delenv("DFLASH_OPS_INVENTORY", raising=False)
    assert "cwdhost" in load_inventory().names()
    monkeypatch.setenv("DFLASH_OPS_INVENTORY", str(env))
    assert "envhost" in load_inventory().names()
    assert load_inventory(explicit).names() == ["local", "explicit"]


def test_local_can_be_overridden(tmp_path):
    inv = load_inventory(write(tmp_path, "hosts:\n  local: {gpus: 0, workdir: /w}\n"))
    local = inv.get("local")
    assert local.is_local and local.gpus == 0 and local.workdir == "/w" and local.python == sys.executable


def test_unknown_field_with_did_you_mean(tmp_path):
    p = write(tmp_path, "hosts:\n  ct200:\n    adress: 10.0.0.200\n")
    msg = error_of(p)
    assert str(p) in msg and "host 'ct200'" in msg and "unknown field 'adress'" in msg
    assert "did you mean 'address'" in msg


def test_missing_address(tmp_path):
    p = write(tmp_path, "hosts:\n  ct129:\n    roles: [eval]\n")
    msg = error_of(p)
    assert str(p) in msg and "host 'ct129'" in msg and "missing field 'address'" in msg


@pytest.mark.parametrize("field, value, expect", [
    ("port", "'22x'", "field 'port' must be an integer"),
    ("port", "true", "field 'port' must be an integer"),
    ("port", "70000", "field 'port' must be between 1 and 65535"),
    ("roles", "train", "field 'roles' must be a list"),
    ("gpus", "two", "field 'gpus' must be an integer"),
    ("trust_host_key", "'yes please'", "field 'trust_host_key' must be true or false"),
    ("python", "[a, b]", "field 'python' must be a string"),
])
def test_wrong_type(tmp_path, field, value, expect):
    p = write(tmp_path, f"hosts:\n  ct200:\n    address: 10.0.0.200\n    {field}: {value}\n")
    msg = error_of(p)
    assert str(p) in msg and "host 'ct200'" in msg and expect in msg


def test_unknown_role(tmp_path):
    p = write(tmp_path, "hosts:\n  ct200:\n    address: h\n    roles: [trian]\n")
    msg = error_of(p)
    assert str(p) in msg and "host 'ct200'" in msg and "field 'roles'" in msg
    assert "unknown role 'trian'" in msg and "did you mean 'train'" in msg


def test_duplicate_host(tmp_path):
    p = write(tmp_path, """\
        hosts:
          ct200:
            address: 10.0.0.200
          ct129:
            address: 10.0.0.129
          ct200:
            address: 10.0.0.201
        """)
    msg = error_of(p)
    assert str(p) in msg and "line 6" in msg and "duplicate host 'ct200'" in msg and "line 2" in msg


def test_duplicate_field(tmp_path):
    p = write(tmp_path, "hosts:\n  ct200:\n    address: a\n    port: 22\n    port: 2222\n")
    msg = error_of(p)
    assert str(p) in msg and "host 'ct200'" in msg and "duplicate field 'port'" in msg and "line 5" in msg


def test_yaml_syntax_error_has_the_line(tmp_path):
    p = write(tmp_path, "hosts:\n  ct200:\n    address: [10.0.0.200\n    port: 22\n")
    msg = error_of(p)
    assert str(p) in msg and "invalid YAML" in msg and "line " in msg


def test_bad_top_level(tmp_path):
    assert "unknown top-level key 'host'" in error_of(write(tmp_path, "host: {}\n"))
    assert "did you mean 'hosts'" in error_of(write(tmp_path, "host: {}\n"))
    assert "must be a mapping" in error_of(write(tmp_path, "- a\n- b\n"))
    assert "inventory file not found" in error_of(tmp_path / "nope.yaml")


def test_unknown_host_did_you_mean(tmp_path):
    inv = load_inventory(EXAMPLE)
    with pytest.raises(InventoryError, match=r"unknown host 'ct20'.*did you mean 'ct200'"):
        inv.get("ct20")


def test_cli_bad_inventory_is_one_clean_red_line(tmp_path):
    p = write(tmp_path, "hosts:\n  ct200:\n    adress: 10.0.0.200\n")
    res = CliRunner().invoke(app, ["--inventory", str(p), "hosts"])
    assert res.exit_code == 2
    assert "unknown field 'adress'" in res.output and "Traceback" not in res.output
    # and as a real process, with stderr/exit code as the user sees them
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "--inventory", str(p), "hosts"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(p) in lines[0] and "host 'ct200'" in lines[0]


def test_cli_unknown_host_on_command_line(tmp_path):
    res = CliRunner().invoke(app, ["--inventory", str(EXAMPLE), "hosts", "check", "ct20"])
    assert res.exit_code == 2
    assert "unknown host 'ct20'" in res.output and "did you mean 'ct200'" in res.output
    assert "Traceback" not in res.output


SSH_CONFIG = """\
Host trainbox
    HostName {address}
    Port {port}
    User {user}
    IdentityFile {identity}
    ProxyJump jumpy
"""


def test_ssh_config_alias(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "config").write_text(
        SSH_CONFIG.format(address="192.0.2.7", port=2200, user="ops", identity="~/.ssh/k"))
    p = write(tmp_path, "hosts:\n  t:\n    ssh_config: trainbox\n    roles: [train]\n"
                        "  u:\n    ssh_config: trainbox\n    port: 2201\n")
    inv = load_inventory(p)
    t = inv.get("t")
    assert (t.address, t.port, t.user, t.jump) == ("192.0.2.7", 2200, "ops", "jumpy")
    assert t.identity == str(tmp_path / ".ssh" / "k")
    assert inv.get("u").port == 2201  # inventory fields win over ~/.ssh/config
    unknown = load_inventory(write(tmp_path, "hosts: {v: {ssh_config: plainname}}\n"))
    assert unknown.get("v").address == "plainname"  # like ssh: an unknown alias is the host name


def test_ssh_config_alias_connects(ssh_lab, tmp_path):
    h = ssh_lab.train
    cfg = tmp_path / "ssh_config"
    cfg.write_text(SSH_CONFIG.format(address=h.address, port=h.port, user=h.user,
                                     identity=ssh_lab.client_key).replace("    ProxyJump jumpy\n", ""))
    p = write(tmp_path, f"hosts:\n  trainbox:\n    ssh_config: trainbox\n    known_hosts: {ssh_lab.known_hosts}\n")
    host = load_inventory(p, ssh_config_path=cfg).get("trainbox")
    with runner_for(host) as r:
        assert r.run(["echo", "via-alias"]).stdout == "via-alias\n"


def test_user_config_dir_and_xdg_cache(tmp_path, monkeypatch):
    """After the flag, the env var and ./inventory.yaml comes $XDG_CONFIG_HOME/dflash-ops/; the
    built-in local host lives in $XDG_CACHE_HOME/dflash-ops/local unless $DFLASH_OPS_HOME says."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DFLASH_OPS_INVENTORY", raising=False)
    monkeypatch.delenv("DFLASH_OPS_HOME", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert load_inventory().path is None
    user = tmp_path / "config" / "dflash-ops" / "inventory.yaml"
    user.parent.mkdir(parents=True)
    user.write_text("hosts: {userhost: {address: u}}\n")
    inv = load_inventory()
    assert inv.path == user and "userhost" in inv.names()
    assert inv.get("local").workdir == str(tmp_path / "cache" / "dflash-ops" / "local")
    write(tmp_path, "hosts: {cwdhost: {address: a}}\n")
    assert "cwdhost" in load_inventory().names()            # the current directory comes first
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the spec: relative paths are ignored
    assert load_inventory().get("local").workdir == str(Path("~/.cache/dflash-ops/local").expanduser())


def test_engine_field(tmp_path):
    p = write(tmp_path, """\
        hosts:
          ev:
            address: h
            engine: {kind: vllm, python: ~/vllm-venv/bin/python, args: [--enforce-eager]}
          sg:
            address: g
            engine: {kind: sglang, url: "http://127.0.0.1:30000/"}
        """)
    inv = load_inventory(p)
    ev, sg = inv.get("ev"), inv.get("sg")
    assert ev.engine.worker_args() == ["--engine-kind", "vllm", "--engine-python", "~/vllm-venv/bin/python",
                                       "--engine-arg=--enforce-eager"]
    assert ev.on_host(lambda path: path and path.replace("~", "/home/u")).engine.python == "/home/u/vllm-venv/bin/python"
    assert sg.engine.worker_args() == ["--engine-kind", "sglang", "--engine-url", "http://127.0.0.1:30000"]
    assert sg.to_dict()["engine"] == {"kind": "sglang", "url": "http://127.0.0.1:30000"}
    assert inv.get("local").engine is None


@pytest.mark.parametrize("engine, expect", [
    ("{kind: tgi, python: /p}", "'kind' must be one of vllm, sglang, got 'tgi'"),
    ("{kind: vllm}", "give exactly one of 'python'"),
    ("{kind: vllm, python: /p, url: 'http://h:1'}", "give exactly one of 'python'"),
    ("{kind: vllm, pyhton: /p}", "unknown key 'pyhton' (did you mean 'python'?)"),
    ("{kind: vllm, url: 'ftp://h:1'}", "'url' must be http(s)://HOST:PORT"),
    ("{kind: vllm, url: 'http://u:secret@h:1'}", "'url' holds credentials"),
    ("{kind: vllm, url: 'http://h:1', args: [--x]}", "'args' are for servers dflash-ops starts"),
    ("{kind: vllm, python: /p, args: --x}", "'args' must be a list of strings"),
    ("vllm", "field 'engine' must be a mapping"),
])
def test_bad_engine_field(tmp_path, engine, expect):
    p = write(tmp_path, f"hosts:\n  ev:\n    address: h\n    engine: {engine}\n")
    msg = error_of(p)
    assert str(p) in msg and "host 'ev'" in msg and expect in msg, msg
    assert "secret" not in msg


def test_engine_on_a_ray_cluster_is_refused(tmp_path):
    p = write(tmp_path, "hosts:\n  rc:\n    kind: ray\n    address: ray://h:10001\n"
                        "    engine: {kind: vllm, python: /p}\n")
    assert "a Ray cluster's eval runs without a serving engine" in error_of(p)


@pytest.mark.parametrize("name, text, words", [
    ("inventory.yaml", "hosts: " + "[" * 5000 + "]" * 5000, "the inventory nests more than 32 levels deep"),
    ("configs/drafters.yaml", "drafters:\n  a: " + "{x: " * 40 + "1" + "}" * 40,
     "the catalog nests more than 32 levels deep"),
])
def test_a_deeply_nested_config_is_one_line(tmp_path, monkeypatch, name, text, words):
    """PyYAML's composer recurses per level: a deep document is refused by its parser's events first,
    naming the file and line (no RecursionError traceback), by the commands that read it."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "inventory.yaml").write_text("hosts: {}\n")
    (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    for command in (["hosts"], ["config"]):
        res = CliRunner().invoke(app, ["--inventory", "inventory.yaml", *command])
        if name == "inventory.yaml" or command == ["config"]:
            assert res.exit_code == 2, res.output
            lines = res.output.strip().splitlines()
            assert len(lines) == 1 and words in lines[0] and "line " in lines[0], res.output
