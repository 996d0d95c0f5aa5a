"""Train/eval parity: the same checkpoint's teacher-forced per-position accuracy, computed the
training way (all anchors at once through the anchor-block mask) and the eval way (one anchor at a
time, context slice ``[:p]``), plus the classic mistake (context ``[:p+1]``) for reference.

``python -m remote.parity --target DIR --drafter DIR --results results.jsonl --out parity.json``

If the first two columns disagree, the eval path does not reproduce training semantics; a
checkpoint whose training log says 3.58 while an eval says 0.33 is diagnosed here in one run.

For a drafter SpecForge trains (the DFlash, Domino and DSpark families on z-lab's layout) the report
also holds SpecForge's own training-side numbers on the same anchors (``specforge``, see
:class:`SpecForgeTally`) and ``gaps``: one sentence per SpecForge τ, set against our offline τ
estimate and the run's own τ, naming why they differ.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from remote.contract.formats import FAMILIES
from remote.drafters.config import DFLASH, DOMINO, DSPARK, ZLAB


def _turns(row: dict) -> list[tuple[list[int], list[int]]]:
    return [(t["prompt_ids"], t["output_ids"]) for t in row.get("turns") or [row]]


def parity(drafter, target, pairs: list[tuple[list[int], list[int]]], max_anchors: int | None = None) -> dict:
    import torch

    from remote.decode.offline import DraftTable
    from remote.target.model import target_features

    device = next(target.parameters()).device
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    n = drafter.config.num_drafts
    specforge = SpecForgeTally(drafter) if specforge_layout(drafter.config) else None
    methods = ("training", "eval", "eval_ctx_plus_one")
    hits = {m: [0] * n for m in methods}
    count = [0] * n
    disagreements = 0            # draft tokens where the two paths differ (expected 0 in fp32)
    anchors_done = 0
    with torch.no_grad():
        for prompt, output in pairs:
            ref = list(prompt) + list(output)
            if len(ref) < len(prompt) + 2:
                continue
            ids = torch.tensor(ref, device=device)
            out, th = target_features(target, ids[None], drafter.config.target_layer_ids)
            th = th.to(next(drafter.parameters()).dtype)
            anchors = list(range(len(prompt), len(ref) - 1))
            if max_anchors is not None:
                anchors = anchors[:max(0, max_anchors - anchors_done)]
            if not anchors:
                break
            table = DraftTable(drafter, th, ids, embed.weight, head, cut_last_blocks=False)
            table.compute(anchors)
            for p in anchors:
                batched = table.tokens[p]
                per_anchor = _draft_tokens(drafter, th, p, ids[p:p + 1], embed.weight, head)
                plus_one = _draft_tokens(drafter, th, p, ids[p:p + 1], embed.weight, head, extra_context=True)
                for k in range(min(n, len(ref) - 1 - p)):
                    truth = ref[p + 1 + k]
                    count[k] += 1
                    hits["training"][k] += int(batched[k] == truth)
                    hits["eval"][k] += int(per_anchor[k] == truth)
                    hits["eval_ctx_plus_one"][k] += int(plus_one[k] == truth)
                disagreements += sum(a != b for a, b in zip(batched, per_anchor))
            if specforge is not None:
                specforge.add(th, ids, anchors, out.logits[0], embed.weight, head)
            anchors_done += len(anchors)
    acc = {m: [h / c if c else 0.0 for h, c in zip(hits[m], count)] for m in methods}
    cum = {}
    for m in methods:
        run, cum[m] = 1.0, []
        for a in acc[m]:
            run *= a
            cum[m].append(run)
    report = {"anchors": anchors_done, "block_size": drafter.block_size, "count": count, "accuracy": acc,
              "cumulative": cum, "tau_estimate": {m: 1 + sum(cum[m]) for m in methods},
              "draft_disagreements": disagreements, "agree": disagreements == 0}
    if specforge is not None:
        report["specforge"] = specforge.report()
    return report


def _draft_tokens(drafter, th, p, anchor_token, embed_weight, head, extra_context: bool = False) -> list[int]:
    """The per-anchor path's full-block drafts at ``p``: context ``[:p]``, or with
    ``extra_context`` the mistaken ``[:p+1]`` (one token too many, every key visible), block
    positions as usual."""
    import torch

    from remote.drafters.dflash import block_input_ids

    B = drafter.block_size
    noise = drafter.embed(block_input_ids(anchor_token, B, drafter.config.mask_token_id)[None], embed_weight)
    noise = noise.to(th.dtype)
    if extra_context:
        positions = torch.arange(p + B, device=th.device)[None]
        cos, sin = drafter.rope(positions, th.dtype)
        kv = drafter.context_kv(th[:, :p + 1], (cos[:, :p + 1], sin[:, :p + 1]))
        hidden = drafter(noise, (cos[:, p:], sin[:, p:]), kv, [None] * len(drafter.layers))
    else:
        hidden, _ = drafter.draft(noise, p, th[:, :p])
    return drafter.propose(drafter.draft_slots(hidden), anchor_token, head, embed_weight=embed_weight).tokens[0].tolist()


def specforge_layout(cfg) -> bool:
    """Is this a drafter SpecForge trains: its DFlash, Domino or DSpark family on z-lab's layout (the
    z-lab mask rule, slot 0 the anchor, the target's full vocabulary, no DFlash2 selector)?"""
    return (cfg.family in FAMILIES and cfg.architecture == DFLASH and cfg.mask_rule == ZLAB
            and not cfg.sample_from_anchor and not cfg.reduced_vocab)


