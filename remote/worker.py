"""The eval worker: ``python -m remote.worker --target DIR --drafter DIR [options]``.

Runs on the eval host (or by hand on any GPU box). Loads the target and the drafter, gets a
reference completion per prompt (SGLang's output when ``--sglang`` is given, otherwise local
decoding with the loaded target; greedy, or sampled with ``--temperature``), evaluates the drafter
(``offline`` walk or real ``online`` speculative decoding) and writes ``results.jsonl`` (one line
per prompt, flushed as it finishes), ``summary.json`` and ``env.json`` into ``--out`` (format:
docs/run-format.md). With ``--engine`` each prompt is also served by the host's engine (vLLM or
SGLang, with and without the drafter: :mod:`remote.engines.phase`), its own counters recorded in
the prompt's row beside our online decoding. Progress: one JSON event per line on stdout; human-readable logs on stderr.

Defaults follow z-lab's benchmark: thinking off (``--thinking on`` to enable), stop tokens
``generation_config.eos_token_id`` (else the tokenizer's eos), greedy unless ``--temperature``.
Sampled runs seed torch's generator per prompt from ``--seed`` and the prompt id, so a resumed or
sharded run draws the same numbers for the same prompt.

Exit status (:mod:`remote.contract.exits`): 0 done, 1 a check failed (drafter/target mismatch, bad prompts,
a transformers the host must not decode with, SGLang down, the engine missing, refusing its
settings or dying), 2 bad usage (missing folders, ...), 3 an
unexpected error during the run (finished prompts kept), 4 invalid results: a greedy online output
differs from the target's own greedy output other than at a near-tie (the row is kept with its
``divergence``, the run stops there and ``summary.json`` says ``invalid`` and carries no τ), or the
drafter's outputs on a prompt are NaN or infinite (the run stops at that prompt, no row for it).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from remote.contract import events, exits
from remote.contract.settings import CPU_WORKERS_ENV, EvalSettings, SettingsError, add_arguments
from remote.engines.server import EngineError


class WorkerError(Exception):
    def __init__(self, message: str, code: int = exits.CHECK_FAILED):
        super().__init__(message)
        self.code = code


EVENTS = None      # the stream events go to: stdout as main() found it (whatever else prints goes to stderr)


def emit(event: str, **fields) -> None:
    print(json.dumps({events.KEY: event, **fields}), file=EVENTS or sys.stdout, flush=True)


def log(message: str) -> None:
    print(f"[worker {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class RunContext:
    """One worker run: its settings (the value every side shares, checked when it was made) and what
    only this worker knows: its folders, its shard, where its references and its engine are."""
    settings: EvalSettings
    target: str
    drafter: str
    out: Path
    sglang: str | None = None
    resume: bool = False
    block_size: int | None = None
    shard: str | None = None
    shard_index: int = 0
    shard_count: int = 1
    host_label: str | None = None
    checked: bool = False
    engine_kind: str | None = None
    engine_python: str | None = None
    engine_url: str | None = None
    engine_args: tuple[str, ...] = ()

    @property
    def sampling(self):
        from remote.drafters.sampling import Sampling
        return Sampling(self.settings.temperature, self.settings.top_p, self.settings.top_k)


def parse_args(argv=None) -> RunContext:
    p = argparse.ArgumentParser(prog="python -m remote.worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target model folder (HF format; a Qwen3.5/3.6 VLM loads as text-only)")
    p.add_argument("--drafter", required=True, help="drafter checkpoint folder (z-lab, speculators or state-dict format)")
    p.add_argument("--out", required=True, help="output folder")
    add_arguments(p)
    p.add_argument("--sglang", default=None, help="SGLang URL for reference completions (as seen from this host)")
    p.add_argument("--resume", action="store_true", help="keep finished prompts in --out and do the rest")
    p.add_argument("--block-size", type=int, default=None, help="refuse to run unless the drafter uses this block size")
    p.add_argument("--shard", default=None, metavar="K/N",
                   help="evaluate only prompts K, K+N, K+2N, ... of the selected ones (0-based; sharding over hosts)")
    p.add_argument("--host-label", default=None, help="host name recorded in env.json")
    p.add_argument("--checked", action="store_true",
                   help="the drafter/target check and the library self-test already passed on this host for this "
                        "run (`python -m remote.preflight`, as dflash-ops runs it just before): not repeated")
    from remote.engines.phase import add_arguments as add_engine_arguments, argument_problems
    add_engine_arguments(p)
    args = p.parse_args(argv)
    try:
        settings = EvalSettings.from_args(args)
    except SettingsError as e:
        p.error(str(e))
    for problem in argument_problems(args, settings):
        p.error(problem)
    shard_index, shard_count = 0, 1
    if args.shard:
        try:
            shard_index, shard_count = (int(x) for x in args.shard.split("/"))
            assert 0 <= shard_index < shard_count
        except (ValueError, AssertionError):
            p.error(f"--shard must be K/N with 0 <= K < N, got {args.shard!r}")
    return RunContext(settings, args.target, args.drafter, Path(args.out), args.sglang, args.resume, args.block_size,
                      args.shard, shard_index, shard_count, args.host_label, args.checked, args.engine_kind,
                      args.engine_python, args.engine_url, tuple(args.engine_arg))


def prompt_seed(seed: int, row_id: str) -> int:
    """The torch seed of one prompt: the run's ``--seed`` and the prompt id."""
    import hashlib
    return int.from_bytes(hashlib.sha256(f"{seed}:{row_id}".encode()).digest()[:8], "big") & (2**63 - 1)


