"""Shared fixtures: one session-scoped lab of real sshd hosts per test process (tests/sshlab.py),
the embedded demo pair from the shared build cache (tests/buildcache.py), and the marks that say
what a test needs (pyproject's markers): ``lab``, ``models`` and ``worker`` added here by the
fixtures a test uses (a test's body that needs them carries the mark itself), and ``quick`` on every
test that has none of lab, models, worker, engine or gpu: ``python -m pytest -m quick``."""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the one import path of test helpers: `import sshlab`

# One intra-op thread for torch here and in every worker the tests start (inherited; the SSH lab's
# sshd sets it for its sessions): the two test processes already fill both cores, and the tiny
# models run several times faster on one thread than on two fought over (benchmarks/bench_threads.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Ctrl-C reaches the commands the tests start as it would in a terminal: a suite started in the
# background of a non-interactive shell (a CI runner, `nohup ... &`) inherits SIGINT ignored, every
# command it starts would too (an ignored signal survives exec), and the tests that press Ctrl-C
# (test_sync, test_sync_tunnel, test_watch, test_clean) would see it ignored, on some machines only.
signal.signal(signal.SIGINT, signal.default_int_handler)


# The files of the longest tests first (whole evals, clusters, the tour), so that the two worker
# processes end together rather than one starting the tour last; pyproject's addopts keep this order
# (--no-loadscope-reorder).
LONGEST_FIRST = ("test_slurm.py", "test_tour.py", "test_ray.py", "test_watch.py", "test_variants_e2e.py", "test_faults_eval.py",
                 "test_eval.py", "test_gpus.py", "test_online.py", "test_exactness.py", "test_faults_remote.py",
                 "test_secrets.py", "test_conformance.py", "test_specforge_ref.py", "test_worker.py", "test_sync.py",
                 "test_hostile_sync.py", "test_hostile_inputs.py", "test_specforge_parity.py", "test_ddtree_ref.py",
                 "test_tree_hybrid.py", "test_sync_tunnel.py")


def pytest_runtest_setup(item):
    """Fail a grouped test that pytest-xdist's loadgroup did not group: the grouped tests share
    servers, clusters and /tmp names, and run into each other from two processes (pytest 9.2 keeps the
    id where pytest-xdist 3.8 appends the group)."""
    if (getattr(item.config.option, "loadgroup", False) and item.get_closest_marker("xdist_group")
            and "@" not in item.nodeid):
        pytest.fail("--dist loadgroup did not group this test: this pytest-xdist does not work with this "
                    "pytest (pyproject's test extra pins pytest<9.2)", pytrace=False)


# The marks a fixture gives every test that uses it, directly or through another fixture (eval_lab
# and local_home use embedded_pair; eval_lab uses ssh_lab). A fixture that builds or loads a model or
# starts a worker belongs here; what only a test's body does is marked in its file.
FIXTURE_MARKS = {
    "ssh_lab": ("lab",),                # the SSH lab's sshd hosts
    "embedded_pair": ("models",),       # the embedded demo pair (built once into the build cache)
    "eval_lab": ("worker",),            # the lab hosts set up for `dflash-ops eval` (clirun.lab_cli)
    "local_home": ("worker",),          # a workdir for evals on the built-in `local` host
}
# what keeps a test out of the quick loop (`-m quick`): the SSH lab, a model, a worker process, a real
# serving engine, a GPU
NOT_QUICK = ("lab", "models", "worker", "engine", "gpu")


@pytest.hookimpl(tryfirst=True)     # before pytest deselects by -m
def pytest_collection_modifyitems(config, items):
    for item in items:
        marks = {m for f in item.fixturenames for m in FIXTURE_MARKS.get(f, ())}
        for mark in sorted(marks):
            item.add_marker(mark)
        if not any(item.get_closest_marker(m) for m in NOT_QUICK):
            item.add_marker(pytest.mark.quick)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
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
def embedded_pair():
    """The embedded demo target (tiny hybrid Qwen3.5 + tokenizer) and its trained drafter, built with
    the product's own builder once for all test processes and sessions (tests/buildcache.py):
    ``{"target": dir, "drafter": dir}``; read only. DFLASH_OPS_TEST_EMBEDDED=DIR uses (or builds)
    the pair in DIR instead."""
    import buildcache
    from remote.embedded import RECIPE, ensure

    reuse = os.environ.get("DFLASH_OPS_TEST_EMBEDDED")
    if reuse:
        return ensure(Path(reuse))
    return ensure(buildcache.built("embedded", RECIPE, lambda out: ensure(out / "pair")) / "pair")


@pytest.fixture(scope="module")
def eval_lab(ssh_lab, embedded_pair, tmp_path_factory):
    """Both lab hosts get the embedded pair in their workdir, a synced-looking run `v9` with
    checkpoint step_100 (a copy of the drafter) and a catalog that names them (clirun.lab_cli runs
    the CLI with them)."""
    import shutil

    import yaml

    base = tmp_path_factory.mktemp("eval")
    pair = Path(embedded_pair["target"]).parent
    for h in ssh_lab.hosts.values():
        shutil.copytree(pair, h.root / "workdir" / "embedded", dirs_exist_ok=True)
        ckpt = h.root / "checkpoints" / "v9" / "step_100"
        shutil.copytree(pair / "drafter", ckpt, dirs_exist_ok=True)
    catalog = base / "drafters.yaml"
    catalog.write_text(yaml.safe_dump({
        "runs": {"v9": {"dir": "v9", "pattern": "step_{step}"}},
        "drafters": {"v9": {"run": "v9", "format": "zlab", "target": "tiny"},
                     "demo": {"path": str(ssh_lab.eval.root / "workdir" / "embedded" / "drafter"),
                              "format": "zlab", "target": "tiny"}},
        "targets": {"tiny": {"path": str(ssh_lab.eval.root / "workdir" / "embedded" / "target")}}}))
    inventory = ssh_lab.write_inventory(base / "inventory.yaml", train={"roles": ["train", "eval"]})
    nopython = ssh_lab.write_inventory(base / "no-torch.yaml", eval={"python": "/usr/bin/python3"})
    return {"base": base, "catalog": catalog, "inventory": inventory, "no_torch": nopython, "lab": ssh_lab,
            "pair": pair}


@pytest.fixture(scope="module")
def local_home(embedded_pair, tmp_path_factory):
    """A workdir for the built-in `local` host ($DFLASH_OPS_HOME) with the embedded pair in it."""
    import shutil

    home = tmp_path_factory.mktemp("home")
    shutil.copytree(Path(embedded_pair["target"]).parent, home / "embedded")
    return home


def pytest_terminal_summary(terminalreporter):
    from faulttable import print_tables

    print_tables(terminalreporter)