class SpecForgeTally:
    """SpecForge 0.2.0's training-side metrics (``specforge/algorithms/common/dflash_family_model.py``)
    over the anchors :func:`parity` walks, summed over the whole set before any ratio, as its
    ``specforge/eval/evaluator.py`` pools them.

    Blocks: every anchor ``p`` of the completion, context ``[:p]``, all anchors at once through the
    anchor mask (SpecForge samples up to ``num_anchors`` of the positions whose token and next token
    are supervised; with a loss mask on the completion and enough anchors that is every ``p`` here).
    Position ``i`` of a block scores token ``p + 1 + i`` (counted while that token exists) from slot
    ``first + i``:

    * ``dflash`` (``OnlineDFlashModel``) and ``domino`` (``OnlineDominoModel``): ``first = 1``, B - 1
      positions (slot 0, the anchor's, unscored), as spec_generate drafts them; a Domino drafter with
      ``shift_label`` reads slot ``i`` (``first = 0``) and is scored on B positions, the last one
      (token ``p + B``) past the block it drafts;
    * ``dspark`` (``OnlineDSparkModel``): ``first = 0``, B positions: slot ``i`` scores token
      ``p + 1 + i``, the anchor's own slot the first (spec_generate, and this worker, draft token
      ``p + 1 + k`` from slot ``k + 1``).

    Teacher-forced: a head that reads the block's previous tokens (Domino's GRU, DSpark's Markov bias
    and confidence head) reads the reference's, ``[token_p, ..., token_{p+i}]``, not its own drafts.

    * ``accuracy``: Σ (argmax = the token) / Σ positions (the evaluator's ``eval/avg_acc``);
      ``per_position``: the same per position (DSpark's ``accuracy_position``), ``accuracy_tau``
      ``= 1 + Σ_i Π_{j≤i} per_position[j]`` (the evaluator's geometric sum, plus the bonus token);
    * Domino ``accept_len``: mean over blocks of 1 + the leading run of correct positions;
    * DSpark ``expected_tau`` (``tau_probabilistic``): mean over blocks of ``1 + Σ_i Π_{j≤i} a_j`` with
      the accept probability ``a_j = clamp(1 − ½‖q_j − p_j‖₁, 0, 1)`` of the drafter's distribution
      ``q_j`` (its logits, Markov bias included) and the target's ``p_j`` (its logits at position
      ``p + j``), both softmax at temperature 1; ``confidence_tau``, with a confidence head: the same
      with ``σ(head)`` in place of ``a_j`` (what the head predicts of the number it is trained to).
    """

    def __init__(self, drafter, chunk: int = 32):
        cfg = drafter.config
        self.drafter, self.chunk, self.family = drafter, chunk, cfg.family
        self.first = 0 if (cfg.family == DOMINO and cfg.shift_label) or cfg.family == DSPARK else 1
        m = drafter.block_size - self.first
        self.correct, self.count = [0] * m, [0] * m
        self.blocks, self.accept_len, self.expected_tau, self.confidence_tau = 0, 0, 0.0, 0.0

    def add(self, th, ids, anchors: list[int], target_logits, embed_weight, head) -> None:
        """``th [1, T, K*H]`` the target's features of ``ids [T]``, ``target_logits [T, V]`` its logits."""
        import torch

        from remote.drafters.dflash import block_input_ids

        d, B, T = self.drafter, self.drafter.block_size, ids.numel()
        m = B - self.first
        ctx_kv = d.context_kv(th, d.rope(torch.arange(T, device=th.device)[None], th.dtype))
        for c in range(0, len(anchors), self.chunk):
            part = anchors[c:c + self.chunk]
            idx = torch.tensor(part, dtype=torch.long, device=ids.device)
            end = max(part) + 1
            noise = d.embed(block_input_ids(ids[idx], B, d.config.mask_token_id), embed_weight).to(th.dtype)
            hidden = d.forward_anchors(th[:, :end], noise[None], idx[None],
                                       ctx_kv=[(k[:, :, :end], v[:, :, :end]) for k, v in ctx_kv])
            hidden = hidden.view(len(part), B, -1)[:, self.first:]                          # [n, m, H]
            at = (idx[:, None] + torch.arange(m + 1, device=ids.device)).clamp(max=T - 1)    # tokens p .. p+m
            here = hidden.device
            prev, truth = ids[at[:, :-1]].to(here), ids[at[:, 1:]].to(here)
            valid = ((idx[:, None] + 1 + torch.arange(m, device=ids.device)) <= T - 1).to(here)   # [n, m]
            logits = d.teacher_forced_logits(hidden, prev, head, embed_weight)       # [n, m, V]
            hit = (logits.argmax(-1) == truth) & valid
            for i in range(m):
                self.correct[i] += int(hit[:, i].sum())
                self.count[i] += int(valid[:, i].sum())
            self.blocks += len(part)
            if self.family == DOMINO:
                self.accept_len += float(block_tau(hit.float(), valid).sum())
            if self.family == DSPARK:
                accept = accept_probability(logits, target_logits[at[:, :-1].to(target_logits.device)].to(here))
                self.expected_tau += float(block_tau(accept, valid).sum())
                confidence = d.confidence(hidden, prev[:, 0], truth)
                if confidence is not None:
                    self.confidence_tau += float(block_tau(confidence, valid).sum())

    def report(self) -> dict:
        per = [c / n if n else 0.0 for c, n in zip(self.correct, self.count)]
        run, cum = 1.0, []
        for a in per:
            run *= a
            cum.append(run)
        out = {"family": self.family, "first_slot": self.first, "blocks": self.blocks,
               "correct": sum(self.correct), "denominator": sum(self.count),
               "accuracy": sum(self.correct) / sum(self.count) if sum(self.count) else 0.0,
               "per_position": per, "per_position_count": self.count, "accuracy_tau": 1 + sum(cum)}
        if self.blocks and self.family == DOMINO:
            out["accept_len"] = self.accept_len / self.blocks
        if self.blocks and self.family == DSPARK:
            out["expected_tau"] = self.expected_tau / self.blocks
            if self.drafter.config.confidence_head:
                out["confidence_tau"] = self.confidence_tau / self.blocks
        return out


