"""Online (real) DFlash speculative decoding against a Hugging Face target, greedy or sampled, and
the plain decoding baseline it must reproduce.

Batch size 1, ``torch.inference_mode``; device and dtype are the target's. Both functions time
themselves (prefill included) with ``time.perf_counter`` after a CUDA synchronize; speculative
decoding also times its cycles stage by stage (:class:`StageClock`).

The cycle is z-lab's ``dflash_generate`` (``dflash/model.py``), step for step: ``start`` is the
position of the last committed token, which the target has not processed yet; at the top of every
cycle the target cache holds exactly positions ``< start`` and the drafter's context K/V the target
features of the same positions. Each cycle verifies ``verify_size = min(verify_block, max_length -
start)`` tokens (``verify_block = B``, or ``B + 1`` with speculators' sample_from_anchor) and drafts
only the ``verify_size - 1`` tokens it verifies: the drafter's block is cut to match, as z-lab's
last, shorter block is. The target verifies ``[token_at_start, drafts]`` in one forward; greedy
accepts the longest prefix of drafts equal to the target's argmax and adds the target's next token
(the bonus); sampling accepts by rejection sampling (:mod:`remote.drafters.sampling`). The cycle commits
``produced = min(accepted + 1, max_length - start - 1)`` tokens, fewer at a stop token.

Target cache (:mod:`remote.target.cache`, which also passes it to the forward). Attention layers are
cropped; Gated DeltaNet ``linear_attention`` layers (Qwen3.5/3.6) hold one state for the whole
prefix, so on a hybrid target every verify is preceded by a :func:`checkpoint` of the linear layers,
and a partial accept (fewer tokens kept than verified) is undone by :func:`rewind` and one
re-forward of the kept tokens, which advances both kinds of layer exactly over the committed tokens. Full
accepts need no rollback; pure-attention targets only crop, never re-forward. transformers' own
``crop`` with past recording, which z-lab's ``dflash_generate`` relies on, rolls back only the conv
state (before 5.25; on 5.25 it fails on Qwen3.5), so the reference is not lossless on hybrid targets.

So a hybrid target costs one extra target forward per partial-accept cycle (counted in
``target_forwards``). The cycle that ends generation skips the rollback: nothing runs after it.

**SpecForge's rules** (``semantics="specforge"``: its drafters' ``spec_generate``,
``specforge/modeling/draft/dflash.py``) differ from z-lab's in what is counted, not in what is
output (greedy, both equal the target's own decoding):

* every cycle drafts and verifies a full block, the last ones too, while ``start < max_length``
  (one cycle more than z-lab's when exactly ``max_new_tokens`` are committed), and counts the whole
  accepted run (``accepted + 1``) however far past ``max_new_tokens`` or a stop token it reaches;
  the output is cut at ``max_new_tokens`` and at the first stop token afterwards;
* a stop token is looked for after each cycle (a stop as the prefill's token still runs one cycle);
* at T > 0 the drafter drafts greedily and the target samples every verified position in one draw
  (``multinomial`` over the block, softmax of logits / T); the drafts equal to the target's samples
  are accepted and its sample at the first mismatch is the bonus token: the output is a sample of
  the target (lossless), the acceptance another than rejection sampling's.

spec_generate also drops every token equal to the mask token id from the ids it returns; the output
here keeps the target's tokens (the cycles are the same).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from remote.contract.metrics import LINEAR_STAGES
from remote.contract.settings import FULL_BLOCK_RULES
from remote.drafters.dflash import block_input_ids
from remote.drafters.sampling import GREEDY, Sampling, rejection_sample, sample
from remote.target.model import capture, features
from remote.target.cache import checkpoint, crop_attention, forward, has_linear_layers, new_cache, rewind


@dataclass
class DecodeResult:
    output_ids: list[int]      # completion only (the stop token included when one was produced)
    wall_s: float
    margins: list[float] | None = None   # greedy: each chosen token's :func:`margin`
    continuation: list[int] | None = None   # ``overshoot``: the tokens after the output


# the largest relative top-2 gap (:func:`margin`) that a forward over several tokens may flip
# against a forward over one in this dtype: a divergence there is a near-tie, not a decoding error
NEAR_TIE = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 2e-2}


def margin(logits: torch.Tensor) -> float:
    """How decisively greedy picks its token: (top-1 - top-2 logit) / max(1, |top-1 logit|)."""
    top = logits.float().topk(2, dim=-1).values.reshape(-1)
    return float((top[0] - top[1]) / max(1.0, abs(float(top[0]))))


@dataclass
class Divergence:
    """Where a greedy speculative output first differs from the target's own greedy output."""
    position: int              # index into the completion
    ours: int | None           # None: ours ended first
    target: int | None         # None: the target's ended first
    margin: float | None       # the target's relative top-2 gap there (:func:`margin`)
    near_tie: bool             # within NEAR_TIE of a tie for the dtype: numerics, not a decoding error

    def describe(self) -> str:
        what = f"token {self.position}: ours {self.ours}, target {self.target}"
        if self.margin is None:
            return what
        return what + f" (target's relative top-2 logit gap {self.margin:.3g}{', a near-tie' if self.near_tie else ''})"