# ----------------------------------------------------------------------------- output folder

def read_finished(path: Path) -> list[dict]:
    """Rows already in results.jsonl; a torn last line (killed mid-write) is dropped from the file."""
    if not path.exists():
        return []
    rows, good = [], 0
    raw = path.read_bytes()
    for line in raw.splitlines(keepends=True):
        try:
            rows.append(json.loads(line))
            good += len(line)
        except json.JSONDecodeError:
            break
    if good != len(raw):
        with open(path, "r+b") as f:
            f.truncate(good)
    return rows


def weight_hashes(ckpt) -> dict[str, str]:
    """sha256 per weight file, reused from a sync manifest in the folder when it covers the file
    with the same size."""
    from remote.drafters.checkpoint import MANIFEST, sha256_file

    manifest: dict = {}
    if (ckpt.path / MANIFEST).exists():
        try:
            manifest = {e["path"]: e for e in json.loads((ckpt.path / MANIFEST).read_text()).get("files", [])}
        except (json.JSONDecodeError, KeyError, TypeError):
            pass
    out = {}
    for f in ckpt.weight_files:
        entry = manifest.get(f.name)
        out[f.name] = entry["sha256"] if entry and entry.get("size") == f.stat().st_size else sha256_file(f)
    return out


def versions() -> dict:
    from remote.contract.versions import installed_versions

    return {"python": platform.python_version(), **installed_versions(
        ("torch", "transformers", "safetensors", "tokenizers", "flash-linear-attention", "triton"))}


# ----------------------------------------------------------------------------- the run

STOP_RULE = "generation_config.eos_token_id, else the tokenizer's eos_token_id (z-lab benchmark.py)"


def stop_ids(tokenizer, target) -> list[int]:
    """Stop tokens as z-lab's benchmark sets them (:data:`STOP_RULE`)."""
    eos = getattr(target.generation_config, "eos_token_id", None) or (tokenizer.eos_token_id if tokenizer else None)
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]


def share_cores(torch) -> None:
    """A CPU worker beside others of its run on one host takes its share of the cores as torch
    threads (torch's default, a thread per core in every worker, oversubscribes them: several times
    slower); an OMP_NUM_THREADS the user set wins."""
    workers = int(os.environ.get(CPU_WORKERS_ENV) or 1)
    if workers > 1 and not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def preflight(ctx, device: str) -> None:
    """The drafter/target check and the library self-test (:mod:`remote.preflight`), unless
    ``--checked`` says they just passed for this run."""
    from remote.inspect import inspect
    from remote.preflight import runtime_problems

    if ctx.checked:
        return
    report = inspect(ctx.drafter, ctx.target, ctx.block_size)
    problems = report["problems"] or runtime_problems(ctx.target, device)
    if problems:
        raise WorkerError("pre-flight check failed:\n  - " + "\n  - ".join(problems))


