"""The golden variants and helpers the golden tests (tests/test_conformance.py) and the export
tests (tests/test_export.py) share: the drafter variants built with the references' own classes,
the tolerance, our per-anchor draft logits, a z-lab reference carrying our trained weights, and
the walk prompts. Nothing here is product code."""
from __future__ import annotations

from pathlib import Path

import torch

from models import PROMPT_LEN
from references import randomize, zlab_drafter
from remote.drafters.dflash import block_input_ids

TOL = 1e-4
SLIDE = ("sliding_attention", "full_attention")
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
LINEAR = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}
KNOBS = {"input_embedding_scale": 1.7, "output_multiplier": 0.6, "final_logit_softcapping": 3.0}

ZLAB_VARIANTS = {
    "dflash": {},
    "sliding-causal": dict(layer_types=SLIDE, window=4),
    "sliding-noncausal": dict(layer_types=("sliding_attention", "sliding_attention"), window=3, is_causal=False),
    "all-causal": dict(is_causal=True),
    "yarn": dict(rope=YARN),
    "linear-rope": dict(rope=LINEAR),
    "knobs": dict(knobs=KNOBS),
    "dflash2": dict(dflash2=True, layer_types=SLIDE, window=4),
}
SPECULATORS_VARIANTS = {
    "dflash": {},
    "sliding-causal": dict(layer_types=SLIDE, window=3),
    "sliding-noncausal": dict(layer_types=("sliding_attention", "sliding_attention"), window=3, non_causal=True),
    "reduced-vocab": dict(draft_vocab=100),
    "sample-from-anchor": dict(sample_from_anchor=True, layer_types=SLIDE, window=3),
    "yarn": dict(rope=YARN),
    "dflash2": dict(dflash2=True, layer_types=SLIDE, window=3),
}


def ours_logits_per_anchor(ours, target, th, ids, p, n):
    noise = ours.embed(block_input_ids(ids[p:p + 1], n, ours.config.mask_token_id)[None],
                       target.get_input_embeddings().weight)
    hidden, _ = ours.draft(noise, p, th[:, :p])
    return ours.logits(hidden, target.lm_head)


def reference_from(ours, folder: Path, target, *, dflash2=False, **variant):
    """A z-lab reference drafter carrying ``ours``' trained weights (plus DFlash2's extra modules,
    near identity), saved with its own ``save_pretrained``."""
    ref = zlab_drafter(folder, target, dflash2=dflash2, rope={"rope_type": "default", "rope_theta": 1e6}, **variant)
    missing = ref.load_state_dict(ours.state_dict(), strict=False).missing_keys
    if dflash2:
        randomize(ref, seed=3, std=0.01, keep=("fc", "norm", "self_attn", "mlp."))
        with torch.no_grad():
            for layer in ref.layers:
                for conv in (layer.attention_conv, layer.mlp_conv):
                    conv.base_kernel[:, 0] += 1.0
    else:
        assert not missing
    ref.save_pretrained(folder)
    return ref.eval()


def prompts(target, n, seed=11):
    from remote.drafters.tiny import walk_batch
    ids = walk_batch(n, PROMPT_LEN, target.config.vocab_size - 1, torch.Generator().manual_seed(seed))
    return [row[None] for row in ids]


def chi_square_p(counts: dict, probs: dict, n: int) -> float:
    """Pearson chi-square goodness of fit (cells with expected count < 5 pooled), its p-value: the
    lossless-sampling tests' check that decoded samples follow the target's exact law."""
    from scipy.stats import chi2

    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for key, p in probs.items():
        if n * p < 5:
            pooled_obs, pooled_exp = pooled_obs + counts.get(key, 0), pooled_exp + n * p
        else:
            cells.append((counts.get(key, 0), n * p))
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return float(chi2.sf(stat, len(cells) - 1))


def tree_equals_greedy_and_offline(target, drafter, prompts, stops, max_new_tokens: int, budgets) -> dict[int, int]:
    """Under z-lab's rules, for each prompt (with its stop) and budget: online tree decoding's output
    is the target's greedy output and its acceptance lengths are the offline DDTree-N walk's, cycle
    for cycle (asserted). Returns the cycles each budget took over all prompts."""
    from remote.decode.offline import evaluate_offline
    from remote.decode.online import target_decode
    from remote.decode.tree import tree_generate

    cycles = {b: 0 for b in budgets}
    for prompt, stop in zip(prompts, stops):
        greedy = target_decode(target, prompt, max_new_tokens, stop).output_ids
        offline = evaluate_offline(drafter, target, prompt[0].tolist(), greedy, budgets=budgets)
        for b in budgets:
            online = tree_generate(target, drafter, prompt, max_new_tokens, b, stop)
            assert online.output_ids == greedy, b
            assert online.acceptance_lengths == offline["ddtree"][str(b)]["acceptance_lengths"], b
            cycles[b] += len(online.acceptance_lengths)
    return cycles


def sampled_outputs(decode, n: int) -> dict:
    """How often each output (token ids) ``decode()`` gives over ``n`` runs from seed 0."""
    counts: dict = {}
    torch.manual_seed(0)
    for _ in range(n):
        out = tuple(decode())
        counts[out] = counts.get(out, 0) + 1
    return counts


@torch.no_grad()
def four_token_pair(folder: Path, kind: str = "qwen3"):
    """A target over a 4-token vocabulary (``kind``: a pure-attention ``qwen3`` or a hybrid
    ``qwen3_5``), a random DFlash drafter for it (block 4) saved in ``folder``, a prompt, and the
    target's exact law of its first three sampled tokens (by enumeration):
    ``(target, drafter, prompt [1, P], {tokens: probability})``."""
    import itertools
    import math

    from models import freeze
    from remote.drafters.checkpoint import load_drafter
    from remote.drafters.tiny import tiny_target

    target = freeze(tiny_target(kind, vocab_size=4, init_std=0.3, seed=2))
    zlab_drafter(folder, target, block_size=4, layer_ids=(0, 1, 2))
    drafter, _ = load_drafter(folder)
    prompt = torch.tensor([[1, 2, 0, 3, 1]])
    seqs = torch.tensor(list(itertools.product(range(4), repeat=3)))
    logp = target(torch.cat([prompt.expand(len(seqs), -1), seqs], 1)).logits.float().log_softmax(-1)
    P = prompt.shape[1]
    exact = {tuple(s.tolist()): math.exp(sum(float(logp[i, P - 1 + k, s[k]]) for k in range(3)))
             for i, s in enumerate(seqs)}
    return target, drafter, prompt, exact
