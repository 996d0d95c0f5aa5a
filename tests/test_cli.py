"""Conventions every command follows: --version, shell completion, --json, one red line and the
documented exit code for each kind of failure (README, "Exit codes")."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestrator.cli import app
from fakeruns import make_run, read_rows
from reportchecks import recompute
from clirun import invoke

pytestmark = pytest.mark.timeout(120)


def test_version_and_completion():
    from importlib.metadata import version

    res = invoke("--version")
    assert res.exit_code == 0 and res.output.strip() == f"dflash-ops {version('dflash-ops')}"
    assert "--install-completion" in invoke("--help").output
    # the completion script is for the shell the command runs under (shellingham reads the process
    # tree), so it is asked for from a bash (one that does not exec the command: a second statement),
    # whatever started the tests
    script = Path(sys.executable).with_name("dflash-ops")           # the installed command
    proc = subprocess.run(["bash", "-c", '"$0" --show-completion; exit $?', str(script)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "complete -o default -F _dflash_ops_completion dflash-ops" in proc.stdout, proc.stderr


def test_show_json(tmp_path):
    runs = tmp_path / "runs"
    make_run(runs, "20261202-2041-v5-step20k-ct129", "v5", "step20k", prompts=7)
    res = invoke("show", "v5:step20k", "--runs-dir", str(runs), "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    want = recompute(read_rows(runs / "20261202-2041-v5-step20k-ct129"))
    assert data["id"] == "20261202-2041-v5-step20k-ct129" and data["run"]["checkpoint"] == "step20k"
    assert data["metrics"]["tau_macro"] == pytest.approx(want["tau_macro"]) and not data["warnings"]
    assert data["report"]["html"].endswith("report.html")


def test_hosts_json_and_hosts_check_json(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                       # no ./inventory.yaml: only the built-in host
    monkeypatch.delenv("DFLASH_OPS_INVENTORY", raising=False)
    res = invoke("hosts", "--json")
    assert res.exit_code == 0 and [h["name"] for h in json.loads(res.stdout)["hosts"]] == ["local"]
    res = invoke("hosts", "check", "local", "--json")
    assert res.exit_code == 0, res.output
    (report,) = json.loads(res.stdout)
    assert report["name"] == "local" and report["ok"] and report["torch"]
    import transformers
    assert report["transformers"] == f"{transformers.__version__} (tested)"   # CI installs a tested version


@pytest.mark.parametrize("args, code, message", [
    (["eval", "--mode", "sideways"], 2, "--mode must be one of offline, online"),
    (["eval", "--engine", "--mode", "offline"], 2, "--engine decodes online"),
    (["attach", "no-such-run"], 2, "no run matches 'no-such-run'"),
    (["show", "nope"], 2, "no run matches 'nope'"),
    (["hosts", "check", "nohost"], 2, "unknown host 'nohost'"),
    (["eval", "--host", "nohost"], 2, "unknown host 'nohost'"),
])
def test_errors_are_one_red_line_with_the_documented_code(tmp_path, args, code, message):
    res = CliRunner().invoke(app, [*args, *(["--runs-dir", str(tmp_path)] if args[0] in ("attach", "show") else [])])
    assert res.exit_code == code, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res.stderr
    assert "Traceback" not in res.output
