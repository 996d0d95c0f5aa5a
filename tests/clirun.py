"""The `dflash-ops` command from a test: in this process (``invoke``: typer's CliRunner) or as a
subprocess against the ``eval_lab`` fixture's inventory and catalog (``lab_cli``)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def invoke(*args, env: dict | None = None):
    """The CLI in this process (typer's CliRunner); a traceback in its output fails the test."""
    from typer.testing import CliRunner

    from orchestrator.cli import app

    res = CliRunner().invoke(app, [str(a) for a in args], env=env)
    assert "Traceback" not in res.output, res.output
    return res



def lab_cli(eval_lab: dict, *args, inventory=None, runs=None, popen=False, timeout=600):
    """`dflash-ops` as a subprocess with the ``eval_lab`` fixture's inventory and catalog."""
    env = {**os.environ, "DFLASH_OPS_CATALOG": str(eval_lab["catalog"]),
           "DFLASH_OPS_RUNS": str(runs or eval_lab["base"] / "runs"), "COLUMNS": "160"}
    argv = [sys.executable, "-m", "orchestrator.cli", "--inventory", str(inventory or eval_lab["inventory"]),
            *map(str, args)]
    if popen:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)

