"""Shared fixtures: one session-scoped lab of real sshd hosts (see tests/sshlab.py)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # so tests can `import sshlab`


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch  # lazily: most runs never need it

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is false)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def no_user_config(tmp_path_factory):
    """The tester's own ~/.config/dflash-ops/ must not leak into the tests (or their subprocesses)."""
    old = os.environ.get("XDG_CONFIG_HOME")
    os.environ["XDG_CONFIG_HOME"] = str(tmp_path_factory.mktemp("xdg-config"))
    yield
    if old is None:
        os.environ.pop("XDG_CONFIG_HOME", None)
    else:
        os.environ["XDG_CONFIG_HOME"] = old


@pytest.fixture(scope="session")
def ssh_lab(tmp_path_factory):
    """Real OpenSSH hosts `train` and `eval` (network namespaces, or loopback fallback)."""
    import sshlab

    try:
        lab = sshlab.start_lab(tmp_path_factory.mktemp("lab"))
    except sshlab.LabError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"cannot start the SSH lab: {e}")
    yield lab
    lab.close()


@pytest.fixture
def lab_inventory(ssh_lab, tmp_path):
    """An inventory.yaml for the lab hosts (plus the built-in `local`)."""
    return ssh_lab.write_inventory(tmp_path / "inventory.yaml")


@pytest.fixture(scope="session")
def embedded_pair(tmp_path_factory):
    """The embedded demo target (tiny hybrid Qwen3.5 + tokenizer) and its trained drafter, built
    once per test session with the product's own builder: ``{"target": dir, "drafter": dir}``.
    Set DFLASH_OPS_TEST_EMBEDDED=DIR to reuse a pair built earlier (same recipe) while iterating."""
    from remote.embedded import ensure

    reuse = os.environ.get("DFLASH_OPS_TEST_EMBEDDED")
    out = Path(reuse) if reuse else tmp_path_factory.mktemp("embedded") / "pair"
    return ensure(out)


@pytest.fixture(scope="module")
def local_home(embedded_pair, tmp_path_factory):
    """A workdir for the built-in `local` host ($DFLASH_OPS_HOME) with the embedded pair in it."""
    import shutil

    home = tmp_path_factory.mktemp("home")
    shutil.copytree(Path(embedded_pair["target"]).parent, home / "embedded")
    return home