def run(ctx) -> dict:
    for flag, value in (("--target", ctx.target), ("--drafter", ctx.drafter)):
        if not Path(value).expanduser().is_dir():
            raise WorkerError(f"{flag} {value}: no such folder", code=exits.USAGE)
    from remote.suites.prompts import load_suite
    from remote.suites.prompts import PromptError
    try:
        suite = load_suite(ctx.settings.suite, limit=ctx.settings.prompts)
    except PromptError as e:
        raise WorkerError(str(e)) from None
    if not suite.rows:
        raise WorkerError(f"suite {ctx.settings.suite}: no prompts")
    rows_to_do = suite.rows[ctx.shard_index::ctx.shard_count]
    client = None
    if ctx.sglang:
        from remote.contract.credentials import AUTH_ENV
        from remote.engines.sglang_client import SGLangClient, SGLangError
        client = SGLangClient(ctx.sglang, auth=os.environ.pop(AUTH_ENV, None))
        try:
            client.health()
        except SGLangError as e:
            raise WorkerError(str(e)) from None

    out = Path(ctx.out)
    results_path = out / "results.jsonl"
    if results_path.exists() and results_path.stat().st_size and not ctx.resume:
        raise WorkerError(f"{results_path} already has results: pass --resume to continue it, or use another --out", exits.USAGE)
    out.mkdir(parents=True, exist_ok=True)
    finished = read_finished(results_path) if ctx.resume else []
    done_ids = {r["id"] for r in finished}

    import torch
    device = ctx.settings.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise WorkerError("--device cuda but torch sees no CUDA device (use --device cpu)", exits.USAGE)
    dtype = ctx.settings.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    if device == "cpu":
        share_cores(torch)
    preflight(ctx, device)
    phase = start_engine(ctx, out, device, dtype) if ctx.settings.engine else None
    try:
        return run_rows(ctx, out, suite, rows_to_do, finished, done_ids, results_path, client, device, dtype, phase)
    finally:
        if phase is not None:
            phase.stop()


def start_engine(ctx, out: Path, device: str, dtype: str):
    """The engine phase's servers started (not waited for: the models load meanwhile), or the
    running server checked; a SIGTERM (``cancel``) from here on stops them before the worker ends:
    they run in process groups of their own, which the signal to the worker's group does not reach."""
    import signal

    from remote.drafters.checkpoint import open_checkpoint
    from remote.engines.phase import EnginePhase

    phase = EnginePhase(ctx.engine_kind, ctx.target, ctx.drafter, out,
                        open_checkpoint(ctx.drafter).config.num_drafts, python=ctx.engine_python,
                        url=ctx.engine_url, extra_args=ctx.engine_args, dtype=dtype, seed=ctx.settings.seed,
                        device=device, log=log)

    def on_term(signum, frame):
        log("SIGTERM: stopping the engine servers")
        phase.stop(grace=3.0)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    emit(events.PHASE, phase="starting the engine")
    log(f"engine: {ctx.engine_kind} " + (f"at {ctx.engine_url}" if ctx.engine_url else f"from {ctx.engine_python}"))
    return phase.launch()