def first_divergence(ours: list[int], base: DecodeResult, dtype: str) -> Divergence | None:
    """``None`` when ``ours`` equals the target's greedy output, else the first difference; a
    divergence where the target's top-2 gap is within ``NEAR_TIE[dtype]`` of its top logit is a
    near-tie (batched and one-token forwards round differently)."""
    want = base.output_ids
    i = next((k for k, (a, b) in enumerate(zip(ours, want)) if a != b), min(len(ours), len(want)))
    if i == len(ours) == len(want):
        return None
    gap = base.margins[i] if base.margins is not None and i < len(base.margins) else None
    near = gap is not None and i < len(ours) and i < len(want) and gap <= NEAR_TIE.get(dtype, 0.0)
    return Divergence(i, ours[i] if i < len(ours) else None, want[i] if i < len(want) else None, gap, near)


@dataclass
class SpecResult:
    output_ids: list[int]          # completion only; greedy: equals the target's greedy completion
    acceptance_lengths: list[int]  # tokens committed per cycle, bonus included (1..verify_block)
    wall_s: float
    target_forwards: int           # prefill + verifies + hybrid rollback re-forwards
    confidences: list[list[float]] | None = None   # per cycle, each draft's predicted acceptance (DSpark)
    cycles_s: float = 0.0          # the cycles' time (wall_s less the prefill)
    stage_s: dict[str, float] = field(default_factory=dict)    # the cycles' time per stage (LINEAR_STAGES), summed


class StageClock:
    """The time of a decoding's cycles per stage (``remote.contract.metrics.LINEAR_STAGES``,
    ``TREE_STAGES``): ``lap(stage)`` charges the time since the clock started or the previous lap
    to ``stage``. On CUDA a lap synchronizes the device first, so each stage's kernels are charged
    to it (the kernels run asynchronously); elsewhere it only reads the clock."""

    def __init__(self, device: torch.device, stages: tuple[str, ...]):
        self.device = device if device.type == "cuda" else None
        self.seconds = dict.fromkeys(stages, 0.0)
        self.started = self.mark = self.now()

    def now(self) -> float:
        if self.device is not None:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self, stage: str) -> None:
        t = self.now()
        self.seconds[stage] += t - self.mark
        self.mark = t

    def elapsed(self) -> float:
        return self.now() - self.started


# ----------------------------------------------------------------------------- decoding

