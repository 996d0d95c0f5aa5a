"""A host's `python` for tests: a two-line script that execs the interpreter running the tests.

A wrapper, not a symlink: a symlink to a virtual environment's python loses the environment (Python
finds ``pyvenv.cfg`` beside the path it was started by), and the host then has no torch.
``plant`` puts a folder of tests/plants/ first on its PYTHONPATH (tests/plants/README.md)."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

PLANTS = Path(__file__).parent / "plants"


def host_python(path: Path, plant: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    env = f'PYTHONPATH={shlex.quote(str(PLANTS / plant))}"${{PYTHONPATH:+:$PYTHONPATH}}" ' if plant else ""
    path.write_text(f'#!/bin/sh\n{env}exec {shlex.quote(sys.executable)} "$@"\n')
    path.chmod(0o755)
    return path