def run_rows(ctx, out, suite, rows_to_do, finished, done_ids, results_path, client, device, dtype, phase) -> dict:
    import torch

    from remote.drafters.checkpoint import load_drafter
    from remote.drafters.dflash import NonFiniteOutput
    from remote.target.memory import check as memory_check, identity as target_identity
    from remote.suites.prompts import reference_turns
    from remote.target.model import features_device, gdn_kernel_path, load_target
    settings = ctx.settings
    plan = memory_check(ctx.target, ctx.drafter, rows_to_do, settings.max_new_tokens, device, dtype,
                        settings.target_devices, settings.max_memory)
    if not plan.fits:
        raise WorkerError(plan.refusal())
    log(f"memory plan: {plan.describe()}")
    devices = [d for d, _ in plan.devices] if settings.target_devices else None
    if devices and len(devices) > 1:
        import importlib.util
        if importlib.util.find_spec("accelerate") is None:
            raise WorkerError(f"--target-devices {settings.target_devices}: splitting the target needs accelerate in "
                              f"{sys.executable} (pip install --no-deps accelerate psutil)", exits.USAGE)
    log(f"loading target {ctx.target} on {', '.join(devices) if devices else device} ({dtype})")
    emit(events.PHASE, phase="loading target", device=device, dtype=dtype)   # the slow part before `start`
    target = load_target(ctx.target, device, dtype, devices=devices,
                         max_memory={d: free for d, free in plan.devices} if devices else None)
    for p in target.parameters():
        p.requires_grad_(False)
    from remote.drafters.checkpoint import open_checkpoint
    feature_device = features_device(target, open_checkpoint(ctx.drafter).config.target_layer_ids) if devices else device
    drafter, ckpt = load_drafter(ctx.drafter, device=feature_device, dtype=getattr(torch, dtype))
    decoding = Decoding.of(settings, ckpt)
    if settings.mode == "online" and decoding.budgets:
        from remote.decode.tree import tree_problem
        problem = tree_problem(target, drafter.config)
        if problem:
            raise WorkerError(problem, exits.USAGE)
    log(f"counted by {decoding.semantics}'s rules" + (f"; {decoding.note}" if decoding.note else ""))
    tokenizer = None
    try:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(ctx.target, trust_remote_code=False)
    except Exception as e:  # rows with input_ids need no tokenizer
        if any(r.input_ids is None for r in rows_to_do):
            raise WorkerError(f"cannot load the target's tokenizer from {ctx.target}: {e}")
    stops = stop_ids(tokenizer, target)
    if phase is not None:
        emit(events.PHASE, phase="waiting for the engine")
        phase.wait()

    env = {"host": ctx.host_label or socket.gethostname(), "device": device,
           "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
           "cpu_threads": torch.get_num_threads() if device == "cpu" else None,
           "target_devices": sorted({str(d) for d in getattr(target, "hf_device_map", {}).values()}) or [device],
           "drafter_device": str(next(drafter.parameters()).device), "memory_plan": plan.to_dict(),
           "gpu": torch.cuda.get_device_name(device) if device.startswith("cuda") else None,
           "dtype": dtype, "kernel_path": gdn_kernel_path(target), "versions": versions(),
           "drafter": {**ckpt.describe(), "sha256": weight_hashes(ckpt)},
           "target": {"path": str(Path(ctx.target).resolve()), "model_type": target.config.model_type,
                      "num_hidden_layers": getattr(getattr(target.config, "text_config", target.config), "num_hidden_layers", None),
                      "identity": target_identity(ctx.target)},
           "suite": {"name": suite.name, "sha256": suite.sha256, "prompts": len(suite.rows),
                     "shard": ctx.shard, "ids": [r.id for r in rows_to_do]},
           "settings": {"mode": settings.mode, "max_new_tokens": settings.max_new_tokens, "max_blocks": settings.max_blocks,
                        "block_size": drafter.block_size, "verify_block": drafter.config.verify_block,
                        "enable_thinking": THINKING[settings.thinking], **ctx.sampling.describe(), "seed": settings.seed,
                        "sampling_seed": "per prompt: sha256('<seed>:<prompt id>'), first 8 bytes",
                        "ddtree_budgets": decoding.budgets,
                        "semantics": decoding.semantics,
                        "all_anchors": settings.all_anchors, "reference": "sglang" if client else "local",
                        "sglang_url": client.display if client else None, "stop_token_ids": stops, "stop_rule": STOP_RULE,
                        "engine": bool(settings.engine)},
           "worker": {"code_dir": str(Path(__file__).resolve().parents[1])},   # shipped: named by its digest
           "seed": settings.seed, "command": [sys.executable, "-m", "remote.worker",
                                          *(client.display if client and a == ctx.sglang else a for a in sys.argv[1:])],
           "started_at": now(), "finished_at": None}
    if phase is not None:
        env["engine"] = phase.describe()
    (out / "env.json").write_text(json.dumps(env, indent=2))

    emit(events.START, prompts=len(rows_to_do), done=len(done_ids), mode=settings.mode)
    rows = list(finished)
    invalid = next((reason for reason in map(invalid_reason, finished) if reason), None)
    with open(results_path, "a") as results:
        for index, row in enumerate(rows_to_do):
            if invalid:
                break
            if row.id in done_ids:
                continue
            t0 = time.perf_counter()
            try:
                result = evaluate_row(ctx, decoding, row, target, drafter, tokenizer, client, stops, reference_turns,
                                      phase)
            except NonFiniteOutput as e:        # the prompt stops; the rows before it are kept and reported
                invalid = nonfinite_reason(row.id, e)
                break
            results.write(json.dumps(result) + "\n")
            results.flush()
            os.fsync(results.fileno())
            rows.append(result)
            cycles = sum(len(r["acceptance_lengths"]) for r in rows)
            tau_running = sum(sum(r["acceptance_lengths"]) for r in rows) / cycles if cycles else None
            extra = {"expected_tau": result["expected"]["expected_tau"], "anchors": result["expected"]["anchors"]} \
                if "expected" in result else {}
            if "engine" in result:
                extra["engine_tau"] = result["engine"]["tau"]
            emit(events.PROMPT, id=row.id, index=index, done=len(rows), prompts=len(rows_to_do), cycles=result["cycles"],
                 tau=result["tau"], tau_running=tau_running, **extra)
            shown = result["tau"] if "expected" not in result else result["expected"]["expected_tau"]
            engine = result.get("engine")
            log(f"{row.id}: " + (f"{extra['anchors']} anchors, expected tau " if "expected_tau" in extra
                                 else f"{result['cycles']} cycles, tau ")
                + f"{'n/a' if shown is None else f'{shown:.2f}'}"
                + (f"; engine tau {engine['tau']:.2f}" if engine and engine["tau"] is not None else "")
                + (f" ({', '.join(engine['causes'])})" if engine and engine["causes"] else "")
                + f" ({time.perf_counter() - t0:.1f}s)")
            invalid = invalid_reason(result)

    from remote.contract.metrics import summarize
    order = {r.id: i for i, r in enumerate(suite.rows)}
    rows.sort(key=lambda r: order.get(r["id"], len(order)))
    summary = summarize(rows, drafter.block_size, settings.mode, max_length=drafter.config.verify_block)
    if invalid:
        summary = invalidated(summary, invalid)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    env["finished_at"] = now()
    (out / "env.json").write_text(json.dumps(env, indent=2))
    if invalid:
        raise WorkerError(invalid["message"], exits.INVALID)
    emit(events.END, summary=summary)
    return summary