def _device(model) -> torch.device:
    return next(model.parameters()).device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def target_decode(target, prompt_ids: torch.Tensor, max_new_tokens: int, stop_token_ids: list[int] | None = None,
                  sampling: Sampling = GREEDY, overshoot: int = 0) -> DecodeResult:
    """Plain decoding (z-lab's ``dflash_generate`` with ``block_size=1``): prefill, then one token
    per forward with a KV cache (lm_head on the last position only). Greedy, it is the
    losslessness reference; either way, the speedup baseline. ``overshoot``: that many tokens more
    after the output ends, stop tokens or not (``continuation``: what SpecForge's rules compare
    the last cycles' drafts with, :mod:`remote.decode.offline`)."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    stop = set(stop_token_ids or ())
    device = _device(target)
    prompt_ids = prompt_ids.to(device)
    _sync(device)
    t0 = time.perf_counter()
    cache = new_cache(target)
    logits = forward(target, prompt_ids, cache, logits_to_keep=1).logits
    token = sampling.choose(logits[:, -1])[:, None]                      # [1, 1]
    output_ids = [int(token)]
    margins = [margin(logits[0, -1])] if sampling.greedy else None
    end = None
    while end is None or len(output_ids) < end + overshoot:
        if end is None and (len(output_ids) >= max_new_tokens or output_ids[-1] in stop):
            end = len(output_ids)
            continue
        logits = forward(target, token, cache, logits_to_keep=1).logits
        token = sampling.choose(logits[:, -1])[:, None]
        output_ids.append(int(token))
        if margins is not None and end is None:
            margins.append(margin(logits[0, -1]))
    _sync(device)
    return DecodeResult(output_ids=output_ids[:end], wall_s=time.perf_counter() - t0, margins=margins,
                        continuation=output_ids[end:] if overshoot else None)


def committed(accepted: list[int], bonus: int, full_blocks: bool, left: int, stop: set,
              first: int) -> tuple[list[int], bool]:
    """The tokens a cycle commits of its ``accepted`` drafts and ``bonus`` token, and whether decoding
    stops after it. z-lab's rules: at most ``left`` tokens (``max_length - start - 1``), cut after a
    stop token. Full-block rules (SpecForge's, DDTree's): the whole run, and a stop token anywhere in
    it, or as the prefill's token ``first``, ends the loop after this cycle."""
    new_tokens = accepted + [bonus]
    if full_blocks:
        return new_tokens, first in stop or any(t in stop for t in new_tokens)
    new_tokens = new_tokens[:left]
    stopped_at = next((i for i, t in enumerate(new_tokens) if t in stop), None)
    return (new_tokens, False) if stopped_at is None else (new_tokens[:stopped_at + 1], True)


def labelled_confidences(confidences: list[float], produced: int, accepted: int) -> list[float]:
    """A cycle's confidences as a run records them beside its acceptance length ``produced``: a
    calibration labels draft k accepted iff k <= produced - 1 (the bonus token counted), so a cycle
    whose bonus token was not committed (z-lab's rules cut it at the end of the output or at a stop
    token: ``produced <= accepted`` drafts) keeps only its first ``produced - 1`` drafts' confidences,
    the ones those labels are true of."""
    return confidences if produced > accepted else confidences[:produced - 1]


def full_block_output(output_ids: list[int], max_new_tokens: int, stop: set) -> list[int]:
    """The output of a decoding under full-block rules, whose last runs counted past the end: cut at
    ``max_new_tokens``, then after the first stop token."""
    output_ids = output_ids[:max_new_tokens]
    cut = next((i for i, t in enumerate(output_ids) if t in stop), None)
    return output_ids if cut is None else output_ids[:cut + 1]


