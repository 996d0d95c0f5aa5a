"""Golden export tests: every variant of the golden tests (tests/test_conformance.py), built with the
references' own classes and saved with their own ``save_pretrained``, is exported to the other
format and loaded back with **that format's own class** (z-lab ``DFlashDraftModel`` /
``DFlash2DraftModel.from_pretrained``, speculators' ``SpeculatorModel.from_pretrained``, which fills
the embedding and head from the verifier folder the export recorded): draft logits equal the
source reference's within 1e-4 in fp32; exported again to the source format the checkpoint is the
source's, tensors bit for bit and the config field for field. Variants the target format cannot
express are refused naming the field. Greedy decoding of exported checkpoints is the source's,
cycle for cycle (ours and z-lab's ``dflash_generate``).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from remote.drafters.checkpoint import load_drafter, open_checkpoint, read_tensors, save_drafter
from remote.drafters.export import NOTE_NAME, ExportRefused, export, export_refusals
from remote.decode.online import speculative_generate
from remote.target.model import target_features
from remote.drafters.tiny import tiny_target
from golden import SPECULATORS_VARIANTS, TOL, ZLAB_VARIANTS, ours_logits_per_anchor, prompts, reference_from
from models import freeze, random_drafter, trained_drafter, walk_target
from references import (randomize, speculators_drafter, speculators_logits, zlab_class, zlab_drafter, zlab_generate,
                        zlab_logits)

pytestmark = pytest.mark.models
ROOT = Path(__file__).resolve().parents[1]
# Exportable DFlash2 drafters (the golden DFlash2 variants have sliding layers, which neither format
# can take from the other).
ZLAB_EXTRA = {"dflash2-full": dict(dflash2=True)}
SPECULATORS_EXTRA = {"dflash2-full": dict(dflash2=True)}
# The field each refusal must name; every other variant exports.
ZLAB_TO_SPECULATORS_REFUSED = {
    "sliding-causal": "field sliding_window", "sliding-noncausal": "field sliding_window",
    "all-causal": "field is_causal", "knobs": "input_embedding_scale 1.7", "dflash2": "field sliding_window"}
SPECULATORS_TO_ZLAB_REFUSED = {
    "sliding-causal": "field sliding_window", "sliding-noncausal": "field sliding_window",
    "reduced-vocab": "draft_vocab_size 100 of 256", "sample-from-anchor": "sample_from_anchor",
    "dflash2": "field sliding_window"}
# SpecForge's format (its classes draft with no attention mask, over the target's lm_head): what it refuses.
ZLAB_TO_SPECFORGE_REFUSED = {
    "sliding-causal": "field sliding_window", "sliding-noncausal": "field sliding_window",
    "all-causal": "field is_causal", "knobs": "input_embedding_scale 1.7", "dflash2": "a DFlash2 drafter"}
SPECULATORS_TO_SPECFORGE_REFUSED = {
    "sliding-causal": "field sliding_window", "sliding-noncausal": "field sliding_window",
    "reduced-vocab": "draft_vocab_size 100 of 256", "sample-from-anchor": "sample_from_anchor",
    "dflash2": "a DFlash2 drafter"}
# config.json keys that may differ after a round trip: the speculators_config a speculators export
# always writes (vLLM requires it; speculators' own save writes null), and speculators' stamp of the
# version that saved a checkpoint (z-lab has no place for it; the export writes none).
ROUND_TRIP_KEYS_WRITTEN = {"speculators_config", "speculators_version"}


@pytest.fixture(scope="module")
def random_target(tmp_path_factory):
    target = freeze(tiny_target("qwen3", init_std=0.2, seed=1))
    folder = tmp_path_factory.mktemp("verifier")
    target.save_pretrained(folder)
    target.folder = str(folder)
    return target


@pytest.fixture(scope="module")
def sequence(random_target):
    ids = torch.randint(0, 250, (20,), generator=torch.Generator().manual_seed(5))
    _, th = target_features(random_target, ids[None], [0, 1, 2])
    return ids, th


def speculators_class(folder: Path):
    """speculators' own loader; the dense (sdpa) masks, as the golden tests build them on CPU."""
    from speculators import SpeculatorModelConfig
    from speculators.model import SpeculatorModel

    config = SpeculatorModelConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "sdpa"
    return SpeculatorModel.from_pretrained(folder, config=config).eval()