def invalid_reason(row: dict) -> dict | None:
    """``summary.json``'s ``invalid`` when ``row`` diverged from the target's greedy output other than
    at a near-tie (its linear decoding or one of its DDTree budgets'): no τ measured on such a run is
    a result."""
    found = [("", row.get("divergence"))] + [(f"DDTree-{b} ", t.get("divergence"))
                                              for b, t in (row.get("ddtree") or {}).items()]
    which, d = next(((w, d) for w, d in found if d and not d["near_tie"]), ("", None))
    if d is None:
        return None
    turn = f" (turn {d['turn'] + 1})" if "turn" in d else ""
    return {"prompt": row["id"], **d,
            "message": f"greedy online {which}output differs from the target's own greedy output on prompt {row['id']}"
                       f"{turn} at {d['describe']}: speculative decoding is not exact on this host, so no τ of this "
                       f"run is a result (rows kept in results.jsonl; summary.json is marked invalid)"}


def nonfinite_reason(prompt: str, error) -> dict:
    """``summary.json``'s ``invalid`` when the drafter's outputs on ``prompt`` were NaN or infinite
    (a :class:`~remote.drafters.dflash.NonFiniteOutput`): no τ of such a drafter is a result."""
    return {"prompt": prompt, "head": error.head,
            "message": f"{error} on prompt {prompt}: no τ of this run is a result (the prompts before it kept in "
                       f"results.jsonl; summary.json is marked invalid)"}


