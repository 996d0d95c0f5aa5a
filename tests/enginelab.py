"""The real vLLM engine for tests: where its environment is, and the tiny pair it serves.

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
