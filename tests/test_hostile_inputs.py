"""Hostile checkpoint folders and suites through the worker's entry points, each run as dflash-ops
runs it on a host (``python -m remote.inspect|export|preflight``, a subprocess): a FIFO or a link
to /dev/zero in a folder, NaN, a negative epsilon and an infinite RoPE base in a config, an unknown
activation, a config nested 100,000 deep, a target asking for its own Python code (and a "y" on
stdin), prompt ids outside the target's vocabulary, and `.` as the export's source.

The property, for every case and every entry point that reads it: the process ends (no hang); its
output holds no traceback; it answers on stdout with its JSON and nothing else; the refusal is one
line that names what is wrong; nothing changed outside the folders it was told to write (no code of
the folder ran: it would have left a file); and its exit status is 0, 2, or the status the entry
point documents for a refused input, kept as documented: ``inspect`` and ``preflight`` exit 1 when
a check fails (their docstrings), ``export`` exits 1 for a checkpoint it refuses or cannot read and
2 for a destination it must not write (docs/export.md)."""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.worker
REPO = Path(__file__).resolve().parents[1]
REFUSED = {"inspect": 1, "preflight": 1, "export": 1}     # each entry point's documented status for a refusal


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` as it is (links not followed, special files not opened)."""
    out = {}
    for top, dirs, names in os.walk(root):
        for name in dirs + names:
            path = Path(top, name)
            st = path.lstat()
            if stat.S_ISREG(st.st_mode):
                out[str(path.relative_to(root))] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
            elif stat.S_ISLNK(st.st_mode):
                out[str(path.relative_to(root))] = ("link", os.readlink(path))
            else:
                out[str(path.relative_to(root))] = (stat.S_IFMT(st.st_mode),)
    return out


def edit_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


def fifo(case: Path) -> None:
    os.mkfifo(case / "drafter" / "notes")


def dev_zero(case: Path) -> None:
    (case / "drafter" / "model.safetensors").unlink()
    (case / "drafter" / "model.bin").symlink_to("/dev/zero")


def nan_scale(case: Path) -> None:
    edit_config(case / "drafter", lambda c: c["dflash_config"].update(input_embedding_scale=math.nan))


def negative_eps(case: Path) -> None:
    edit_config(case / "drafter", lambda c: c.update(rms_norm_eps=-1.0))


def infinite_theta(case: Path) -> None:
    edit_config(case / "drafter", lambda c: c["rope_parameters"].update(rope_theta=math.inf))


def unknown_activation(case: Path) -> None:
    edit_config(case / "drafter", lambda c: c.update(hidden_act="nosuch"))


def deep(case: Path) -> None:
    text = (case / "drafter" / "config.json").read_text().rstrip()[:-1]
    (case / "drafter" / "config.json").write_text(text + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")


def remote_code(case: Path) -> None:
    """A target of a model type transformers does not know, whose auto_map names its own code: the
    code leaves a file beside the case's folders when it runs."""
    edit_config(case / "target", lambda c: c.update(model_type="hostile_remote", auto_map={
        "AutoConfig": "configuration_hostile.HostileConfig", "AutoModelForCausalLM": "modeling_hostile.HostileModel"}))
    (case / "target" / "configuration_hostile.py").write_text(
        f"import pathlib\npathlib.Path({str(case / 'code-ran')!r}).write_text('ran')\n"
        "from transformers import PretrainedConfig\n\n\nclass HostileConfig(PretrainedConfig):\n"
        "    model_type = 'hostile_remote'\n")


def out_of_vocabulary(case: Path) -> None:
    (case / "suite.jsonl").write_text(json.dumps({"id": "oov", "input_ids": [1, 2, 999_999]}) + "\n")


# case -> (how the folders are broken, what the one line names, the entry points that read it)
CASES = {
    "fifo": (fifo, "notes (a FIFO)", ("preflight", "inspect", "export")),
    "dev-zero": (dev_zero, "model.bin -> /dev/zero (a character device)", ("preflight", "inspect", "export")),
    "nan": (nan_scale, "field 'input_embedding_scale' in dflash_config must be a finite number, got NaN",
            ("preflight", "inspect", "export")),
    "negative-eps": (negative_eps, "field 'rms_norm_eps' must be a positive number, got -1.0", ("inspect",)),
    "infinite-theta": (infinite_theta, "field 'rope_theta' in rope_parameters must be a finite number, got Infinity",
                       ("inspect",)),
    "hidden-act": (unknown_activation, "field 'hidden_act' 'nosuch' is not an activation transformers knows",
                   ("inspect", "export")),
    "deep": (deep, "nested deeper than", ("inspect", "export")),
    "auto-map": (remote_code, "auto_map {\"AutoConfig\": \"configuration_hostile.HostileConfig\"",
                 ("preflight", "inspect")),
    "out-of-vocabulary": (out_of_vocabulary, "prompt oov: input_ids holds 999999, outside the target's vocabulary "
                                             "(0..255)", ("preflight",)),
}


def command(entry: str, case: Path) -> tuple[list[str], list[Path]]:
    """The entry point's argv on the case, and the folders it may write."""
    drafter, target = str(case / "drafter"), str(case / "target")
    if entry == "inspect":
        return ["-m", "remote.inspect", drafter, "--target", target, "--json"], []
    if entry == "export":
        return ["-m", "remote.export", drafter, "--to", "speculators"], [case / "drafter.speculators"]
    suite = ["--suite", str(case / "suite.jsonl")] if (case / "suite.jsonl").exists() else []
    return (["-m", "remote.preflight", drafter, "--target", target, "--device", "cpu", "--prompts", "1",
             "--max-new-tokens", "8", "--cache", str(case / "cache"), *suite], [case / "cache"])


def run(args: list[str], case: Path, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_MODULES_CACHE": str(case / "hf-modules")}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, input="y\ny\n", capture_output=True, text=True,
                          timeout=300)


def assert_property(res: subprocess.CompletedProcess, entry: str, allowed: set[int]) -> dict:
    out = res.stdout + res.stderr
    assert "Traceback" not in out, out[-3000:]
    assert res.returncode in allowed, (res.returncode, out[-3000:])
    return json.loads(res.stdout)          # the answer, and nothing else


@pytest.fixture
def case(embedded_pair, tmp_path) -> Path:
    for name in ("drafter", "target"):
        shutil.copytree(embedded_pair[name], tmp_path / name)
    return tmp_path


@pytest.mark.parametrize("name, entry", [(name, entry) for name, (_, _, entries) in CASES.items() for entry in entries])
def test_a_hostile_input_is_one_line_and_changes_nothing(case, name, entry):
    breaks, named, _ = CASES[name]
    breaks(case)
    argv, writes = command(entry, case)
    before = snapshot(case)
    res = run(argv, case)
    answer = assert_property(res, entry, {0, 2, REFUSED[entry]})
    assert res.returncode != 0
    after = snapshot(case)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k)
                     and not any(Path(case, k) == w or w in Path(case, k).parents for w in writes))
    assert not changed, changed
    if entry == "export":
        assert answer["ok"] is False and named in answer["error"], answer
        assert res.stderr.count("\n") == 1 and res.stderr.startswith("error: ") and named in res.stderr, res.stderr
        assert not (case / "drafter.speculators").exists()
    else:
        problems = (answer["inspect"] if entry == "preflight" else answer)["problems"]
        assert [p for p in problems if named in p] and all("\n" not in p for p in problems), problems


def test_export_of_dot_writes_beside_the_folder_it_names(case):
    """`python -m remote.export .` inside the checkpoint: the new folder beside it (it ended in a
    ValueError, `PosixPath('.') has an empty name`, with no JSON line)."""
    before = snapshot(case)
    res = run(["-m", "remote.export", ".", "--to", "speculators"], case, cwd=case / "drafter")
    answer = assert_property(res, "export", {0})
    assert answer["ok"] and answer["out"] == str(case / "drafter.speculators"), answer
    after = snapshot(case)
    assert sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k)) == sorted(
        str(p.relative_to(case)) for p in [case / "drafter.speculators", *(case / "drafter.speculators").iterdir()])
    res = run(["-m", "remote.export", ".", "--to", "speculators", "--out", "..", "--force"], case,
              cwd=case / "drafter")
    answer = assert_property(res, "export", {2})
    assert answer["kind"] == "destination" and f"contains the source {case / 'drafter'}" in answer["error"], answer
    assert snapshot(case) == after