def invalidated(summary: dict, invalid: dict) -> dict:
    """The summary of an invalid run: every τ and rate removed, the reason and the rows' count kept."""
    keep = ("mode", "block_size", "prompts", "responses")
    return {**{k: summary[k] for k in keep if k in summary}, "invalid": invalid}


THINKING = {"default": None, "on": True, "off": False}


@dataclass(frozen=True)
class Decoding:
    """What the loaded drafter makes of the settings: whose rules count the cycles and the DDTree
    budgets (offline: walked; online: each decoded; a family whose drafts depend on the one before
    has none unless asked, and refuses them asked)."""
    semantics: str
    budgets: list[int]
    note: str = ""

    @classmethod
    def of(cls, settings: EvalSettings, ckpt) -> "Decoding":
        from remote.contract import families

        cfg = ckpt.config
        refused = families.problems(settings, cfg.family, cfg.sequential)
        if refused:
            raise WorkerError(refused[0], exits.USAGE)
        return cls(settings.semantics or families.default_semantics(cfg.family),
                   *families.budgets(settings, cfg.family, cfg.sequential))


def evaluate_row(ctx, decoding: Decoding, row, target, drafter, tokenizer, client, stops, reference_turns,
                 phase=None) -> dict:
    """All turns of one prompt row -> one results row (docs/run-format.md)."""
    import torch
    from remote.contract.metrics import row_stats
    from remote.contract.settings import FULL_BLOCK_RULES
    from remote.decode.offline import SpecForgeRules, evaluate_offline
    from remote.decode.online import first_divergence, speculative_generate, target_decode
    from remote.decode.tree import tree_generate

    device = next(target.parameters()).device
    dtype = next(target.parameters()).dtype
    sampling = ctx.sampling
    turn_stats: list[dict] = []
    if not sampling.greedy:
        torch.manual_seed(prompt_seed(ctx.settings.seed, row.id))
    n_max = ctx.settings.max_new_tokens
    rules = SpecForgeRules(n_max, frozenset(stops)) if decoding.semantics in FULL_BLOCK_RULES else None
    # the reference past the output (offline, greedy: SpecForge's last cycles verify full blocks)
    overshoot = drafter.config.verify_block if rules and sampling.greedy else 0
    continuations: list[list[int]] = []

    def complete(prompt_ids: list[int]) -> list[int]:
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
        if ctx.settings.mode == "online":   # the baseline first, as z-lab's benchmark runs them
            base = target_decode(target, ids, ctx.settings.max_new_tokens, stops, sampling)
            spec = speculative_generate(target, drafter, ids, n_max, stops, sampling, decoding.semantics)
            def diverged(output_ids):
                return first_divergence(output_ids, base, str(dtype).replace("torch.", "")) if sampling.greedy else None
            trees = {}
            for b in decoding.budgets:      # each budget its own decoding of the prompt
                tree = tree_generate(target, drafter, ids, n_max, b, stops, sampling, decoding.semantics)
                trees[str(b)] = {"acceptance_lengths": tree.acceptance_lengths, "output_ids": tree.output_ids,
                                 "wall_s": tree.wall_s, "cycles_s": tree.cycles_s, "stage_s": tree.stage_s,
                                 "divergence": diverged(tree.output_ids)}
            divergence = diverged(spec.output_ids)
            turn_stats.append({"acceptance_lengths": spec.acceptance_lengths, "wall_s": spec.wall_s,
                               "cycles_s": spec.cycles_s, "stage_s": spec.stage_s,
                               "target_wall_s": base.wall_s, "target_tokens": len(base.output_ids),
                               "divergence": divergence,
                               "lossless": divergence is None if sampling.greedy else None,
                               "confidences": spec.confidences, "ddtree": trees})
            return spec.output_ids
        if client is not None and overshoot:      # the output, and what the server says after it
            full = client.generate(prompt_ids, n_max + overshoot, [], sampling)
            cut = next((i + 1 for i, t in enumerate(full[:n_max]) if t in stops), min(n_max, len(full)))
            continuations.append(full[cut:cut + overshoot])
            return full[:cut]
        if client is not None:
            return client.generate(prompt_ids, n_max, stops, sampling)
        decoded = target_decode(target, ids, n_max, stops, sampling, overshoot=overshoot)
        continuations.append(decoded.continuation or [])
        return decoded.output_ids

    turns = reference_turns(row, tokenizer, complete, THINKING[ctx.settings.thinking])
    if ctx.settings.mode == "offline":
        for i, turn in enumerate(turns):
            turn_stats.append(evaluate_offline(drafter, target, turn.prompt_ids, turn.output_ids,
                                               max_blocks=ctx.settings.max_blocks, budgets=decoding.budgets,
                                               all_anchors=ctx.settings.all_anchors, sampling=sampling, rules=rules,
                                               continuation=continuations[i] if overshoot else ()))
    acceptance = [n for s in turn_stats for n in s["acceptance_lengths"]]
    result = {"id": row.id, "category": row.category, "reference": "sglang" if client else "local",
              "prompt_ids": list(turns[-1].prompt_ids), "output_ids": list(turns[-1].output_ids),
              "acceptance_lengths": acceptance, **row_stats(acceptance)}
    if len(turns) > 1:
        result["turns"] = [{"prompt_ids": list(t.prompt_ids), "output_ids": list(t.output_ids),
                            "acceptance_lengths": s["acceptance_lengths"],
                            **({"target_tokens": s["target_tokens"]} if "target_tokens" in s else {})}
                           for t, s in zip(turns, turn_stats)]
    if any(s.get("confidences") for s in turn_stats):     # a confidence head: per cycle, per draft
        result["confidences"] = [c for s in turn_stats for c in s.get("confidences") or []]
    if decoding.budgets:
        result["ddtree"] = {}
        for b in map(str, decoding.budgets):
            lengths = [n for s in turn_stats for n in s["ddtree"][b]["acceptance_lengths"]]
            result["ddtree"][b] = {"acceptance_lengths": lengths, "tau": row_stats(lengths)["tau"]}
            if ctx.settings.mode == "online":
                trees = [s["ddtree"][b] for s in turn_stats]
                result["ddtree"][b].update(output_ids=trees[-1]["output_ids"], wall_s=sum(t["wall_s"] for t in trees),
                                           **summed_stages(trees))
                if sampling.greedy:
                    result["ddtree"][b]["lossless"] = not any(t["divergence"] for t in trees)
                    result["ddtree"][b].update(divergence_row(trees))
    if ctx.settings.mode == "offline":
        if ctx.settings.all_anchors:
            result["all_anchors"] = {k: [sum(v) for v in zip(*(s["all_anchors"][k] for s in turn_stats))]
                                     for k in ("correct", "count")}
        if not sampling.greedy:
            result["expected"] = merge_expected([s["expected"] for s in turn_stats])
    else:
        result["wall_s"] = sum(s["wall_s"] for s in turn_stats)
        result.update(summed_stages(turn_stats))
        result["target_wall_s"] = sum(s["target_wall_s"] for s in turn_stats)
        result["target_tokens"] = sum(s["target_tokens"] for s in turn_stats)
        result["lossless"] = all(s["lossless"] for s in turn_stats) if sampling.greedy else None
        result.update(divergence_row(turn_stats))
        if phase is not None and not (result.get("divergence") and not result["divergence"]["near_tie"]):
            result["engine"] = serve_engine(ctx, phase, row, turns, turn_stats, target, drafter, tokenizer, stops)
    return result