def accept_probability(draft_logits, target_logits):
    """SpecForge's DSpark accept probability of each position (``[..., V]`` logits -> ``[...]``):
    ``clamp(1 − ½‖q − p‖₁, 0, 1)`` with ``q``, ``p`` the softmax of the drafter's and the target's
    logits at temperature 1, in float32 (equal to ``Σ_x min(q(x), p(x))``)."""
    q, p = draft_logits.float().softmax(-1), target_logits.float().softmax(-1)
    return (1 - 0.5 * (q - p).abs().sum(-1)).clamp(0, 1)


def block_tau(per_position, valid):
    """``1 + Σ_i Π_{j≤i} x_j`` of each block (``[n, m]`` -> ``[n]``), positions past ``valid``
    ``[n, m]`` counted as 0 (SpecForge's per-block ``tau_probabilistic``). With 0/1 hits it is 1 + the
    leading run of hits: Domino's ``accept_len`` of the block."""
    return 1 + (per_position * valid).cumprod(-1).sum(-1)


def run_tau(rows: list[dict], block_size: int) -> dict | None:
    """The run's own τ on its prompts (pooled) and how it was counted: online decoding, or the
    offline walk over the reference completions (:func:`remote.contract.metrics.summarize`)."""
    from remote.contract.metrics import summarize

    summary = summarize(rows, block_size, None)
    if summary["tau_pooled"] is None:
        return None
    return {"tau_pooled": summary["tau_pooled"], "how": "online decoding" if "online" in summary else "offline walk"}


