"""The engine's acceptance counts beside ours, reconciled step by step (stdlib only).

Two decodings of the same prompt with the same drafter and greedy verification commit the same
tokens; their counts still differ where the two sides count differently or draft differently:

- **Ours / z-lab** (``remote.decode.online.speculative_generate`` = ``dflash_generate``): the prefill commits
  the first token; each cycle commits ``acceptance_length = accepted + 1`` tokens, so
  ``sum(acceptance_lengths) == len(output) - 1``. The last cycle drafts only the tokens still
  needed (its block is cut) and counts only what it commits (``min(accepted + 1, remaining)``, up
  to a stop token).
- **vLLM** (:mod:`remote.engines.vllm`): the prefill step is not a draft; every later step drafts
  ``num_speculative_tokens`` tokens (the last one too) and counts every draft it matched, also
  those past ``max_tokens`` or a stop token, which are then cut from the output. So
  ``drafts + accepted == len(output) - 1 + overshoot`` with ``overshoot`` the tokens the last step
  generated and threw away.

Once fewer than ``block_size - 1`` tokens remain, our blocks are cut and the engine's are not, so
the drafts differ from there. Before that, the per-step counts agree exactly when both sides
compute the drafter alike; where they do not, the engine's drafter computes differently (kernels,
dtype: :func:`reconcile`'s ``first_difference``, and :mod:`remote.engines.quirks`).
"""
from __future__ import annotations


def engine_overshoot(engine: dict) -> int:
    """Tokens the engine's steps generated beyond the output it returned (the last step's matched
    drafts past ``max_tokens`` or a stop token): ``1 + drafts + accepted - len(output_ids)``."""
    return 1 + engine["drafts"] + engine["accepted"] - len(engine["output_ids"])


def full_block_cycles(acceptance_lengths: list[int], new_tokens: int, block_size: int) -> int:
    """How many of our leading cycles verified a full block: a cycle that starts with fewer than
    ``block_size - 1`` tokens still to generate drafts a cut block (z-lab's rule), where the engine
    drafts a full one, so from there the two sides draft different tokens."""
    committed, n = 1, 0                     # the prefill commits the first token
    for length in acceptance_lengths:
        if new_tokens - committed + 1 < block_size:
            break
        n += 1
        committed += int(length)
    return n


def reconcile(engine: dict, acceptance_lengths: list[int], block_size: int) -> dict:
    """Engine counts (:func:`remote.engines.vllm.result`) beside ours for the same output.

    Returns ``engine_tau`` (1 + accepted / drafts, the engine's own), ``our_tau`` (committed tokens
    per cycle, bonus included: ``sum / cycles``), ``engine_drafts`` / ``our_cycles``,
    ``engine_accepted`` / ``our_accepted`` (drafts committed: ``sum(lengths) - cycles``),
    ``overshoot`` (:func:`engine_overshoot`), ``full_block_cycles`` (:func:`full_block_cycles`),
    ``same_steps`` (leading steps whose accepted counts agree) and ``first_difference``: the
    first full-block cycle before our last (which counts only what it commits) whose count differs (the engine drafted other tokens from the same
    context: its drafter computes differently, see :mod:`remote.engines.quirks`), or None when
    every full-block cycle agrees and the counts differ only by the cut last blocks and the
    engine's overshoot. An engine without per-step counts (SGLang) has ``same_steps`` and
    ``first_difference`` None."""
    ours = [int(a) - 1 for a in acceptance_lengths]
    full = full_block_cycles(acceptance_lengths, len(engine["output_ids"]), block_size)
    out = {"engine_tau": engine["tau"], "our_tau": sum(acceptance_lengths) / len(acceptance_lengths)
           if acceptance_lengths else None, "engine_drafts": engine["drafts"], "our_cycles": len(ours),
           "engine_accepted": engine["accepted"], "our_accepted": sum(ours),
           "overshoot": engine_overshoot(engine) if engine.get("accepted") is not None else None,
           "full_block_cycles": full, "same_steps": None, "first_difference": None}
    if engine.get("per_step_accepted") is None:     # an engine that reports totals only (SGLang)
        return out
    steps = list(engine["per_step_accepted"])
    same = 0
    while same < min(len(ours), len(steps)) and ours[same] == steps[same]:
        same += 1
    out.update(same_steps=same, first_difference=same if same < min(full, len(ours) - 1) else None)
    return out
