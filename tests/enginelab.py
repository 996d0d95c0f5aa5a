"""The real vLLM engine for tests: where its environment is, and the tiny pair it serves; drafters of
SpecForge's families for that pair's target (what SGLang serves beside DFlash).

The engine is found through ``$DFLASH_OPS_VLLM_PYTHON`` (CI sets it to ``.ci/vllm-env``'s
environment), else in ``.ci/vllm-env``'s default folder; :data:`SKIP` is the module mark that skips
a test file without either, with a warning in the summary. ``DFLASH_OPS_TEST_ENGINE_PAIR=DIR``
reuses a built pair while iterating."""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from remote.engines.vllm import PYTHON_ENV


def engine_python() -> str | None:
    path = os.environ.get(PYTHON_ENV)
    if path:
        return path        # named: it must work (a broken install fails the tests, never skips them)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    default = cache / "dflash-ops" / "vllm-venv" / "bin" / "python"
    return str(default) if default.is_file() else None


ENGINE = engine_python()
WHY = (f"the vLLM engine is not installed: run .ci/vllm-env and set {PYTHON_ENV}=$(.ci/vllm-env) "
       "to run the engine tests")
if ENGINE is None:
    warnings.warn(WHY)
SKIP = pytest.mark.skipif(ENGINE is None, reason=WHY)


def engine_pair(tmp_path_factory) -> dict:
    """``{"target": dir, "drafter": dir}``: remote/embedded.py's ``qwen3`` recipe (head_dim 32, which
    vLLM's CPU attention serves), built once (tests/buildcache.py) or reused."""
    import buildcache

    from remote.embedded import QWEN3_RECIPE, ensure

    reuse = os.environ.get("DFLASH_OPS_TEST_ENGINE_PAIR")
    if reuse:
        return ensure(Path(reuse), QWEN3_RECIPE)
    built = buildcache.built("engine-pair", QWEN3_RECIPE, lambda out: ensure(out / "pair", QWEN3_RECIPE))
    return ensure(built / "pair", QWEN3_RECIPE)


# the heads a tiny drafter of each SpecForge family gets (SGLang's DSPARK needs a Markov head), and the
# spread of their random weights: enough to change some drafts of the trained backbone, not most
FAMILY_HEADS = {"dspark": {"markov_rank": 8, "markov_head_type": "vanilla", "confidence_head": True},
                "domino": {"emb_dim": 32, "gru_hidden_dim": 32}}
HEAD_STD = 0.1


def family_drafter(dflash: str | Path, family: str, out: str | Path, fmt: str = "state_dict", seed: int = 0) -> Path:
    """A ``family`` drafter (SpecForge's Domino or DSpark) for the target of the DFlash drafter in
    ``dflash``: that drafter's backbone weights and the family's heads at random (seeded, the
    heads' linear layers ~ N(0, HEAD_STD)), written in the flat state-dict format into
    ``out``/state_dict, and exported to ``fmt`` (``specforge``, what SGLang reads) into
    ``out``/``fmt``. Returns the folder in ``fmt``."""
    from dataclasses import replace

    import torch

    from remote.drafters.checkpoint import load_drafter, save_drafter
    from remote.drafters.dflash import init_weights
    from remote.drafters.tiny import tiny_drafter

    base, _ = load_drafter(dflash)
    drafter = tiny_drafter(replace(base.config, family=family, **FAMILY_HEADS[family]), seed=seed)
    missing, unexpected = drafter.load_state_dict(base.state_dict(), strict=False)
    heads = ("markov_head", "confidence_head", "prefix_gru", "embed_proj")
    assert not unexpected and all(k.split(".")[0] in heads for k in missing), (missing, unexpected)
    for name in ("markov_head", "embed_proj"):         # the heads that change the drafts
        if hasattr(drafter, name):
            init_weights(getattr(drafter, name), HEAD_STD, torch.Generator().manual_seed(seed))
    flat = save_drafter(drafter, Path(out) / "state_dict", fmt="state_dict")
    if fmt == "state_dict":
        return flat
    from remote.drafters.export import export

    return Path(export(flat, fmt, Path(out) / fmt)["out"])
