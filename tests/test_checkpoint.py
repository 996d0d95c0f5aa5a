"""Checkpoint formats round-trip; bad checkpoints and mismatched targets fail with named causes."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from remote.drafters.checkpoint import CheckpointError, load_drafter, open_checkpoint, save_drafter
from remote.drafters.compat import IncompatibleError, check_compatible, read_target_config
from remote.drafters.dflash import block_input_ids
from remote.drafters.config import SLIDING
from remote.inspect import inspect
from remote.drafters.tiny import tiny_drafter, tiny_drafter_config
from models import random_target

pytestmark = pytest.mark.models      # every test builds a tiny target or drafter
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def target():
    return random_target("qwen3")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, target):
    d = tmp_path_factory.mktemp("target")
    target.config.save_pretrained(d)
    return d


@pytest.fixture
def drafter(target):
    cfg = tiny_drafter_config(target, layers=2, block_size=8, sliding=True, sliding_window=6)
    return tiny_drafter(cfg, seed=3)


@torch.no_grad()
def outputs(model, target):
    g = torch.Generator().manual_seed(0)
    th = torch.randn(1, 10, model.fc.in_features, generator=g)
    anchors = torch.tensor([[0, 4, 9]])
    ids = torch.randint(0, 200, (1, 10), generator=g)
    noise = target.get_input_embeddings()(block_input_ids(ids[0, anchors[0]], model.block_size,
                                                          model.config.mask_token_id))[None]
    return model.forward_anchors(th, noise, anchors)


@pytest.mark.parametrize("fmt,prefix,file_name", [
    ("zlab", "", None),
    ("state_dict", "module.", "drafter.pt"),
    ("state_dict", "model.", "step_200.safetensors"),
    ("state_dict", "_orig_mod.module.", "ckpt.bin"),
])
def test_round_trip_identical_outputs(tmp_path, drafter, target, fmt, prefix, file_name):
    save_drafter(drafter, tmp_path, fmt=fmt, prefix=prefix, file_name=file_name)
    loaded, ckpt = load_drafter(tmp_path)
    assert ckpt.format == fmt
    assert ckpt.config == drafter.config
    torch.testing.assert_close(outputs(loaded, target), outputs(drafter, target), atol=0, rtol=0)


def test_zlab_block_size_inside_dflash_config(tmp_path, drafter):
    save_drafter(drafter, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["dflash_config"]["block_size"] = raw.pop("block_size")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert open_checkpoint(tmp_path).config.block_size == drafter.config.block_size


def _edit_config(folder, **changes):
    raw = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if k in ("mask_token_id", "target_layer_ids", "block_size_inner"):
            raw["dflash_config"][k.replace("_inner", "")] = v
        elif v is None:
            raw.pop(k, None)
        else:
            raw[k] = v
    (folder / "config.json").write_text(json.dumps(raw))


def test_fc_fed_fewer_layers_than_listed_is_named(tmp_path, target, target_dir):
    """The story's bug in miniature: the fc was trained on 2 layers' features, the config lists 3."""
    save_drafter(tiny_drafter(tiny_drafter_config(target, target_layer_ids=[0, 2])), tmp_path)
    _edit_config(tmp_path, target_layer_ids=[0, 1, 2])
    report = inspect(str(tmp_path), str(target_dir))
    assert not report["ok"]
    assert any("fc input width 128 = 2 x target hidden 64, but target_layer_ids lists 3 layers" in p
               and "4 of 5 layers" in p for p in report["problems"])
    with pytest.raises(CheckpointError, match="fc.weight takes 128 inputs = 2 x 64, but target_layer_ids lists 3"):
        load_drafter(tmp_path)


@pytest.mark.parametrize("change,message", [
    ({"target_layer_ids": [0, 1, 9]}, "target layer id 9 is out of range for a 4-layer target"),
    ({"target_layer_ids": [0, 1, 3]}, "target layer id 3 is the target's last layer"),
    ({"mask_token_id": 256}, "mask_token_id 256 is outside the target's embedding rows (0..255)"),
    ({"vocab_size": 300}, "vocab mismatch: drafter 300, target 256"),
    ({"num_target_layers": 36}, "built for a 36-layer target"),
])
def test_compatibility_errors_name_the_cause(tmp_path, drafter, target_dir, change, message):
    save_drafter(drafter, tmp_path)
    _edit_config(tmp_path, **change)
    ckpt = open_checkpoint(tmp_path)
    with pytest.raises(IncompatibleError) as e:
        check_compatible(ckpt, read_target_config(target_dir))
    assert message in str(e.value)


def test_hidden_size_mismatch(tmp_path, drafter, target_dir):
    save_drafter(drafter, tmp_path)
    raw_target = json.loads((target_dir / "config.json").read_text())
    other = tmp_path / "other_target"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**raw_target, "hidden_size": 128}))
    report = inspect(str(tmp_path), str(other))
    assert any("hidden size mismatch: drafter 64, target 128" in p for p in report["problems"])
    assert any("fc input width" in p for p in report["problems"])  # the fc no longer fits either


def test_block_size_mismatch(tmp_path, drafter, target_dir):
    save_drafter(drafter, tmp_path)
    with pytest.raises(IncompatibleError, match="block size mismatch: requested 16, drafter was trained with 8"):
        check_compatible(open_checkpoint(tmp_path), read_target_config(target_dir), block_size=16)
    _edit_config(tmp_path, block_size_inner=16)
    with pytest.raises(CheckpointError, match="block size mismatch: block_size=8 at the top level but "
                                              "dflash_config.block_size=16"):
        open_checkpoint(tmp_path)


def test_vlm_target_config_is_read_through_text_config(tmp_path, target_dir):
    raw = json.loads((target_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": raw}))
    info = read_target_config(tmp_path)
    assert (info.hidden_size, info.num_hidden_layers, info.vocab_size) == (64, 4, 256)


def test_missing_unexpected_and_misshaped_tensors(tmp_path, drafter):
    save_drafter(drafter, tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    sd.pop("layers.1.mlp.up_proj.weight")
    sd["layers.0.self_attn.extra.weight"] = torch.zeros(2)
    sd["norm.weight"] = torch.ones(65)
    sd["lm_head.weight"] = torch.zeros(256, 64)           # the target's, saved alongside: ignored
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        load_drafter(tmp_path)
    msg = str(e.value)
    assert "missing tensors (1): layers.1.mlp.up_proj.weight" in msg
    assert "unexpected tensors (1): layers.0.self_attn.extra.weight" in msg
    assert "mis-shaped tensors (1): norm.weight: (65,) (expected (64,))" in msg


def test_missing_target_layer_ids_is_an_error_not_a_guess(tmp_path, drafter):
    save_drafter(drafter, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["dflash_config"]["target_layer_ids"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="missing target_layer_ids .*usually not what"):
        open_checkpoint(tmp_path)


def test_incomplete_transfer_and_missing_folder(tmp_path, drafter):
    save_drafter(drafter, tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "model.safetensors.part")
    with pytest.raises(CheckpointError, match=r"incomplete transfer: \['model.safetensors.part'\]"):
        open_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="drafter not found"):
        open_checkpoint(tmp_path / "nope")


@pytest.mark.worker
def test_inspect_cli(tmp_path, drafter, target_dir):
    save_drafter(drafter, tmp_path / "d")
    run = lambda *a: subprocess.run([sys.executable, "-m", "remote.inspect", *a],  # noqa: E731
                                    cwd=REPO, capture_output=True, text=True, timeout=120)
    ok = run(str(tmp_path / "d"), "--target", str(target_dir))
    assert ok.returncode == 0, ok.stderr
    assert "format    zlab" in ok.stdout and "verdict   compatible" in ok.stdout
    assert f"{drafter.config.target_layer_ids}" in ok.stdout and SLIDING in ok.stdout
    assert "variant   dflash   mask rule zlab   drafts per block 7" in ok.stdout
    assert "layer 0   sliding_attention: causal, window 6 from the query" in ok.stdout
    assert "layer 1   full_attention: bidirectional" in ok.stdout
    bad = run(str(tmp_path / "d"), "--target", str(target_dir), "--block-size", "16", "--json")
    assert bad.returncode == 1
    report = json.loads(bad.stdout)
    assert report["ok"] is False and "block size mismatch" in report["problems"][0]
