"""`dflash-ops export` on the SSH lab's hosts (real sshd) and on `local`: the worker shipped,
``python -m remote.export`` run next to the checkpoint, the new folder read back as its source and
loaded by the target format's own class; a refusal is one line naming the field; a write that
fails (a real full file system) leaves nothing behind. The exports' equality with their sources
(draft logits, decoding) is tests/test_export.py's."""
from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import torch

from clirun import invoke, lab_cli
from remote.drafters.checkpoint import open_checkpoint, read_tensors, sha256_file
from remote.drafters.export import NOTE_NAME, behaviour


def one_error_line(res: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.stdout + res.stderr
    return lines[0]


def leftovers(folder: Path, name: str) -> list[str]:
    """What an export to ``folder/name`` may have left: the folder or a hidden temporary of it."""
    return sorted(p.name for p in folder.iterdir() if p.name == name or p.name.startswith(f".{name}."))


def assert_same_drafter(src: Path, dst: Path) -> None:
    """``dst`` reads back as ``src``: the drafter's behaviour and every tensor bit for bit."""
    a, b = open_checkpoint(src), open_checkpoint(dst)
    assert behaviour(a.config) == behaviour(b.config)
    ta, tb = read_tensors(a), read_tensors(b)
    assert set(ta) == set(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and torch.equal(ta[name], tb[name]), name


def speculators_class(folder: Path):
    from speculators import SpeculatorModelConfig
    from speculators.model import SpeculatorModel

    config = SpeculatorModelConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "sdpa"
    return SpeculatorModel.from_pretrained(folder, config=config).eval()


@pytest.fixture
def fresh(eval_lab):
    """A copy of the lab's trained drafter in a folder of its own on the eval host."""
    lab = eval_lab["lab"]
    folder = lab.eval.root / "exports" / uuid.uuid4().hex[:8]
    folder.mkdir(parents=True)
    shutil.copytree(eval_lab["pair"] / "drafter", folder / "drafter")
    return folder / "drafter"


def test_export_of_a_training_checkpoint_on_a_lab_host_reloads_in_the_other_format_and_back(eval_lab):
    lab = eval_lab["lab"]
    run_dir = lab.eval.root / "checkpoints" / "v9"
    src, dst = run_dir / "step_100", run_dir / "step_100.speculators"
    shutil.rmtree(dst, ignore_errors=True)
    res = lab_cli(eval_lab, "export", "v9:step_100", "--to", "speculators", "--host", "eval")
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"✔ v9:step_100 (zlab) → speculators on eval: {dst}" in res.stdout
    assert "dflash-ops eval --host eval --drafter v9:step_100.speculators" in res.stdout
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", NOTE_NAME, "model.safetensors"]
    assert open_checkpoint(dst).format == "speculators"
    assert_same_drafter(src, dst)
    # the catalog's target (a folder on the host) is the verifier: recorded as speculators records it
    target = lab.eval.root / "workdir" / "embedded" / "target"
    assert json.loads((dst / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == \
        str(target.resolve())
    note = json.loads((dst / NOTE_NAME).read_text())
    assert note["source"]["path"] == str(src.resolve()) and note["source"]["format"] == "zlab"
    assert {f["path"]: f["sha256"] for f in note["source"]["files"]} == \
        {p.name: sha256_file(p) for p in src.iterdir()}
    assert {f["path"]: f["sha256"] for f in note["files"]} == \
        {p.name: sha256_file(p) for p in dst.iterdir() if p.name != NOTE_NAME}
    model = speculators_class(dst)             # speculators' own class loads what was written
    assert model.config.aux_hidden_state_layer_ids == [i + 1 for i in open_checkpoint(src).config.target_layer_ids]

    # an existing destination: one line, exit 2, untouched; --force replaces it whole
    before = sha256_file(dst / NOTE_NAME)
    again = lab_cli(eval_lab, "export", "v9:step_100", "--to", "speculators", "--host", "eval")
    assert again.returncode == 2
    assert one_error_line(again) == f"error: host eval: {dst} exists (--force replaces it)"
    assert sha256_file(dst / NOTE_NAME) == before

    # and back, from the exported folder (named as eval names it), as JSON: bit for bit the source
    back = lab_cli(eval_lab, "export", "v9:step_100.speculators", "--to", "zlab", "--host", "eval",
                   "--out", "step_100.round-trip", "--json")
    assert back.returncode == 0, back.stdout + back.stderr
    answer = json.loads(back.stdout)
    assert answer["ok"] and answer["host"] == "eval" and answer["source_format"] == "speculators"
    assert answer["out"] == str(run_dir / "step_100.round-trip")
    assert_same_drafter(src, run_dir / "step_100.round-trip")
    assert leftovers(run_dir, "step_100.round-trip") == ["step_100.round-trip"]


def test_a_refusal_is_one_line_naming_the_field_and_writes_nothing(eval_lab, fresh):
    cfg = json.loads((fresh / "config.json").read_text())
    cfg["dflash_config"]["input_embedding_scale"] = 2.0      # a z-lab knob speculators has no field for
    (fresh / "config.json").write_text(json.dumps(cfg))
    res = lab_cli(eval_lab, "export", str(fresh), "--to", "speculators", "--host", "eval")
    assert res.returncode == 1
    line = one_error_line(res)
    assert line.startswith(f"error: host eval: {fresh}: cannot export to speculators: input_embedding_scale 2.0: "), line
    assert leftovers(fresh.parent, "drafter.speculators") == []
    # a host whose python cannot run the worker: one line that says what to set
    bare = lab_cli(eval_lab, "export", str(fresh), "--to", "speculators", "--host", "eval",
                   inventory=eval_lab["no_torch"])
    assert bare.returncode == 1
    assert "No module named" in one_error_line(bare) and "set `python:` in the inventory" in bare.stderr
    assert leftovers(fresh.parent, "drafter.speculators") == []
    # the same checkpoint exports to its own format (nothing refused there)
    ok = lab_cli(eval_lab, "export", str(fresh), "--to", "zlab", "--host", "eval", "--num-target-layers", "4")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert open_checkpoint(fresh.parent / "drafter.zlab").config.input_embedding_scale == 2.0


def host_mounts(lab, host: str) -> list[str]:
    """The argv prefix that runs a command in the mount namespace the lab host's sshd (and so
    every command run there) sees."""
    h = lab.hosts[host]
    if not h.netns:
        return []
    return ["nsenter", "-t", Path(h.pidfile).read_text().split()[0], "-m"]


def test_a_write_that_fails_on_the_host_leaves_nothing_and_a_rerun_completes(eval_lab, fresh):
    """A real full file system on the host (a 64 KiB tmpfs; the drafter's weights are 340 KiB):
    the export fails with one line, and neither the destination nor its temporary folder remains."""
    there = host_mounts(eval_lab["lab"], "eval")
    full = fresh.parent / "full"
    full.mkdir()
    mounted = subprocess.run([*there, "mount", "-t", "tmpfs", "-o", "size=64k,mode=0777", "tmpfs", str(full)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs on the lab host: {mounted.stderr.strip()}")
    try:
        res = lab_cli(eval_lab, "export", str(fresh), "--to", "speculators", "--host", "eval",
                      "--out", str(full / "out"))
        assert res.returncode == 1, res.stdout + res.stderr
        line = one_error_line(res)      # the worker's own account, naming the file it could not write
        assert line.startswith(f"error: host eval: {full}/.out.export-") and "No space left on device" in line, line
        listed = subprocess.run([*there, "ls", "-A", str(full)], capture_output=True, text=True, check=True)
        assert listed.stdout == ""
    finally:
        subprocess.run([*there, "umount", str(full)], check=True)
    rerun = lab_cli(eval_lab, "export", str(fresh), "--to", "speculators", "--host", "eval",
                    "--out", str(full / "out"))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert_same_drafter(fresh, full / "out")


def test_export_on_local_of_a_relative_folder_and_the_names_it_refuses(eval_lab, tmp_path, monkeypatch):
    src = tmp_path / "drafter"
    shutil.copytree(eval_lab["pair"] / "drafter", src)
    monkeypatch.chdir(tmp_path)         # `./drafter` is this folder's, not the worker's code folder's
    inventory = ["--inventory", str(eval_lab["inventory"])]
    res = invoke(*inventory, "export", "./drafter", "--to", "speculators", "--host", "local")
    assert res.exit_code == 0, res.output
    assert f"✔ ./drafter (zlab) → speculators on local: {tmp_path / 'drafter.speculators'} (config.json, " \
           f"model.safetensors: " in res.output
    assert_same_drafter(src, tmp_path / "drafter.speculators")
    for args, message in (
            (["./drafter", "--to", "zlib"], "error: --to zlib: not a format dflash-ops writes (did you mean 'zlab'?); "
                                          "formats: zlab, speculators, specforge"),
            (["./drafter", "--to", "zlab", "--host", "nowhere"], "error: unknown host 'nowhere'"),
            (["v9:step_999", "--to", "zlab", "--host", "local"], "error: unknown drafter 'v9'")):
        bad = invoke(*inventory, "export", *args)
        assert bad.exit_code == 2, bad.output
        lines = bad.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(message), bad.output


def test_export_of_the_embedded_demo_drafter_takes_its_target_as_verifier(eval_lab, fresh):
    out = fresh.parent / "embedded.speculators"
    res = lab_cli(eval_lab, "export", "embedded", "--to", "speculators", "--host", "eval", "--out", str(out),
                  "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    target = eval_lab["lab"].eval.root / "workdir" / "embedded" / "target"
    assert json.loads(res.stdout)["verifier"] == str(target)
    assert_same_drafter(eval_lab["lab"].eval.root / "workdir" / "embedded" / "drafter", out)