def summed_stages(turns: list[dict]) -> dict:
    """``cycles_s`` and ``stage_s`` (each stage's seconds) of one prompt's decodings, summed over its turns."""
    stages = {k: sum(t["stage_s"][k] for t in turns) for k in turns[0]["stage_s"]}
    return {"cycles_s": sum(t["cycles_s"] for t in turns), "stage_s": stages}


def divergence_row(turn_stats: list[dict]) -> dict:
    """``{"divergence": ...}`` of the first turn whose output left the target's greedy output, else ``{}``."""
    first = next(((t, s["divergence"]) for t, s in enumerate(turn_stats) if s.get("divergence")), None)
    if not first:
        return {}
    t, d = first
    return {"divergence": {**({"turn": t} if len(turn_stats) > 1 else {}), "position": d.position, "ours": d.ours,
                           "target": d.target, "margin": d.margin, "near_tie": d.near_tie, "describe": d.describe()}}


def serve_engine(ctx, phase, row, turns, turn_stats, target, drafter, tokenizer, stops) -> dict:
    """The row's ``engine`` object (remote/engines/phase.py): the prompt's turns served by the engine as
    they were decoded by us, checked against our decoding; where the engine drafted other tokens
    from the same context, our decoding is redone with the drafter computed as vLLM's CPU kernel
    computes it (remote/engines/quirks.py) to see whether that is why."""
    import torch
    from remote.engines.phase import OurTurn, TurnRequest, chat_messages, serve_row
    from remote.engines.quirks import first_layer_context_k_norm
    from remote.decode.online import speculative_generate

    sampling = ctx.sampling
    thinking = THINKING[ctx.settings.thinking]
    chats = chat_messages(row.turns, [t.output_ids for t in turns],
                          lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) \
        if row.input_ids is None else [None] * len(turns)
    requests = [TurnRequest(list(t.prompt_ids), m, thinking, ctx.settings.max_new_tokens, stops, sampling.temperature,
                            sampling.top_p, sampling.top_k, prompt_seed(ctx.settings.seed, row.id) if not sampling.greedy
                            else None) for t, m in zip(turns, chats)]
    ours = [OurTurn(list(t.prompt_ids), list(t.output_ids), list(s["acceptance_lengths"]))
            for t, s in zip(turns, turn_stats)]
    device = next(target.parameters()).device

    def rerun(i: int):
        if len(drafter.layers) < 2:      # one layer: its own k_norm is layer 0's, nothing changes
            return None
        with first_layer_context_k_norm(drafter):
            ids = torch.tensor([ours[i].prompt_ids], dtype=torch.long, device=device)
            return speculative_generate(target, drafter, ids, ctx.settings.max_new_tokens, stops).acceptance_lengths

    return serve_row(phase, requests, ours, drafter.block_size, rerun=rerun if phase.quirk else None)