def gaps(report: dict, run: dict | None) -> list[str]:
    """One plain sentence per SpecForge τ of ``report["specforge"]``: its value and how it is
    counted, against our offline τ estimate (the training way) and the run's own τ, and why they differ."""
    sf = report.get("specforge")
    if not sf:
        return []
    ours = f"our offline τ estimate {report['tau_estimate']['training']:.2f} (the training way)"
    if run:
        ours += f" and the run's τ {run['tau_pooled']:.2f} ({run['how']}, pooled)"
    why = {DFLASH: "the same drafts scored at the same positions as ours",
           DOMINO: "SpecForge's head reads the reference's previous tokens (teacher-forced), ours its own "
                   "previous drafts, so a draft after a miss may still count",
           DSPARK: "SpecForge's slot i scores token p+1+i, the anchor's own slot first (B positions), where "
                   "spec_generate and this worker draft token p+1+k from slot k+1 (B−1 drafts); its Markov head "
                   "reads the reference's previous tokens (teacher-forced), ours its own drafts"}[sf["family"]]
    out = [f"SpecForge's accuracy-derived τ {sf['accuracy_tau']:.2f} (1 + Σ cumulative product of its per-position "
           f"accuracy, {sf['denominator']} positions) vs {ours}: {why}"]
    if "accept_len" in sf:
        out.append(f"SpecForge's accept_len {sf['accept_len']:.2f} (1 + the teacher-forced accepted prefix, mean over "
                   f"every anchor's block) vs {ours}: it averages every anchor, a decoding only those its cycles "
                   f"reach, and our estimate multiplies per-position accuracies")
    if "expected_tau" in sf:
        out.append(f"SpecForge's expected τ {sf['expected_tau']:.2f} (accept probability 1 − ½·L1(draft, target) at "
                   f"temperature 1, teacher-forced) vs {ours}: the accept probability is the overlap Σ min(q, p) of "
                   f"the two distributions, partial agreement counting and agreement on the argmax short of 1, where "
                   f"greedy acceptance is all or nothing on the argmax")
    if "confidence_tau" in sf:
        diff = sf["confidence_tau"] - sf["expected_tau"]
        out.append(f"the confidence head's τ {sf['confidence_tau']:.2f} (1 + Σ cumulative product of σ(head), "
                   f"teacher-forced) vs SpecForge's expected τ {sf['expected_tau']:.2f}, which it is trained to "
                   f"predict: {'over' if diff > 0 else 'under'}-predicts by {abs(diff):.2f}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m remote.parity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--results", required=True, help="results.jsonl of a run (prompt and reference completions)")
    ap.add_argument("--out", required=True, help="parity.json to write")
    ap.add_argument("--max-anchors", type=int, default=2000)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    args = ap.parse_args(argv)
    from contextlib import redirect_stdout

    import torch

    from remote.drafters.checkpoint import CheckpointError, load_drafter
    from remote.target.model import load_target
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    try:
        with redirect_stdout(sys.stderr):       # what a library prints never mixes with the report
            target = load_target(args.target, device, dtype)
            drafter, _ = load_drafter(args.drafter, device=device, dtype=getattr(torch, dtype))
            rows = [json.loads(line) for line in Path(args.results).read_text().splitlines() if line.strip()]
            pairs = [pair for row in rows for pair in _turns(row)]
            report = parity(drafter, target, pairs, args.max_anchors)
            if "specforge" in report:
                report["gaps"] = gaps(report, run_tau(rows, drafter.block_size))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report.update(device=device, dtype=dtype, drafter=args.drafter, target=args.target)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
