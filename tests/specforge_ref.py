"""SpecForge 0.2.0's own drafters and decoding loop, as a command: run with the python of
``.ci/specforge-env`` (torch 2.13 CPU, transformers 5.8.1, specforge --no-deps), never imported by the
project's tests (they run it as a subprocess: tests/test_specforge_ref.py). One JSON object on stdout.

    build FAMILY OUT --target DIR --seed S [--block-size 8] [--layers 1] [--set KEY=VALUE ...]
        FAMILY: dflash | domino | dspark. A tiny drafter made with SpecForge's class from a config
        made the way SpecForge generates one from a target (training/model_loading.py
        _generate_draft_config + the family's populate: the target's architecture fields, qwen3,
        untied, num_target_layers, full-attention layer_types, dflash_config with target_layer_ids
        from build_target_layer_ids), the family's dflash_config keys, then the overrides
        (``--set dflash_config.markov_rank=4``, ``--set rms_norm_eps=1e-5``; VALUE is JSON, else a
        string). Weights: the class's own init under torch.manual_seed(S) (normal with std
        initializer_range, which SpecForge copies from the target), then the Domino/DSpark
        heads redrawn at normal std 0.5 (so they change the drafts), saved with save_pretrained.
        -> {"out": OUT, "config": <OUT/config.json>, "tensors": [names]}
    generate DRAFTER TARGET --prompts JSON --max-new-tokens N [--temperature T] [--seed S] [--stop ID ...]
             [--warmup]
        The drafter's class chosen by dflash_config.projector_type (none/dflash, domino, dspark),
        ``from_pretrained``; the target AutoModelForCausalLM in float32 on CPU; for each prompt (a
        list of ids) torch.manual_seed(S) then ``drafter.spec_generate(target, ids, N, stops, T)``.
        -> {"outputs": [[ids after the prompt]], "acceptance_lengths": [[per cycle]],
            "wall_s": [per prompt], "cpu_s": [per prompt], "threads": torch's intra-op threads}
        (spec_generate's output: cut to N, every mask-token id dropped, cut after the first stop id;
        the lengths as its loop counts them: the last cycle's whole, past N or past a stop.)
        wall_s: time.perf_counter around each spec_generate call alone (no loading, no JSON; the
        lengths' read-back below costs one frame walk per call, no tracing); cpu_s: time.process_time
        around it (all of the process's threads; steadier than wall time on a loaded machine).
        ``--warmup``: one untimed call on the first prompt before the timed ones (the first call of
        a process pays for lazy initialisation). benchmarks/bench_online.py --specforge times ours
        against it.
    logits DRAFTER TARGET --prompts JSON
        The logits of the first block a plain DFlash drafter drafts for each prompt, computed as
        spec_generate computes them: the target's prefill, its greedy token as the block's anchor, the
        drafter over the prompt's target features (``is_causal=False``, no mask) and ``target.lm_head``
        over the block's last B - 1 slots. -> {"logits": [[B - 1 rows of vocab_size floats] per prompt]}
        (the families draft position by position from the tokens chosen: no one block of logits)
    metrics DRAFTER TARGET --sequences JSON
        SpecForge's training-side metrics of the drafter on sequences (JSON: a list of
        {"ids": [...], "prompt_len": P}; the loss mask 1 on the completion, positions >= P), computed by
        SpecForge's own code: its training wrapper of the family (OnlineDFlashModel, OnlineDominoModel
        with the drafter's shift_label, OnlineDSparkModel; sdpa, num_anchors the longest sequence, so
        that _sample_anchor_positions takes every supervised anchor, in order) over the target's
        features (extract_context_feature of its hidden states; DSpark: target_last_hidden_states its
        last, normed one), each sequence a TrainBatch through the family's train strategy, the whole
        set through specforge.eval.Evaluator. The family's objective (``_<family>_objective_chunk_terms``,
        objective_chunk_blocks 0: one call per sequence) is wrapped to keep its inputs and the terms it
        returns; its own terms are summed over the sequences before any ratio. Per block column
        (slot) the correct count and the denominator: DSpark's own ``correct_position_num`` /
        ``position_den``; for DFlash and Domino (which sum only) the same objective called again with
        the accuracy mask kept at that one column. DSpark: ``tau_probabilistic`` (Σ tau_num / Σ tau_den)
        and, with a confidence head, ``confidence_tau``: the drafter's ``predict_confidence`` on the
        objective's own hidden states and previous tokens, σ of it in place of the accept probability in
        tau_probabilistic's reduction (1 + Σ cumprod(σ · eval_mask) per block, mean over the blocks with a
        position; SpecForge computes no such number: this reduction is the harness's).
        -> {"family", "evaluator": {eval/* of Evaluator.run}, "correct", "denominator",
            "per_position": {"correct": [B], "count": [B]}, "accept_len" (Domino: Σ accept_num / Σ accept_den),
            "expected_tau", "confidence_tau" (DSpark)}
    batch JOBS
        JOBS: a JSON file, a list of command lines (lists of strings: build ... or generate ...),
        run one after another in this one process (importing torch, transformers and SpecForge takes
        ~5 s of a command's ~6 on 2 cores). -> {"results": [each command's object, or
        {"error": "...", "traceback": "..."} where it failed]}

Acceptance lengths: spec_generate keeps them in a local list and returns only the ids. Without
touching its code they are read back from the target cache it makes: each cycle ends with
``past_key_values_target.crop(start)`` after ``start += acceptance_length + 1``, so the target's
forward is wrapped to catch that cache (the prefill's) and record every crop; the lengths are the
differences of the crop points from the prompt length. As a check, the list spec_generate itself
built is read from its frame once it has returned and must equal them (the command fails otherwise):
the frame is found from inside the prefill's target forward (walking up to spec_generate's code
object) and kept; a frame object kept past its return keeps its locals. (Not sys.settrace: tracing
every Python call slowed spec_generate by ~15-20% here, which wall_s would have counted.)
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

FAMILIES = ("dflash", "domino", "dspark")
HEAD_STD = 0.5       # the Domino/DSpark heads' weights: large enough that they decide the drafts
# the family's dflash_config keys (SpecForge has no defaults for emb_dim / gru_hidden_dim)
FAMILY_DEFAULTS = {
    "dflash": {},
    "domino": {"projector_type": "domino", "emb_dim": 32, "gru_hidden_dim": 32},
    "dspark": {"projector_type": "dspark", "markov_rank": 8, "markov_head_type": "vanilla",
               "enable_confidence_head": True, "confidence_head_with_markov": False, "attention_mode": "gqa"},
}
# the target's fields a generated SpecForge draft config copies (training/model_loading.py)
TARGET_FIELDS = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                 "max_position_embeddings", "rms_norm_eps", "hidden_act", "initializer_range", "attention_bias",
                 "attention_dropout", "head_dim", "rope_theta", "rope_scaling", "bos_token_id", "eos_token_id",
                 "pad_token_id", "sliding_window", "use_sliding_window", "max_window_layers")


def _quiet():
    # llama3_eagle.py (imported by specforge.modeling.draft's __init__) warns that flash_attn is missing
    warnings.filterwarnings("ignore", message="flash_attn is not found")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers.utils import logging

    logging.disable_progress_bar()      # save_pretrained's "Writing model shards" bar


def _classes():
    _quiet()
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from specforge.modeling.draft.domino import DominoDraftModel
    from specforge.modeling.draft.dspark import DSparkDraftModel

    return {"dflash": DFlashDraftModel, "domino": DominoDraftModel, "dspark": DSparkDraftModel}


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def draft_config(family: str, target_dir: str, block_size: int, layers: int, overrides: list[str]):
    from specforge.modeling.draft.dflash import build_target_layer_ids
    from transformers import AutoConfig, Qwen3Config

    target = AutoConfig.from_pretrained(target_dir)
    target = getattr(target, "text_config", target)
    payload = {}
    for field in TARGET_FIELDS:
        value = getattr(target, field, None)
        if value is not None:
            payload[field] = str(value).replace("torch.", "") if isinstance(value, torch.dtype) else value
    payload.update(architectures=[_classes()[family].__name__], model_type="qwen3", num_hidden_layers=layers,
                   tie_word_embeddings=False, use_cache=True, num_target_layers=target.num_hidden_layers,
                   block_size=block_size, layer_types=["full_attention"] * layers, sliding_window=None,
                   use_sliding_window=False)
    if payload.get("pad_token_id") is None:
        payload["pad_token_id"] = 0
    payload["draft_vocab_size"] = payload["vocab_size"]
    payload["dflash_config"] = {"target_layer_ids": build_target_layer_ids(target.num_hidden_layers, layers),
                                "mask_token_id": target.vocab_size - 1, **FAMILY_DEFAULTS[family]}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
        if key.startswith("dflash_config."):
            payload["dflash_config"][key.removeprefix("dflash_config.")] = _value(text)
        else:
            payload[key] = _value(text)
    if payload["num_hidden_layers"] != len(payload["layer_types"]):   # --set num_hidden_layers=N alone
        payload["layer_types"] = ["full_attention"] * payload["num_hidden_layers"]
    return Qwen3Config.from_dict(payload)


def build(args) -> dict:
    from safetensors import safe_open

    cls = _classes()[args.family]
    config = draft_config(args.family, args.target, args.block_size, args.layers, args.set)
    torch.manual_seed(args.seed)
    model = cls(config).float().eval()
    gen = torch.Generator().manual_seed(args.seed + 1)
    heads = [getattr(model, name, None) for name in ("prefix_gru", "embed_proj", "markov_head", "confidence_head")]
    with torch.no_grad():
        for head in heads:
            if head is not None:
                for p in head.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * HEAD_STD)
    out = Path(args.out)
    model.save_pretrained(out, safe_serialization=True)
    tensors = []
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            tensors += list(st.keys())
    return {"out": str(out), "config": json.loads((out / "config.json").read_text()), "tensors": sorted(tensors)}


def load_drafter(path: str):
    config = json.loads((Path(path) / "config.json").read_text())
    projector = (config.get("dflash_config") or {}).get("projector_type") or "dflash"
    classes = _classes()
    if projector not in classes:
        raise SystemExit(f"{path}: dflash_config.projector_type {projector!r} is none of {sorted(classes)}")
    return classes[projector].from_pretrained(path, dtype=torch.float32).eval()


class CycleRecorder:
    """Wraps ``target.forward``: the first call of a spec_generate (a cache not seen before) is the
    prefill, the others are verify calls; every ``crop`` of that cache is recorded. At the prefill
    the frame of ``code`` (spec_generate's) that made the call is kept in ``frame`` (own_lengths)."""

    def __init__(self, target, code=None):
        self.cache, self.crops, self.verifies = None, [], 0
        self.code, self.frame = code, None
        forward = target.forward

        def wrapped(*args, **kwargs):
            cache = kwargs.get("past_key_values")
            if cache is not None and cache is not self.cache:
                self.cache, self.crops, self.verifies = cache, [], 0
                frame = sys._getframe(1)
                while frame is not None and frame.f_code is not self.code:
                    frame = frame.f_back
                self.frame = frame
                crop = cache.crop

                def recording_crop(length):
                    self.crops.append(int(length))
                    return crop(length)

                cache.crop = recording_crop
            else:
                self.verifies += 1
            return forward(*args, **kwargs)

        target.forward = wrapped

    def lengths(self, prompt_len: int) -> list[int]:
        if len(self.crops) != self.verifies:
            raise RuntimeError(f"{self.verifies} verify calls but {len(self.crops)} target-cache crops")
        points = [prompt_len, *self.crops]
        return [b - a for a, b in zip(points, points[1:])]


def own_lengths(call, recorder: CycleRecorder):
    """``(result, the acceptance_lengths local of the frame of recorder.code when it returned)``: the
    frame the recorder kept at the call's prefill, read after the return (None when there was none)."""
    recorder.frame = None
    result = call()
    frame, recorder.frame = recorder.frame, None
    if frame is None:
        return result, None
    return result, list(frame.f_locals.get("acceptance_lengths") or [])


def generate(args) -> dict:
    from transformers import AutoModelForCausalLM

    drafter = load_drafter(args.drafter)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    prompts = json.loads(Path(args.prompts).read_text())
    recorder = CycleRecorder(target, inspect.unwrap(type(drafter).spec_generate).__code__)
    outputs, lengths, wall, cpu = [], [], [], []
    for i, prompt in enumerate(prompts):
        if drafter.mask_token_id in prompt:
            # spec_generate drops every mask-token id from its result, the prompt's too
            # (output_ids[:, output_ids[0] != self.mask_token_id]): the prompt's end would be lost
            raise SystemExit(f"a prompt holds the drafter's mask_token_id {drafter.mask_token_id}: {prompt}")
        ids = torch.tensor([prompt], dtype=torch.long)

        def call():
            return drafter.spec_generate(target, ids, args.max_new_tokens, args.stop or None, args.temperature)

        if i == 0 and args.warmup:
            torch.manual_seed(args.seed)
            call()                                      # untimed, its result dropped
        torch.manual_seed(args.seed)
        c0, t0 = time.process_time(), time.perf_counter()
        out, own = own_lengths(call, recorder)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        recovered = recorder.lengths(len(prompt))
        if own != recovered:
            raise RuntimeError(f"acceptance lengths from the cache crops {recovered} != spec_generate's own {own}")
        outputs.append(out[0, len(prompt):].tolist())
        lengths.append(recovered)
    return {"outputs": outputs, "acceptance_lengths": lengths, "wall_s": wall, "cpu_s": cpu, "threads": torch.get_num_threads()}


def logits(args) -> dict:
    from specforge.modeling.draft.dflash import extract_context_feature
    from transformers import AutoModelForCausalLM, DynamicCache

    drafter = load_drafter(args.drafter)
    if type(drafter) is not _classes()["dflash"]:
        raise SystemExit(f"{args.drafter}: a {type(drafter).__name__} drafts position by position; logits is for "
                         f"plain DFlash drafters")
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    B, out = drafter.block_size, []
    with torch.inference_mode():
        for prompt in json.loads(Path(args.prompts).read_text()):
            n = len(prompt)
            prefill = target(torch.tensor([prompt]), position_ids=torch.arange(n)[None], past_key_values=DynamicCache(),
                             use_cache=True, logits_to_keep=1, output_hidden_states=True)
            block = torch.full((1, B), drafter.mask_token_id, dtype=torch.long)
            block[0, 0] = prefill.logits[0, -1].argmax()
            hidden = drafter(target_hidden=extract_context_feature(prefill.hidden_states, drafter.target_layer_ids),
                             noise_embedding=target.model.embed_tokens(block), position_ids=torch.arange(n + B)[None],
                             past_key_values=DynamicCache(), use_cache=True, is_causal=False)
            out.append(target.lm_head(hidden[:, -B + 1:])[0].tolist())
    return {"logits": out}


def metrics(args) -> dict:
    from specforge.algorithms.common import dflash_family_model as wrappers
    from specforge.eval import Evaluator
    from specforge.modeling.draft.dflash import extract_context_feature
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.strategies import base as strategies
    from transformers import AutoModelForCausalLM

    drafter = load_drafter(args.drafter)
    family = {cls: name for name, cls in _classes().items()}[type(drafter)]
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    sequences = json.loads(Path(args.sequences).read_text())
    common = dict(draft_model=drafter, target_lm_head=target.lm_head, target_embed_tokens=target.model.embed_tokens,
                  mask_token_id=drafter.mask_token_id, block_size=drafter.block_size, attention_backend="sdpa",
                  num_anchors=max(len(s["ids"]) for s in sequences), objective_chunk_blocks=0)
    if family == "dflash":
        model = wrappers.OnlineDFlashModel(**common)
        strategy = strategies.DFlashTrainStrategy(model)
    elif family == "domino":
        model = wrappers.OnlineDominoModel(**common, shift_label=bool(drafter.shift_label))
        strategy = strategies.DominoTrainStrategy(model)
    else:
        model = wrappers.OnlineDSparkModel(**common)
        strategy = strategies.DSparkTrainStrategy(model)
    model.eval()
    name = f"_{family}_objective_chunk_terms"
    objective, calls = getattr(model, name), []

    def kept(*terms_args):
        terms = objective(*terms_args)
        calls.append((terms_args, terms))
        return terms

    setattr(model, name, kept)
    batches = []
    with torch.no_grad():
        for i, seq in enumerate(sequences):
            ids = torch.tensor([seq["ids"]])
            out = target(ids, output_hidden_states=True)
            tensors = {"input_ids": ids, "loss_mask": (torch.arange(ids.shape[1]) >= seq["prompt_len"]).float()[None],
                       "hidden_states": extract_context_feature(out.hidden_states, drafter.target_layer_ids)}
            if family == "dspark":
                tensors["target_last_hidden_states"] = out.hidden_states[-1]
            batches.append(TrainBatch(sample_ids=[str(i)], strategy=family, tensors=tensors))
    evaluated = Evaluator().run(strategy.forward_loss, batches)
    if len(calls) != len(sequences):
        raise RuntimeError(f"{len(calls)} objective calls for {len(sequences)} sequences")

    def total(index: int) -> torch.Tensor:
        return sum(terms[index].double() for _, terms in calls)

    result = {"family": family, "evaluator": {k: v for k, v in evaluated.items()}}
    B = drafter.block_size
    with torch.no_grad():
        if family == "dspark":        # (.., correct_num 4, eval_den 5, .., correct_position_num 7, position_den 8, .., tau_num 12, tau_den 13)
            result.update(correct=float(total(4)), denominator=float(total(5)),
                          per_position={"correct": total(7).tolist(), "count": total(8).tolist()},
                          expected_tau=float(total(12) / total(13)))
            if drafter.confidence_head is not None:
                tau, blocks = 0.0, 0
                for (hidden, prev_ids, _, _, eval_mask, _), _ in calls:
                    confidence = drafter.predict_confidence(hidden, prev_token_ids=prev_ids).sigmoid()
                    valid = eval_mask.any(-1)
                    tau += float(((confidence * eval_mask).cumprod(-1).sum(-1) + 1.0)[valid].sum())
                    blocks += int(valid.sum())
                result["confidence_tau"] = tau / blocks
        else:
            # DFlash (loss_num, loss_den, correct_num 2, accuracy_den 3); its accuracy mask: weight_mask (index 2)
            # Domino (.., correct_num 3, .., accuracy_den 5, accept_num 6, .., accept_den 8); its mask: eval_weight_mask (4)
            at, correct_i, den_i = (2, 2, 3) if family == "dflash" else (4, 3, 5)
            correct, count = [0.0] * B, [0.0] * B
            for terms_args, _ in calls:
                for k in range(B):
                    one = torch.zeros(B)
                    one[k] = 1.0
                    narrowed = list(terms_args)
                    narrowed[at] = terms_args[at] * one
                    terms = objective(*narrowed)
                    correct[k] += float(terms[correct_i])
                    count[k] += float(terms[den_i])
            result.update(correct=float(total(correct_i)), denominator=float(total(den_i)),
                          per_position={"correct": correct, "count": count})
            if family == "domino":
                result["accept_len"] = float(total(6) / total(8))
    return result


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specforge_ref", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("family", choices=FAMILIES)
    b.add_argument("out")
    b.add_argument("--target", required=True)
    b.add_argument("--seed", type=int, required=True)
    b.add_argument("--block-size", type=int, default=8)
    b.add_argument("--layers", type=int, default=1)
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    g = sub.add_parser("generate")
    g.add_argument("drafter")
    g.add_argument("target")
    g.add_argument("--prompts", required=True)
    g.add_argument("--max-new-tokens", type=int, required=True)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop", type=int, nargs="+", action="extend", default=[], metavar="ID")
    g.add_argument("--warmup", action="store_true", help="one untimed call on the first prompt first")
    lg = sub.add_parser("logits")
    lg.add_argument("drafter")
    lg.add_argument("target")
    lg.add_argument("--prompts", required=True)
    mt = sub.add_parser("metrics")
    mt.add_argument("drafter")
    mt.add_argument("target")
    mt.add_argument("--sequences", required=True)
    j = sub.add_parser("batch")
    j.add_argument("jobs")
    return parser


def batch(jobs: str) -> dict:
    import traceback

    results = []
    for argv in json.loads(Path(jobs).read_text()):
        try:
            args = parser().parse_args(argv)
            if args.command == "batch":
                raise SystemExit("a batch cannot hold a batch")
            results.append(COMMANDS[args.command](args))
        except (Exception, SystemExit) as e:
            results.append({"error": f"{' '.join(map(str, argv))}: {type(e).__name__}: {e}",
                            "traceback": traceback.format_exc()})
    return {"results": results}


COMMANDS = {"build": build, "generate": generate, "logits": logits, "metrics": metrics,
            "batch": lambda args: batch(args.jobs)}


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    result = COMMANDS[args.command](args)
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