def merge_expected(parts: list[dict]) -> dict:
    """The expected-acceptance sums of several turns as one row's."""
    merged = {"alpha_sum": [sum(v) for v in zip(*(p["alpha_sum"] for p in parts))],
              "reach_sum": [sum(v) for v in zip(*(p["reach_sum"] for p in parts))],
              "count": [sum(v) for v in zip(*(p["count"] for p in parts))],
              "tau_sum": sum(p["tau_sum"] for p in parts), "anchors": sum(p["anchors"] for p in parts)}
    merged["expected_tau"] = merged["tau_sum"] / merged["anchors"] if merged["anchors"] else None
    return merged


def main(argv=None) -> int:
    global EVENTS
    ctx = parse_args(argv)
    EVENTS = sys.stdout
    try:
        with contextlib.redirect_stdout(sys.stderr):
            run(ctx)
        return 0
    except WorkerError as e:
        emit(events.ERROR, message=str(e))
        log(f"error: {e}")
        return e.code
    except EngineError as e:        # missing, refusing its settings, died: one line (its log tail below)
        emit(events.ERROR, message=e.headline)
        log(f"error: {e}")
        return exits.CHECK_FAILED
    except Exception as e:  # finished prompts are already on disk
        import traceback
        traceback.print_exc()
        emit(events.ERROR, message=f"{type(e).__name__}: {e}")
        return 3


if __name__ == "__main__":
    raise SystemExit(main())