def assert_same_checkpoint(a: Path, b: Path, supplied: dict | None = None) -> None:
    """Tensors bit for bit (names as read, dtypes), the drafter config field for field, and every
    config.json key of ``a`` in ``b`` with the same value (but :data:`ROUND_TRIP_KEYS_WRITTEN`);
    ``b`` adds no key but those and the fields ``supplied`` on the way (e.g. by ``--verifier``)."""
    from dataclasses import replace

    supplied = supplied or {}
    ta, tb = read_tensors(open_checkpoint(a)), read_tensors(open_checkpoint(b))
    assert set(ta) == set(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and torch.equal(ta[name], tb[name]), name
    assert replace(open_checkpoint(a).config, **supplied) == open_checkpoint(b).config
    ra, rb = (json.loads((f / "config.json").read_text()) for f in (a, b))
    changed = {k: (ra[k], rb.get(k)) for k in ra if ra[k] != rb.get(k) and k not in ROUND_TRIP_KEYS_WRITTEN | set(supplied)}
    assert not changed, changed
    assert set(rb) - set(ra) <= ROUND_TRIP_KEYS_WRITTEN | set(supplied), set(rb) - set(ra)


def assert_refused(src: Path, fmt: str, field: str, **kw) -> None:
    with pytest.raises(ExportRefused) as refused:
        export(src, fmt, **kw)
    assert any(field in reason for reason in refused.value.reasons), refused.value.reasons
    assert field in export_refusals(open_checkpoint(src), **kw)[fmt]
    assert not any(p.name.startswith(f"{src.name}.") or p.name.startswith(f".{src.name}.") for p in src.parent.iterdir())


# ----------------------------------------------------------------------------- draft logits

@pytest.mark.parametrize("variant", {**ZLAB_VARIANTS, **ZLAB_EXTRA})
@torch.no_grad()
def test_zlab_variants_export_to_speculators(variant, tmp_path, random_target, sequence):
    """z-lab -> speculators: speculators' own class gives the z-lab reference's logits at its own
    anchors (its training forward and mask); back to z-lab, the checkpoint is the source's."""
    ids, th = sequence
    src = tmp_path / "zlab"
    ref = zlab_drafter(src, random_target, **{**ZLAB_VARIANTS, **ZLAB_EXTRA}[variant])
    if variant in ZLAB_TO_SPECULATORS_REFUSED:
        assert_refused(src, "speculators", ZLAB_TO_SPECULATORS_REFUSED[variant], verifier=random_target.folder)
        return
    result = export(src, "speculators", verifier=random_target.folder)
    out = Path(result["out"])
    assert out == tmp_path / "zlab.speculators" and result["source_format"] == "zlab"
    raw = json.loads((out / "config.json").read_text())
    assert raw["aux_hidden_state_layer_ids"] == [1, 2, 3]                      # z-lab ids [0, 1, 2] + 1
    assert raw["speculators_config"]["verifier"]["name_or_path"] == random_target.folder
    spec = speculators_class(out)
    assert not spec.lm_head.weight.isnan().any()                                # filled from the verifier
    got, _, anchors = speculators_logits(spec, th, ids, n_anchors=6)
    B = ref.block_size
    for j, p in enumerate(anchors.tolist()):
        torch.testing.assert_close(got[:, j * B:(j + 1) * B], zlab_logits(ref, random_target, th, ids, p, B),
                                   atol=TOL, rtol=0)
    back = Path(export(out, "zlab")["out"])
    assert_same_checkpoint(src, back)
    again = zlab_class(back)
    for p in (0, 7, 18):
        assert torch.equal(zlab_logits(again, random_target, th, ids, p, B), zlab_logits(ref, random_target, th, ids, p, B))


@pytest.mark.parametrize("variant", {**SPECULATORS_VARIANTS, **SPECULATORS_EXTRA})
@torch.no_grad()
def test_speculators_variants_export_to_zlab(variant, tmp_path, random_target, sequence):
    """speculators -> z-lab: z-lab's own class gives the speculators reference's logits at every
    anchor speculators drew (per anchor, context [:p]); back to speculators, the checkpoint is the
    source's and speculators' class gives the same logits bit for bit."""
    ids, th = sequence
    src = tmp_path / "spec"
    ref = speculators_drafter(src, random_target, **{**SPECULATORS_VARIANTS, **SPECULATORS_EXTRA}[variant])
    if variant in SPECULATORS_TO_ZLAB_REFUSED:
        assert_refused(src, "zlab", SPECULATORS_TO_ZLAB_REFUSED[variant], verifier=random_target.folder)
        return
    want, _, anchors = speculators_logits(ref, th, ids, n_anchors=6)
    out = Path(export(src, "zlab", verifier=random_target.folder)["out"])
    raw = json.loads((out / "config.json").read_text())
    assert raw["dflash_config"]["target_layer_ids"] == [0, 1, 2] and raw["num_target_layers"] == 4
    zlab = zlab_class(out)
    B = zlab.block_size
    for j, p in enumerate(anchors.tolist()):
        torch.testing.assert_close(zlab_logits(zlab, random_target, th, ids, p, B), want[:, j * B:(j + 1) * B],
                                   atol=TOL, rtol=0)
    back = Path(export(out, "speculators", verifier=random_target.folder)["out"])
    assert_same_checkpoint(src, back, supplied={"num_target_layers": 4})
    again, _, _ = speculators_logits(speculators_class(back), th, ids, n_anchors=6)
    assert torch.equal(again, want)


@pytest.mark.parametrize("source, variant", [("zlab", v) for v in ZLAB_VARIANTS]
                         + [("speculators", v) for v in SPECULATORS_VARIANTS])
@torch.no_grad()
def test_variants_export_to_specforge_or_are_refused(source, variant, tmp_path, random_target, sequence):
    """z-lab / speculators -> SpecForge: what SpecForge's classes cannot draw (sliding windows, causal
    layers, DFlash2, z-lab's knobs, a reduced vocabulary, sample_from_anchor) is refused naming the
    field; the rest reads back as SpecForge's format with the source's logits at every anchor, and
    exported back to the source format is the source checkpoint (tests/test_specforge_ref.py loads
    these exports in SpecForge's own class)."""
    ids, th = sequence
    src = tmp_path / source
    build, variants, refused = ((zlab_drafter, ZLAB_VARIANTS, ZLAB_TO_SPECFORGE_REFUSED) if source == "zlab" else
                                (speculators_drafter, SPECULATORS_VARIANTS, SPECULATORS_TO_SPECFORGE_REFUSED))
    build(src, random_target, **variants[variant])
    if variant in refused:
        assert_refused(src, "specforge", refused[variant], verifier=random_target.folder)
        return
    out = Path(export(src, "specforge", verifier=random_target.folder)["out"])
    raw = json.loads((out / "config.json").read_text())
    assert open_checkpoint(out).format == "specforge" and raw["architectures"] == ["DFlashDraftModel"]
    assert raw["dflash_config"]["target_layer_ids"] == [0, 1, 2] and raw["num_target_layers"] == 4
    want, got = load_drafter(src)[0], load_drafter(out)[0]
    for p in (1, 7, 18):
        assert torch.equal(ours_logits_per_anchor(got, random_target, th, ids, p, got.block_size),
                           ours_logits_per_anchor(want, random_target, th, ids, p, want.block_size))
    back = Path(export(out, source, verifier=random_target.folder, force=True, out=tmp_path / "back")["out"])
    assert_same_checkpoint(src, back, supplied={"num_target_layers": 4} if source == "speculators" else None)


@torch.no_grad()
def test_a_state_dict_exports_to_both_formats(tmp_path, random_target, sequence):
    """A bare state dict (``module.`` prefixes, flat config) loads in both references' classes with
    the logits our loader gives the source."""
    ids, th = sequence
    save_drafter(random_drafter(random_target), tmp_path / "sd", fmt="state_dict", prefix="module.")
    ours, _ = load_drafter(tmp_path / "sd")
    zlab = zlab_class(Path(export(tmp_path / "sd", "zlab")["out"]))
    for p in (0, 9, 18):
        torch.testing.assert_close(zlab_logits(zlab, random_target, th, ids, p, 8),
                                   ours_logits_per_anchor(ours, random_target, th, ids, p, 8), atol=TOL, rtol=0)
    spec = speculators_class(Path(export(tmp_path / "sd", "speculators", verifier=random_target.folder)["out"]))
    got, _, anchors = speculators_logits(spec, th, ids, n_anchors=4)
    for j, p in enumerate(anchors.tolist()):
        torch.testing.assert_close(got[:, j * 8:(j + 1) * 8], ours_logits_per_anchor(ours, random_target, th, ids, p, 8),
                                   atol=TOL, rtol=0)


@torch.no_grad()
def test_speculators_own_converter_changes_what_this_export_refuses(tmp_path, random_target, sequence):
    """speculators' ``DFlashConverter`` (0.9.0) converts z-lab drafters with knobs or sliding layers
    without a word, and their logits move far beyond the tolerance; on a plain drafter it writes the
    tensors and ids this export writes (docs/export.md says so; a fixed converter fails this test)."""
    from speculators.convert.dflash.converter import DFlashConverter

    ids, th = sequence
    for name, kw in {"plain": {}, "knobs": ZLAB_VARIANTS["knobs"], "sliding": ZLAB_VARIANTS["sliding-causal"]}.items():
        ref = zlab_drafter(tmp_path / name, random_target, **kw)
        DFlashConverter().convert(tmp_path / name, tmp_path / f"{name}.converted", base_model=random_target.folder,
                                  validate=False)
        got, _, anchors = speculators_logits(speculators_class(tmp_path / f"{name}.converted"), th, ids, n_anchors=6)
        drift = max(float((got[:, j * 8:(j + 1) * 8] - zlab_logits(ref, random_target, th, ids, p, 8)).abs().max())
                    for j, p in enumerate(anchors.tolist()))
        if name == "plain":
            assert drift < TOL
            ours = Path(export(tmp_path / name, "speculators")["out"])
            theirs, mine = (read_tensors(open_checkpoint(f)) for f in (tmp_path / f"{name}.converted", ours))
            assert all(torch.equal(theirs[k], mine[k]) for k in mine)
            assert open_checkpoint(ours).config.target_layer_ids == open_checkpoint(tmp_path / f"{name}.converted").config.target_layer_ids
        else:
            assert drift > 1.0, name
            assert "speculators" in export_refusals(open_checkpoint(tmp_path / name)) and \
                export_refusals(open_checkpoint(tmp_path / name))["speculators"] is not None


# ----------------------------------------------------------------------------- greedy decoding

def speculators_from(trained, folder: Path, target, dflash2: bool):
    """A speculators drafter carrying ``trained``'s weights (DFlash2's modules near identity, as
    :func:`tests.test_conformance.reference_from` makes them), saved with its own ``save_pretrained``."""
    ref = speculators_drafter(folder, target, dflash2=dflash2, rope={"rope_type": "default", "rope_theta": 1e6})
    ref.load_state_dict(trained.state_dict(), strict=False)
    if dflash2:
        randomize(ref, seed=3, std=0.01, keep=("fc", "norm", "self_attn", "mlp.", "embed_tokens", "verifier",
                                               "lm_head"))
        with torch.no_grad():
            for layer in ref.layers:
                for conv in (layer.attention_conv, layer.mlp_conv):
                    conv.base_kernel[:, 0] += 1.0
    ref.save_pretrained(folder)
    return ref


@pytest.fixture(scope="module")
def walk():
    return walk_target("qwen3"), trained_drafter("qwen3")


@pytest.mark.parametrize("dflash2", [False, True], ids=["dflash", "dflash2"])
def test_exported_drafters_decode_cycle_for_cycle(dflash2, tmp_path, walk):
    """Greedy decoding with the exported checkpoint (through our loader, and through z-lab's
    ``dflash_generate`` where the export is z-lab) gives the source's tokens and acceptance
    lengths, cycle for cycle: z-lab -> speculators -> z-lab, and speculators -> z-lab."""
    target, trained = walk
    zsrc, ssrc = tmp_path / "z", tmp_path / "s"
    zref = reference_from(trained, zsrc, target, dflash2=dflash2)
    speculators_from(trained, ssrc, target, dflash2)
    as_spec = Path(export(zsrc, "speculators")["out"])
    as_zlab = Path(export(as_spec, "zlab", out=tmp_path / "z2")["out"])
    from_spec = Path(export(ssrc, "zlab", num_target_layers=target.config.num_hidden_layers)["out"])
    z2, zs = zlab_class(as_zlab), zlab_class(from_spec)
    drafters = {name: load_drafter(folder)[0] for name, folder in
                (("z", zsrc), ("z.speculators", as_spec), ("s", ssrc), ("s.zlab", from_spec))}
    lengths = []
    for i, prompt in enumerate(prompts(target, 2, seed=29)):
        n = (40, 33)[i]
        want = zlab_generate(zref, target, prompt, n)
        assert zlab_generate(z2, target, prompt, n) == want
        for name in ("z", "z.speculators"):
            spec = speculative_generate(target, drafters[name], prompt, n)
            assert (spec.output_ids, spec.acceptance_lengths) == want, name
        source = speculative_generate(target, drafters["s"], prompt, n)
        assert zlab_generate(zs, target, prompt, n) == (source.output_ids, source.acceptance_lengths)
        exported = speculative_generate(target, drafters["s.zlab"], prompt, n)
        assert (exported.output_ids, exported.acceptance_lengths) == (source.output_ids, source.acceptance_lengths)
        lengths += want[1] + source.acceptance_lengths
    assert any(a > 1 for a in lengths), lengths                                  # drafts were accepted


# ----------------------------------------------------------------------------- the command

@pytest.mark.worker
def test_command_writes_atomically_with_a_note_and_one_json_line(tmp_path, random_target, capsys):
    """``python -m remote.export``: one JSON line on stdout; the note records the source's files and
    the written files' hashes; an existing destination is refused (exit 2) unless --force; a refusal
    is one line naming the field (exit 1) and leaves nothing behind."""
    from remote.drafters.checkpoint import sha256_file
    from remote.export import main

    src = tmp_path / "ckpt"
    zlab_drafter(src, random_target)
    proc = subprocess.run([sys.executable, "-m", "remote.export", str(src), "--to", "speculators"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    out = tmp_path / "ckpt.speculators"
    assert result["ok"] and result["out"] == str(out) and result["format"] == "speculators"
    note = json.loads((out / NOTE_NAME).read_text())
    assert note["source"] == {"path": str(src), "format": "zlab", "files": [
        {"path": f, "size": (src / f).stat().st_size, "sha256": sha256_file(src / f)}
        for f in ("config.json", "model.safetensors")]}
    assert note["files"] == result["files"]
    assert all(sha256_file(out / f["path"]) == f["sha256"] for f in note["files"])
    assert any("aux_hidden_state_layer_ids [1, 2, 3]" in m for m in note["mapped"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ckpt.speculators"]

    def run(*args) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    code, stdout, stderr = run(src, "--to", "speculators")
    assert code == 2 and json.loads(stdout)["kind"] == "destination"
    assert stderr == f"error: {out} exists (--force replaces it)\n"
    before = (out / NOTE_NAME).stat().st_ino
    code, stdout, stderr = run(src, "--to", "speculators", "--force")
    assert code == 0 and json.loads(stdout)["ok"], stderr
    assert (out / NOTE_NAME).stat().st_ino != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ckpt.speculators"]

    zlab_drafter(tmp_path / "knobs", random_target, knobs={"output_multiplier": 0.5})
    code, stdout, stderr = run(tmp_path / "knobs", "--to", "speculators")
    assert code == 1 and json.loads(stdout)["kind"] == "refused"
    assert json.loads(stdout)["refusals"] == ["output_multiplier 0.5: speculators has no output_multiplier (z-lab knob)"]
    assert stderr.count("\n") == 1 and "output_multiplier" in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ckpt.speculators", "knobs"]


def test_a_failed_write_leaves_no_folder_and_keeps_the_old_one(tmp_path, random_target, monkeypatch):
    """A write that fails after the weights are on disk (a full disk while writing config.json)
    leaves neither a destination nor a temporary folder; with --force the old destination stays."""
    import remote.drafters.export as export_module

    src = tmp_path / "ckpt"
    zlab_drafter(src, random_target)

    def full_disk(folder, plan, tensors):
        raise OSError(28, "No space left on device", str(folder / "config.json"))
    monkeypatch.setattr(export_module, "_check_written", full_disk)
    with pytest.raises(OSError):
        export(src, "speculators")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    (tmp_path / "ckpt.speculators").mkdir()
    (tmp_path / "ckpt.speculators" / "old").write_text("kept")
    with pytest.raises(OSError):
        export(src, "speculators", force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ckpt.speculators"]
    assert (tmp_path / "ckpt.speculators" / "old").read_text() == "kept"


def test_force_never_replaces_what_the_export_reads(tmp_path, random_target):
    """A destination that is, holds or lies inside the source or the verifier folder is refused,
    naming it, --force or not, and nothing there changes: `--out RUN --force` ("put the export in
    this folder") replaced the run's folder whole, both checkpoints with it, and said ok."""
    from remote.drafters.export import DestinationError
    from remote.export import main

    run = tmp_path / "run"
    for step in ("step_100", "step_200"):
        zlab_drafter(run / step, random_target, seed=len(step))
    verifier = Path(shutil.copytree(random_target.folder, tmp_path / "verifier"))
    src = run / "step_200"

    def state() -> dict:
        return {str(p.relative_to(tmp_path)): p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}

    before = state()
    for out, how in ((run, f"contains the source {src}"), (tmp_path, f"contains the source {src}"),
                     (src, f"is the source {src}"), (src / "x", f"lies inside the source {src}"),
                     (verifier, f"is the verifier {verifier}"), (verifier / "x", f"lies inside the verifier {verifier}")):
        with pytest.raises(DestinationError, match=re.escape(f"{out}: the destination {how}")):
            export(src, "speculators", out=out, force=True, verifier=str(verifier))
    assert main([str(src), "--to", "speculators", "--out", str(run), "--force"]) == 2
    assert state() == before


def test_what_a_killed_force_export_left_is_put_right_by_the_next(tmp_path, random_target):
    """An export --force killed between its two renames leaves the old destination moved aside
    (`.DEST.replaced-PID`) and no DEST: the next export to DEST puts it back (so, without --force, it
    is refused as existing); killed after them, the old one is left beside the new: removed. Only
    what a process that is gone left is touched."""
    from remote.drafters.export import DestinationError

    src, out = tmp_path / "ckpt", tmp_path / "ckpt.speculators"
    zlab_drafter(src, random_target)
    gone = subprocess.Popen(["true"])
    gone.wait()
    aside = tmp_path / f".ckpt.speculators.replaced-{gone.pid}"
    aside.mkdir()
    (aside / "old").write_text("the destination before")
    with pytest.raises(DestinationError, match="exists"):
        export(src, "speculators")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ckpt.speculators"]
    assert (out / "old").read_text() == "the destination before"
    aside.mkdir()
    live = tmp_path / f".ckpt.speculators.replaced-{os.getppid()}"
    live.mkdir()
    export(src, "speculators", force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", "ckpt.speculators", live.name])
    assert (out / NOTE_NAME).is_file() and not (out / "old").exists()


@pytest.mark.worker
def test_inspect_shows_the_formats_a_checkpoint_exports_to(tmp_path, random_target):
    """``inspect`` reports, per format, yes or the refusal (the same function decides as for export);
    with a target it knows the target's layer count, which z-lab output needs."""
    from remote.inspect import inspect

    speculators_drafter(tmp_path / "reduced", random_target, draft_vocab=100)
    proc = subprocess.run([sys.executable, "-m", "remote.inspect", str(tmp_path / "reduced")], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "export    speculators: yes" in proc.stdout
    assert "export    zlab: no (draft_vocab_size 100 of 256" in proc.stdout
    assert "export    specforge: no (draft_vocab_size 100 of 256" in proc.stdout
    speculators_drafter(tmp_path / "full", random_target)
    needs = ("DFlashDraftModel needs it (it computes a default layer list from it even when target_layer_ids is set): "
             "pass --verifier DIR or --num-target-layers N")
    assert inspect(str(tmp_path / "full"))["exports"] == {
        "speculators": None, "zlab": f"num_target_layers: not recorded in the source, and z-lab's {needs}",
        "specforge": f"num_target_layers: not recorded in the source, and SpecForge's {needs}"}
    assert inspect(str(tmp_path / "full"), target=random_target.folder)["exports"] == {
        "speculators": None, "zlab": None, "specforge": None}