@torch.inference_mode()
def speculative_generate(target, drafter, prompt_ids: torch.Tensor, max_new_tokens: int,
                         stop_token_ids: list[int] | None = None, sampling: Sampling = GREEDY,
                         semantics: str = "zlab") -> SpecResult:
    """DFlash speculative decoding, cycle for cycle as z-lab's ``dflash_generate``, or with
    ``semantics="specforge"`` (or ``"ddtree"``, which counts alike) as SpecForge's ``spec_generate``
    (module docstring). Greedy output
    equals ``target_decode(...)``; sampled output is distributed as it."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    stop = set(stop_token_ids or ())
    device = _device(target)
    prompt_ids = prompt_ids.to(device)
    cfg = drafter.config
    layer_ids, mask_id = cfg.target_layer_ids, cfg.mask_token_id
    embed_weight, head = target.get_input_embeddings().weight, target.get_output_embeddings()
    dtype = next(drafter.parameters()).dtype
    slot0 = 0 if cfg.sample_from_anchor else 1          # block slots before the first draft slot
    max_length = prompt_ids.shape[1] + max_new_tokens
    specforge = semantics in FULL_BLOCK_RULES      # DDTree's loop counts as SpecForge's
    confidences: list[list[float]] = []

    with capture(target, layer_ids) as store:
        _sync(device)
        t0 = time.perf_counter()
        cache = new_cache(target)
        hybrid = has_linear_layers(cache)

        # prefill: the prompt -> first token, and the drafter's context for positions 0..P-1
        logits = forward(target, prompt_ids, cache, logits_to_keep=1).logits
        target_forwards = 1
        token = sampling.choose(logits[:, -1])                           # [1], the token at `start`
        new_context, ctx_kv = features(store, layer_ids), None
        output_ids = [int(token)]
        acceptance_lengths: list[int] = []
        start = prompt_ids.shape[1]
        stopped = output_ids[-1] in stop and not specforge
        going = (lambda: start < max_length) if specforge else (lambda: start + 1 < max_length)
        clock = StageClock(device, LINEAR_STAGES)

        while going() and not stopped:
            # draft: the block anchored at `start`, cut to the tokens this cycle verifies (z-lab)
            verify_size = cfg.verify_block if specforge else min(cfg.verify_block, max_length - start)
            block = block_input_ids(token, slot0 + verify_size - 1, mask_id)[None]   # [1, n]
            hidden, ctx_kv = drafter.draft(drafter.embed(block, embed_weight).to(dtype), start,
                                           new_context.to(dtype), ctx_kv)
            proposal = drafter.propose(drafter.draft_slots(hidden), token, head,
                                       None if specforge else sampling, embed_weight)
            drafts = proposal.tokens.to(token.device)                      # [1, verify_size - 1]
            if proposal.confidence is not None:
                confidences.append(proposal.confidence[0].tolist())
            clock.lap("draft")

            # verify: the token at `start` and the drafts, positions start..start+verify_size-1
            mark = checkpoint(cache) if hybrid else None
            verify_ids = torch.cat([token[:, None], drafts], 1)
            logits = forward(target, verify_ids, cache).logits
            target_forwards += 1
            clock.lap("verify")

            # commit: the target's choices, the accepted drafts and the bonus token
            if sampling.greedy or specforge:
                # SpecForge at T > 0: the target's samples at every position, in one draw
                posterior = logits[0].argmax(-1) if sampling.greedy else sample(sampling.probs(logits[0]))
                accepted = int((drafts[0] == posterior[:-1]).cumprod(0).sum())
                bonus = int(posterior[accepted])
            else:
                accepted, bonus = rejection_sample(drafts, sampling.probs(logits), *proposal.on(logits.device))
            new_tokens, stopped = committed(drafts[0, :accepted].tolist(), bonus, specforge, max_length - start - 1,
                                            stop, output_ids[0])
            produced = len(new_tokens)
            if proposal.confidence is not None:
                confidences[-1] = labelled_confidences(confidences[-1], produced, accepted)
            output_ids += new_tokens
            acceptance_lengths.append(produced)
            # features of the kept positions start..start+produced-1, from this verify (causal: the
            # rejected drafts after them do not affect them; a re-forward would recompute the same)
            new_context = features(store, layer_ids)[:, :produced]
            start += produced
            token = verify_ids.new_tensor([new_tokens[-1]])

            # cache: keep exactly positions < start (verify_ids[:, :produced] of this verify)
            if going() and not stopped:                                  # nothing runs after the last cycle
                if hybrid and produced < verify_size:
                    rewind(cache, mark, verify_size)                     # back to the cycle's start ...
                    forward(target, verify_ids[:, :produced], cache, logits_to_keep=1)
                    target_forwards += 1                                 # ... and re-forward the kept tokens
                else:
                    crop_attention(cache, verify_size - produced)
            clock.lap("commit")

        cycles_s = clock.elapsed()
        wall_s = time.perf_counter() - t0
    if specforge:   # the whole runs were counted; the output is cut as spec_generate cuts it
        output_ids = full_block_output(output_ids, max_new_tokens, stop)
    return SpecResult(output_ids=output_ids, acceptance_lengths=acceptance_lengths, wall_s=wall_s,
                      target_forwards=target_forwards, confidences=confidences or None, cycles_s=cycles_s,
                      stage_s=clock.seconds)
