"""`dflash-ops compare A B [C ...]`: pair runs prompt by prompt and compare them against the first.

Pairing requires the same prompt ids, the same prompts and (offline) the same reference
completions, and the same target, suite, mode, block size and decoding settings. Any mismatch is
named and the comparison refused unless forced; forced comparisons use the common prompts.
Statistics (orchestrator/reports/stats.py): paired bootstrap CIs over prompts, a paired permutation
test, and win/tie/loss per prompt. numpy loads only when a comparison runs.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

from ..errors import DflashOpsError
from ..config.paths import shipped
from .render import fnum
from ..runs.metrics import TAU_CONVENTIONS
from ..runs.folders import EvalRun, RunError, readable

PUBLISHED_FILE = shipped("published.yaml")

# environment fields that can change the numbers (bf16 kernels, dtype, library versions, GPU)
NUMERIC_ENV = [("kernel path", ("kernel_path",)), ("dtype", ("dtype",)), ("GPU", ("gpu",)),
               ("device", ("device",)), ("torch", ("versions", "torch")),
               ("transformers", ("versions", "transformers")), ("fla", ("versions", "fla")),
               ("triton", ("versions", "triton")), ("CUDA", ("versions", "cuda"))]
OTHER_ENV = [("host", ("host",)), ("python", ("versions", "python")), ("drafter format", ("drafter", "format")),
             ("seed", ("seed",))]


class CompareError(RunError):
    """The comparison cannot be made as asked."""


class NotPaired(DflashOpsError):
    """The runs do not pair (target, suite, mode, settings, prompts or references differ)."""

    exit_code = 3


@dataclass
class Mismatch:
    field: str
    baseline: str       # baseline run id
    run: str            # other run id
    baseline_value: str
    value: str
    detail: str = ""
    plural: bool = False

    def message(self) -> str:
        s = f"{self.field} {'differ' if self.plural else 'differs'}: {self.baseline} has {self.baseline_value}, {self.run} has {self.value}"
        return s + (f" ({self.detail})" if self.detail else "")


def _get(d: dict, path: Sequence[str]):
    for k in path:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _short(v, n: int = 60) -> str:
    s = json.dumps(v) if not isinstance(v, str) else v
    return s if len(s) <= n else s[: n - 1] + "…"


def _ids_text(ids: Sequence[str], n: int = 4) -> str:
    ids = list(ids)
    return ", ".join(ids[:n]) + (f" … ({len(ids)} in all)" if len(ids) > n else "")


def _completion(row: dict):
    if row.get("turns"):
        return tuple(tuple(t.get("output_ids") or []) for t in row["turns"])
    return tuple(row.get("output_ids") or [])


def _prompt(row: dict):
    if row.get("turns"):
        return tuple(tuple(t.get("prompt_ids") or []) for t in row["turns"])
    return tuple(row.get("prompt_ids") or [])


def temperature(run: EvalRun) -> float:
    """The run's sampling temperature (0 = greedy; runs of workers that did not record it were greedy)."""
    return float(run.settings.get("temperature") or 0.0)


def _setting(key: str, default=None) -> Callable[[EvalRun], object]:
    """A decoding setting of env.json; ``default``: what a worker that did not record it used."""
    return lambda run: run.settings.get(key, default)


@dataclass(frozen=True)
class PairingKey:
    """Something two runs must share to pair, read from their records alone (no results)."""
    name: str
    value: Callable[[EvalRun], object]
    when_known: bool = False     # compared only when both runs record it
    when_sampled: bool = False   # compared only when a run samples (temperature > 0): greedy ignores it


# What two runs must share to pair, in the order mismatches are named; then the prompts and
# reference completions themselves (check_pair). Settings that do not change what is measured
# (ddtree_budgets, all_anchors, sglang_url, verify_block) are not keys.
PAIRING_KEYS: list[PairingKey] = [
    PairingKey("target", lambda r: r.target),
    PairingKey("suite", lambda r: r.suite),
    PairingKey("suite sha256 (prompt set)", lambda r: (_get(r.env, ("suite", "sha256")) or "")[:12] or None,
               when_known=True),
    PairingKey("mode", lambda r: r.mode),
    PairingKey("block size", lambda r: r.block_size),
    PairingKey("decoding setting temperature", temperature),
    PairingKey("decoding setting top_p", _setting("top_p", 1.0), when_sampled=True),
    PairingKey("decoding setting top_k", _setting("top_k", 0), when_sampled=True),
    PairingKey("decoding setting seed", _setting("seed", 0), when_sampled=True),
    PairingKey("decoding setting enable_thinking", _setting("enable_thinking")),
    PairingKey("decoding setting stop_token_ids", _setting("stop_token_ids"), when_known=True),
    PairingKey("decoding setting max_new_tokens", _setting("max_new_tokens")),
    PairingKey("decoding setting max_blocks", _setting("max_blocks")),
    PairingKey("decoding setting reference", _setting("reference")),
    # whose rules counted the cycles (zlab unless a run records another: runs made before the setting)
    PairingKey("counting rules (semantics)", _setting("semantics", "zlab")),
]


def key_mismatches(a: EvalRun, b: EvalRun) -> list[Mismatch]:
    """The pairing keys on which ``a`` and ``b`` differ."""
    sampled = temperature(a) > 0 or temperature(b) > 0
    mm = []
    for key in PAIRING_KEYS:
        if key.when_sampled and not sampled:
            continue
        va, vb = key.value(a), key.value(b)
        if va != vb and not (key.when_known and (va is None or vb is None)):
            mm.append(Mismatch(key.name, a.id, b.id, _short(va), _short(vb)))
    return mm


def check_pair(a: EvalRun, b: EvalRun) -> tuple[list[Mismatch], list[str]]:
    """Mismatches that make the pairing invalid, and warnings that do not."""
    mm: list[Mismatch] = key_mismatches(a, b)
    warn: list[str] = []

    def add(field, va, vb, detail="", plural=False):
        mm.append(Mismatch(field, a.id, b.id, _short(va), _short(vb), detail, plural))

    rows_a = {r.get("id"): r for r in a.results}
    rows_b = {r.get("id"): r for r in b.results}
    only_a = [i for i in rows_a if i not in rows_b]
    only_b = [i for i in rows_b if i not in rows_a]
    if only_a or only_b:
        parts = []
        if only_a:
            parts.append(f"only in {a.id}: {_ids_text(only_a)}")
        if only_b:
            parts.append(f"only in {b.id}: {_ids_text(only_b)}")
        add("prompt ids", f"{len(rows_a)} prompts", f"{len(rows_b)} prompts", "; ".join(parts), plural=True)
    common = [i for i in rows_a if i in rows_b]
    bad_prompt = [i for i in common if _prompt(rows_a[i]) != _prompt(rows_b[i])]
    if bad_prompt:
        add("prompt tokens (prompt_ids)", "its prompts", "different prompts",
            f"{len(bad_prompt)} of {len(common)} common prompts: {_ids_text(bad_prompt)}", plural=True)
    bad_ref = [i for i in common if _completion(rows_a[i]) != _completion(rows_b[i])]
    if bad_ref:
        detail = f"{len(bad_ref)} of {len(common)} common prompts: {_ids_text(bad_ref)}"
        if a.mode == "offline" or b.mode == "offline":
            add("reference completions (output_ids)", "its references", "different completions", detail,
                plural=True)
        elif temperature(a) == 0 and temperature(b) == 0:   # sampled outputs differ by nature
            warn.append(f"online outputs (output_ids) of {b.id} differ from {a.id} on {detail}: greedy "
                        "speculative decoding should reproduce the target's greedy output exactly "
                        "(numerical noise between environments, or a lossless-decoding bug)")
    for r in (a, b):
        if r.status != "done":
            warn.append(f"{r.id} has status {r.status!r}")
    return mm, warn


def env_differences(runs: Sequence[EvalRun], fields) -> list[dict]:
    out = []
    for name, path in fields:
        values = {r.id: _get(r.env, path) for r in runs}
        if len({json.dumps(v, sort_keys=True) for v in values.values()}) > 1:
            out.append({"field": name, "values": values})
    return out


# --------------------------------------------------------------------------- published

def _norm(s: str) -> str:
    return re.sub(r"[^a-z0-9]", "", str(s).lower())


def load_published(path=None) -> dict:
    import yaml

    p = Path(path) if path else PUBLISHED_FILE
    with open(p, encoding="utf-8") as f:
        return yaml.safe_load(f) or {}


def find_benchmark(name: str, published: dict) -> Optional[str]:
    """The published benchmark key for a suite or benchmark name (gsm8k, math500, MT-Bench, …)."""
    benches = published.get("benchmarks") or {}
    table = {}
    for key, b in benches.items():
        for alias in [key, b.get("name", "")] + list(b.get("aliases") or []):
            table[_norm(alias)] = key
    name = re.sub(r"^hf:", "", str(name).strip(), flags=re.I)        # the worker's built-in hf:NAME suites
    tokens = [t for t in re.split(r"[^a-z0-9]+", name.lower()) if t]
    candidates = [_norm(name)] + ["".join(tokens[:2]), tokens[0] if tokens else ""]
    for c in candidates:
        if c and c in table:
            return table[c]
    return None


def published_row(bench: str, published: dict, temperature: float = 0.0) -> Optional[dict]:
    """The published numbers of ``bench`` at ``temperature`` (None when the source has no row at it)."""
    b = published["benchmarks"][bench]
    rows = [r for r in b.get("rows") or [] if math.isclose(float(r["temperature"]), temperature)]
    if not rows:
        return None
    r = rows[0]
    return {"benchmark": bench, "name": b.get("name", bench), "temperature": float(r["temperature"]),
            **{k: r.get(k) for k in ("tau", "speedup", "ddtree_tau", "ddtree_speedup")},
            "setup": published.get("setup") or {}, "source": published.get("source") or {},
            "label": "published, not measured here"}


def published_for(base: EvalRun, published: Optional[str], published_file=None) -> tuple[Optional[dict], Optional[str]]:
    """The published row to show beside runs like ``base`` (``published``: the benchmark asked for,
    else the one the suite names), and a note when there is none at the runs' temperature."""
    pub = load_published(published_file)
    bench = find_benchmark(published, pub) if published else find_benchmark(base.suite or "", pub)
    if bench is None:
        if published:
            raise CompareError(f"no published numbers for {published!r}; known: " + ", ".join(pub.get("benchmarks") or {}))
        return None, None
    t = temperature(base)
    row = published_row(bench, pub, t)
    if row is None:
        name = pub["benchmarks"][bench].get("name", bench)
        have = ", ".join(f"T={float(r['temperature']):g}" for r in pub["benchmarks"][bench].get("rows") or [])
        note = f"published {name} numbers exist at {have or 'no temperature'}; these runs use T={t:g}: not shown"
        if published:
            raise CompareError(note)
        return None, note
    row["automatic"] = not published
    tgt = str(row["setup"].get("target") or "")
    caveats = []
    if tgt and _norm(tgt) not in _norm(base.target or ""):
        caveats.append(f"published for target {tgt}; these runs use {base.target}")
    if row["setup"].get("block_size") and row["setup"]["block_size"] != base.block_size:
        caveats.append(f"published at B={row['setup']['block_size']}, these runs use B={base.block_size}")
    if caveats:
        row["caveat"] = "; ".join(caveats)
    return row, None


# --------------------------------------------------------------------------- comparison

EXPECTED = "expected"    # offline runs at T > 0 have no walk: their expected τ is what is paired


def _paired_arrays(rows: dict, ids: Sequence[str], key=None):
    """Per prompt (tokens, cycles) of the walk, or of DDTree budget ``key``; for ``key == EXPECTED``
    (Σ E[τ] over anchors, anchors), so that macro = mean expected τ and pooled = Σ / Σ."""
    toks, cycs = [], []
    for i in ids:
        if key == EXPECTED:
            toks.append((rows[i].get("expected") or {}).get("tau_sum", 0.0))
            cycs.append((rows[i].get("expected") or {}).get("anchors", 0))
            continue
        lengths = rows[i].get("acceptance_lengths") if key is None else \
            ((rows[i].get("ddtree") or {}).get(key) or {}).get("acceptance_lengths")
        toks.append(sum(lengths))
        cycs.append(len(lengths))
    return toks, cycs


def _engine_arrays(rows: dict, ids: Sequence[str], measure: str):
    """Per prompt (tokens, cycles) of the engine's own τ (``tau``), or of its speedup (``speedup``)
    (the time the engine without the drafter takes for the output with it, at its own rate: its
    time × tokens with / its own tokens, which at T > 0 differ; the time with the drafter): macro =
    mean per prompt, pooled = Σ / Σ."""
    from remote.contract.metrics import engine_plain_tokens, engine_tokens

    engines = [rows[i]["engine"] for i in ids]
    if measure == "tau":
        return [e["tokens"] for e in engines], [e["cycles"] for e in engines]
    return ([e["plain"]["wall_s"] * engine_tokens(e) / engine_plain_tokens(e) for e in engines],
            [e["wall_s"] for e in engines])


def engine_pairs(rows_a: dict, rows_b: dict, ids: Sequence[str], resamples: int, seed: int,
                 confidence: float) -> dict:
    """The engine's τ and speedup (`eval --engine`) paired prompt by prompt like our τ, on the
    prompts both runs served with an engine; ``{}`` when they have none in common."""
    from .stats import paired_compare

    out = {}
    from remote.contract.metrics import engine_plain_tokens

    for measure, has in (("tau", lambda e: e.get("cycles")),
                         ("speedup", lambda e: (e.get("plain") or {}).get("wall_s") and e.get("wall_s")
                          and engine_plain_tokens(e))):
        ok = [i for i in ids if all(has(rm[i].get("engine") or {}) for rm in (rows_a, rows_b))]
        if not ok:
            continue
        pr = paired_compare(*_engine_arrays(rows_a, ok, measure), *_engine_arrays(rows_b, ok, measure),
                            resamples=resamples, seed=seed, confidence=confidence)
        out[measure] = {"n": pr.n, "macro": asdict(pr.macro), "pooled": asdict(pr.pooled),
                        "wins": pr.wins, "ties": pr.ties, "losses": pr.losses}
    return out


def ddtree_speedup_pair(rows_a: dict, rows_b: dict, ids: Sequence[str], budget: str, resamples: int, seed: int,
                        confidence: float) -> Optional[dict]:
    """DDTree-``budget``'s speedup over plain decoding (online: per prompt, the time plain decoding
    takes for the tree's output tokens at its own rate (its time × tree tokens / its own tokens,
    remote/contract/metrics.py ``plain_tokens``) over the tree decoding's time; macro the mean per
    prompt, pooled Σ / Σ) paired prompt by prompt like τ, on the prompts both runs timed and whose
    plain decoding's tokens are known; None when they have none in common."""
    from remote.contract.metrics import plain_tokens, tree_tokens

    from .stats import paired_compare

    def timed(row: dict) -> bool:
        return bool(row.get("target_wall_s") and ((row.get("ddtree") or {}).get(budget) or {}).get("wall_s")
                    and plain_tokens(row))

    def plain_time(row: dict) -> float:
        return row["target_wall_s"] * tree_tokens(row, budget) / plain_tokens(row)

    ok = [i for i in ids if timed(rows_a[i]) and timed(rows_b[i])]
    if not ok:
        return None
    arrays = [([plain_time(rm[i]) for i in ok], [rm[i]["ddtree"][budget]["wall_s"] for i in ok])
              for rm in (rows_a, rows_b)]
    pr = paired_compare(*arrays[0], *arrays[1], resamples=resamples, seed=seed, confidence=confidence)
    return {"n": pr.n, "macro": asdict(pr.macro), "pooled": asdict(pr.pooled), "wins": pr.wins, "ties": pr.ties,
            "losses": pr.losses}


def compare_runs(runs: Sequence[EvalRun], *, force: bool = False, resamples: int = 10000, seed: int = 0,
                 confidence: float = 0.95, published: Optional[str] = None, use_published: bool = True,
                 published_file=None) -> dict:
    """The comparison as a JSON-able dict. Refused comparisons come back with ``refused: True``
    (and no statistics) unless ``force``."""
    from ..runs.metrics import compute_metrics
    from .confidence import pair_runs
    from .stats import paired_compare

    if len(runs) < 2:
        raise CompareError("compare needs at least two runs")
    ids = [r.id for r in runs]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise CompareError(f"the same run is given twice: {', '.join(dup)} (labels resolve to run ids; "
                           "`dflash-ops runs` lists them)")
    for r in runs:
        why = r.invalid
        if why:
            raise CompareError(f"run {r.id} ({r.label}) is invalid, its τ is not a result: {why}")
    base = runs[0]
    mismatches, warnings = [], []
    for r in runs[1:]:
        m, w = check_pair(base, r)
        mismatches += m
        warnings += w
    warnings = list(dict.fromkeys(warnings))
    result: dict = {
        "baseline": base.id,
        "runs": [{"id": r.id, "label": r.label, "drafter": r.drafter, "checkpoint": r.checkpoint,
                  "target": r.target, "suite": r.suite, "host": r.host, "mode": r.mode,
                  "block_size": r.block_size, "temperature": temperature(r), "status": r.status,
                  "prompts": len(r.results),
                  "kernel_path": r.env.get("kernel_path"), "dtype": r.env.get("dtype"),
                  "gpu": r.env.get("gpu")} for r in runs],
        "mismatches": [asdict(m) | {"message": m.message()} for m in mismatches],
        "forced": bool(force and mismatches), "refused": bool(mismatches and not force),
        "warnings": warnings,
        "env_differences": env_differences(runs, NUMERIC_ENV),
        "other_differences": env_differences(runs, OTHER_ENV),
    }
    if result["refused"]:
        return result

    row_maps = [{row.get("id"): row for row in r.results} for r in runs]
    shared = [i for i in row_maps[0] if all(i in rm for rm in row_maps[1:])]
    common = [i for i in shared if all(rm[i].get("acceptance_lengths") for rm in row_maps)]
    measure = None
    if not common:      # offline at T > 0: the expected τ, an estimate
        common = [i for i in shared if all((rm[i].get("expected") or {}).get("anchors") for rm in row_maps)]
        measure = EXPECTED
    if not common:
        raise CompareError("the runs have no prompt in common: nothing to compare")
    result["measure"] = measure or "tau"
    result["paired_prompts"] = len(common)
    result["paired_ids_sha256"] = hashlib.sha256("\n".join(map(str, common)).encode()).hexdigest()[:12]
    metrics = {}
    for r, rm in zip(runs, row_maps):
        m = compute_metrics([rm[i] for i in common], r.block_size, r.mode, r.max_length)
        m.pop("per_prompt", None)
        metrics[r.id] = m
    result["metrics"] = metrics
    result["stats"] = {"resamples": resamples, "seed": seed, "confidence": confidence,
                       "ci": "percentile bootstrap over prompts (same resample for both runs)",
                       "test": "paired permutation test (swap runs within prompts), two-sided",
                       "of": ("expected τ per prompt (offline, T > 0: an estimate)" if measure == EXPECTED
                              else "τ per prompt")}

    cats = {i: row_maps[0][i].get("category") for i in common}
    has_cats = any(c is not None for c in cats.values())
    comparisons = []
    ta, ca = _paired_arrays(row_maps[0], common, measure)
    for r, rm in zip(runs[1:], row_maps[1:]):
        tb, cb = _paired_arrays(rm, common, measure)
        pr = paired_compare(ta, ca, tb, cb, resamples=resamples, seed=seed, confidence=confidence)
        c = {"run": r.id, "vs": base.id, **pr.to_dict()}
        budgets = sorted(set(metrics[base.id].get("ddtree") or {}) & set(metrics[r.id].get("ddtree") or {}), key=int)
        c["ddtree"] = {}
        for bud in budgets:
            ok = [i for i in common if bud in (row_maps[0][i].get("ddtree") or {}) and bud in (rm[i].get("ddtree") or {})]
            if not ok:
                continue
            dpr = paired_compare(*_paired_arrays(row_maps[0], ok, bud), *_paired_arrays(rm, ok, bud),
                                 resamples=resamples, seed=seed, confidence=confidence)
            c["ddtree"][bud] = {"n": dpr.n, "macro": asdict(dpr.macro), "pooled": asdict(dpr.pooled),
                                "wins": dpr.wins, "ties": dpr.ties, "losses": dpr.losses}
            speed = ddtree_speedup_pair(row_maps[0], rm, ok, bud, resamples, seed, confidence)
            if speed:
                c["ddtree"][bud]["speedup"] = speed
        c["engine"] = engine_pairs(row_maps[0], rm, common, resamples, seed, confidence)
        c["confidence"] = pair_runs({i: metrics[i].get("confidence") for i in (base.id, r.id)},
                                    {base.id: row_maps[0], r.id: rm}, common, resamples=resamples, seed=seed,
                                    confidence=confidence)
        if has_cats:
            c["categories"] = {}
            for cat in sorted({str(v) for v in cats.values() if v is not None}):
                ids_c = [i for i in common if str(cats[i]) == cat]
                cpr = paired_compare(*_paired_arrays(row_maps[0], ids_c, measure), *_paired_arrays(rm, ids_c, measure),
                                     resamples=resamples, seed=seed, confidence=confidence)
                c["categories"][cat] = {"n": cpr.n, "macro": asdict(cpr.macro), "pooled": asdict(cpr.pooled),
                                        "wins": cpr.wins, "ties": cpr.ties, "losses": cpr.losses}
        comparisons.append(c)
    result["comparisons"] = comparisons

    result["published"], result["published_note"] = (published_for(base, published, published_file)
                                                      if published or use_published else (None, None))
    result["verdict"] = verdict_lines(result)
    return result


def verdict_lines(result: dict) -> list[str]:
    """The comparison's answer, first: one line per run against the baseline (paired τ macro
    difference with its CI, prompts each way), and the published number when shown."""
    from .verdict import pair_verdict, published_line

    nm = _names(result)
    measure = "expected τ" if result.get("measure") == EXPECTED else "τ"
    lines = [pair_verdict(nm[c["run"]], nm[c["vs"]], c, measure) for c in result["comparisons"]]
    pub = result.get("published")
    if pub and pub.get("tau") is not None and measure == "τ":
        lines.append(published_line(pub, [(nm[r["id"]], result["metrics"][r["id"]].get("tau_macro_turns"))
                                          for r in result["runs"]]))
    if result.get("forced"):
        lines = [f"{line} (forced: the runs do not pair)" for line in lines]
    return lines


# --------------------------------------------------------------------------- rendering

def _ci(iv: dict, d: int = 3) -> str:
    return f"{iv['diff']:+.{d}f} [{iv['ci_low']:+.{d}f}, {iv['ci_high']:+.{d}f}]"


def _p(p) -> str:
    if p is None:
        return "—"
    return "<0.0001" if p < 1e-4 else f"{p:.4f}"


def side_by_side(result: dict) -> tuple[list[str], list[list[str]]]:
    ids = [r["id"] for r in result["runs"]]
    labels = {r["id"]: r["label"] for r in result["runs"]}
    pub = result.get("published")
    head = ["metric"] + [f"{labels[i]} ({i})" + (" [baseline]" if i == result["baseline"] else "") for i in ids]
    if pub:
        head.append(f"{pub['name']}: {pub['label']}")
    M = result["metrics"]

    def row(name, fn, pub_value="—"):
        r = [name] + [fn(M[i]) for i in ids]
        if pub:
            r.append(pub_value)
        return r

    temps = {r["id"]: r.get("temperature") for r in result["runs"]}
    walked = not all(M[i].get("expected") for i in ids)     # offline at T > 0 no run has a walk's τ
    rows = [[ "temperature"] + [fnum(temps[i], 2) for i in ids] + ([fnum(pub["temperature"], 2)] if pub else []),
            row("prompts (paired)", lambda m: str(m["prompts"]))]
    if walked:
        rows += [row("tau_macro (mean over prompts)", lambda m: fnum(m["tau_macro"])),
                 row("tau_macro_turns (mean over turns: z-lab, DDTree)", lambda m: fnum(m.get("tau_macro_turns")),
                     fnum(pub["tau"], 2) if pub else "—"),
                 row("tau_pooled (Σ tokens / Σ cycles)", lambda m: fnum(m["tau_pooled"])),
                 row("tau_sglang (as SGLang reports it)", lambda m: fnum(m.get("tau_sglang")))]
    if any(M[i].get("expected") for i in ids):
        rows += [row("expected tau_macro (offline, T > 0: an estimate)",
                     lambda m: fnum((m.get("expected") or {}).get("tau_macro"))),
                 row("expected tau_pooled (offline, T > 0: an estimate)",
                     lambda m: fnum((m.get("expected") or {}).get("tau_pooled")))]
    if walked:
        rows += [row("cycles", lambda m: str(m["cycles"])), row("tokens", lambda m: str(m["tokens"]))]
    budgets = sorted({b for i in ids for b in (M[i].get("ddtree") or {})}, key=int)
    for b in budgets:
        rows.append(row(f"DDTree-{b} tau_macro",
                        lambda m, b=b: fnum(((m.get("ddtree") or {}).get(b) or {}).get("tau_macro"))))
    if pub:
        rows.append(row("DDTree tau (published: best budget of 16..1024)", lambda m: "—",
                        fnum(pub["ddtree_tau"], 2) + (f" ({pub['ddtree_speedup']:.2f}×)" if pub.get("ddtree_speedup")
                                                       else "")))
        if pub.get("speedup") is not None:
            rows.append(row("speedup (published: DFlash)", lambda m: fnum((m.get("online") or {}).get("speedup"), 2),
                            f"{pub['speedup']:.2f}×"))
    if any(M[i].get("online") for i in ids):
        rows.append(row("online tokens/s", lambda m: fnum((m.get("online") or {}).get("tokens_per_s"), 1)))
    if any(M[i].get("engine") for i in ids):
        rows += [row("engine τ macro (the engine's own count)", lambda m: fnum((m.get("engine") or {}).get("tau_macro"))),
                 row("engine τ pooled", lambda m: fnum((m.get("engine") or {}).get("tau_pooled"))),
                 row("engine speedup (without / with the drafter)",
                     lambda m: fnum((m.get("engine") or {}).get("speedup"), 2))]
    return head, rows


def _names(result: dict) -> dict:
    """Short column names: the drafter label where unique among the runs, else the run id."""
    labels = [r["label"] for r in result["runs"]]
    return {r["id"]: (r["label"] if labels.count(r["label"]) == 1 else r["id"]) for r in result["runs"]}


def difference_rows(result: dict) -> tuple[list[str], list[list[str]]]:
    tau = "expected τ" if result.get("measure") == EXPECTED else "tau"
    head = ["run vs baseline", "n", f"Δ {tau}_macro [95% CI]", "p", f"Δ {tau}_pooled [95% CI]", "p",
            "win / tie / loss"]
    rows = []
    nm = _names(result)
    for c in result["comparisons"]:
        rows.append([f"{nm[c['run']]} − {nm[c['vs']]}", str(c["n"]), _ci(c["macro"]), _p(c["macro"]["p_value"]),
                     _ci(c["pooled"]), _p(c["pooled"]["p_value"]), f"{c['wins']} / {c['ties']} / {c['losses']}"])
        extra = [(f"↳ DDTree-{b}", d) for b, d in sorted(c["ddtree"].items(), key=lambda kv: int(kv[0]))]
        extra += [(f"↳ engine {'τ' if k == 'tau' else 'speedup'}", d) for k, d in (c.get("engine") or {}).items()]
        for name, d in extra:
            rows.append([name, str(d["n"]), _ci(d["macro"]), _p(d["macro"]["p_value"]),
                         _ci(d["pooled"]), _p(d["pooled"]["p_value"]), f"{d['wins']} / {d['ties']} / {d['losses']}"])
    return head, rows


def per_position_rows(result: dict) -> tuple[list[str], list[list[str]]]:
    """Each run's per-position acceptance (offline at T > 0: the expected one, reports/plots.py
    ``per_position``) and its difference from the baseline's."""
    from .plots import per_position

    ids = [r["id"] for r in result["runs"]]
    M = result["metrics"]
    ppa = {i: per_position(M[i])[0] or [] for i in ids}
    B = max(len(ppa[i]) for i in ids) + 1
    nm = _names(result)
    head = ["k"] + [nm[i] + per_position(M[i])[1] for i in ids] + [f"Δ {nm[i]}" for i in ids[1:]]
    rows = []
    for k in range(1, B):
        vals = [(ppa[i] + [None] * B)[k - 1] for i in ids]
        diffs = [(f"{v - vals[0]:+.4f}" if v is not None and vals[0] is not None else "—") for v in vals[1:]]
        rows.append([str(k)] + [fnum(v) for v in vals] + diffs)
    return head, rows


def category_rows(result: dict) -> Optional[tuple[list[str], list[list[str]]]]:
    from .plots import category_tau

    comps = [c for c in result["comparisons"] if c.get("categories")]
    if not comps:
        return None
    ids = [r["id"] for r in result["runs"]]
    M = result["metrics"]
    nm = _names(result)
    tau = "expected τ" if result.get("measure") == EXPECTED else "τ"
    head = ["category", "n"] + [f"{tau} {nm[i]}" for i in ids] + \
        [f"Δ {nm[c['run']]} [95% CI]" for c in comps] + [f"p {nm[c['run']]}" for c in comps] + \
        [f"W/T/L {nm[c['run']]}" for c in comps]
    rows = []
    for cat in sorted(comps[0]["categories"]):
        d0 = comps[0]["categories"][cat]
        rows.append([cat, str(d0["n"])]
                    + [fnum(category_tau(M[i], cat)) for i in ids]
                    + [_ci(c["categories"][cat]["macro"]) for c in comps]
                    + [_p(c["categories"][cat]["macro"]["p_value"]) for c in comps]
                    + [f"{c['categories'][cat]['wins']}/{c['categories'][cat]['ties']}/{c['categories'][cat]['losses']}"
                       for c in comps])
    return head, rows


def ddtree_rows(result: dict) -> Optional[tuple[list[str], list[list[str]]]]:
    """DDTree per budget that every run has: each run's τ (pooled) and, online, its tokens/s and
    speedup over plain decoding (the fastest budget of each run marked ★); each run against the
    baseline, τ paired prompt by prompt (Δ τ macro with its CI, p, W/T/L) and the speedup the same
    way (Δ pooled speedup). None when no budget is shared."""
    from remote.contract.metrics import fastest_budget

    ids = [r["id"] for r in result["runs"]]
    M = result["metrics"]
    nm = _names(result)
    dd = {i: M[i].get("ddtree") or {} for i in ids}
    budgets = sorted(set.intersection(*(set(dd[i]) for i in ids)), key=int)
    if not budgets:
        return None
    best = {i: fastest_budget(dd[i]) for i in ids}
    timed = [i for i in ids if best[i] is not None]
    comps = result["comparisons"]
    head = (["budget N"] + [f"τ {nm[i]}" for i in ids] + [f"tokens/s {nm[i]}" for i in timed]
            + [f"speedup {nm[i]}" for i in timed]
            + [f"{what} {nm[c['run']]}" for c in comps for what in ("Δ τ macro [95% CI]", "p", "W/T/L")]
            + [f"Δ speedup {nm[c['run']]} [95% CI]" for c in comps if any("speedup" in d for d in c["ddtree"].values())])
    rows = []
    for b in budgets:
        row = [b] + [fnum(dd[i][b].get("tau_pooled")) for i in ids]
        row += [fnum(dd[i][b].get("tokens_per_s"), 2) + (" ★" if best[i] == b else "") for i in timed]
        row += [fnum(dd[i][b].get("speedup"), 3) for i in timed]
        for c in comps:
            d = c["ddtree"].get(b)
            row += [_ci(d["macro"]), _p(d["macro"]["p_value"]), f"{d['wins']}/{d['ties']}/{d['losses']}"] if d \
                else ["—", "—", "—"]
        for c in comps:
            if any("speedup" in d for d in c["ddtree"].values()):
                sp = (c["ddtree"].get(b) or {}).get("speedup")
                row.append(_ci(sp["pooled"]) if sp else "—")
        rows.append(row)
    return head, rows


def ddtree_note(result: dict) -> str:
    return ("DDTree per budget (τ pooled: Σ tokens / Σ cycles). Online, each budget decodes every prompt on its own: "
            "tokens/s of that decoding, speedup = its tokens/s over plain decoding's own in the same run (★ the run's "
            "fastest budget). Δ τ is paired prompt by prompt with the same bootstrap and permutation test as τ; Δ "
            "speedup pairs each prompt's (plain decoding's time for the tree's tokens at its own rate, tree decoding "
            "time) the same way, pooled as Σ / Σ. "
            "Timings compare only between runs on the same hardware (the environment differences above say where "
            "they differ).")


def _ci_or_none(iv: Optional[dict]) -> str:
    if iv is None:
        return "—"
    if iv["ci_low"] is None:
        return f"{iv['diff']:+.3f} [no resample had a value]"
    return _ci(iv)


def _heads(result: dict) -> list[str]:
    """The runs with a confidence head, in the comparison's order."""
    return [r["id"] for r in result["runs"] if result["metrics"][r["id"]].get("confidence")]


def confidence_tables(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """A confidence head compared (orchestrator/reports/confidence.py): the runs side by side, the
    paired differences, per drafted position and the verify-budget curve; nothing when no run has
    a head, and a run without one says so."""
    from .confidence import MEASURES, NO_HEAD, headline

    heads = _heads(result)
    if not heads:
        return []
    ids = [r["id"] for r in result["runs"]]
    M = result["metrics"]
    nm = _names(result)
    lines = {i: headline(M[i].get("confidence")) for i in ids}
    side = [["cycles judged"] + [str(lines[i]["cycles"]) if lines[i] else NO_HEAD for i in ids],
            ["drafted positions judged"] + [str(lines[i]["positions"]) if lines[i] else "—" for i in ids]]
    for m in MEASURES:
        side.append([m.label] + [fnum(lines[i][m.key]) if lines[i] else "—" for i in ids])
        if m.key == "predicted_tau":
            side.append(["τ measured (the same cycles)"] + [fnum(lines[i]["measured_tau"]) if lines[i] else "—"
                                                            for i in ids])
    diffs = []
    labels = {m.key: m.label for m in MEASURES}
    for c in result["comparisons"]:
        h = c.get("confidence")
        if h is None:
            continue
        pair = f"{nm[c['run']]} − {nm[c['vs']]}"
        if h["missing"]:
            why = "not paired: " + ", ".join(f"{nm[i]} has {NO_HEAD}" for i in h["missing"])
            diffs.append([pair, "—", "0", why, "—"])
            continue
        diffs += [[pair, labels[k], str(h["n"]), _ci_or_none(iv), _p(iv and iv["p_value"])]
                  for k, iv in h["measures"].items()]
    tables = [("Confidence head: side by side (survival, pooled over drafted positions)",
               ["measure"] + [nm[i] for i in ids], side)]
    if diffs:
        tables.append(("Confidence head: difference vs baseline",
                       ["run vs baseline", "measure", "n", "Δ [95% CI]", "p"], diffs))
    depth = max(len(M[i]["confidence"]["calibration"]["positions"]) for i in heads)
    positions = []
    for k in range(1, depth + 1):
        row = [str(k)]
        for i in heads:
            p = (M[i]["confidence"]["calibration"]["positions"] + [None] * depth)[k - 1] or {}
            row += [fnum(p.get("mean_predicted")), fnum(p.get("mean_observed")), fnum(p.get("ece"))]
        positions.append(row)
    tables.append(("Confidence head: per drafted position (no intervals: see the note)",
                   ["k"] + [f"{nm[i]} {what}" for i in heads for what in ("predicted", "observed", "ECE")], positions))
    paired = [c for c in result["comparisons"] if (c.get("confidence") or {}).get("verify_budget")]
    curves = {i: {p["threshold"]: p for p in M[i]["confidence"]["verify_budget"]["points"]} for i in heads}
    deltas = [{p["threshold"]: p for p in c["confidence"]["verify_budget"]} for c in paired]
    budget = []
    for t in curves[heads[0]]:
        point = [curves[i].get(t) or {} for i in heads]
        budget.append([f"{t:g}"] + [fnum(p.get("tau")) for p in point] + [fnum(p.get("mean_verify_len")) for p in point]
                      + [_ci_or_none((d.get(t) or {}).get(key)) for d in deltas for key in ("tau", "mean_verify_len")])
    tables.append(("Verify budget: a cycle verifies only the drafts whose survival ≥ threshold",
                   ["threshold"] + [f"τ {nm[i]}" for i in heads] + [f"verified tokens / cycle {nm[i]}" for i in heads]
                   + [f"Δ{what} {nm[c['run']]} [95% CI]" for c in paired for what in ("τ", " verified")], budget))
    return tables


def confidence_note(result: dict) -> str:
    return ("Confidence head: the survival (the cumulative product of a cycle's per-position confidences) judged "
            "against acceptance with SGLang's definitions (remote/contract/confidence.py), on the paired prompts. "
            "Lower ECE, Brier and |τ predicted − measured| and a higher AUROC are better. Each measure is a function "
            "of sums over prompts, so its difference (run − baseline) carries the same paired bootstrap CI over "
            "prompts and permutation p as τ; per drafted position the values are shown without intervals (one "
            "interval per position and measure would be many tests of little power; the pooled rows carry them).")


def env_warning_lines(result: dict) -> list[str]:
    lines = []
    for d in result["env_differences"]:
        vals = ", ".join(f"{k}: {v if v is not None else '—'}" for k, v in d["values"].items())
        lines.append(f"{d['field']} differs ({vals})")
    return lines


def stats_note(result: dict) -> str:
    s = result["stats"]
    return (f"Differences of {s.get('of', 'τ per prompt')} are run − baseline ({result['baseline']}) over "
            f"{result['paired_prompts']} paired prompts; "
            f"{int(s['confidence'] * 100)}% CI: {s['ci']}, {s['resamples']} resamples, seed {s['seed']}; "
            f"p: {s['test']} ({s['resamples']} resamples, exact when 2^n ≤ resamples).")


def compare_plots(result: dict) -> list[tuple[str, str, Optional[bytes]]]:
    from .plots import plot_categories, plot_ddtree, plot_histogram, plot_per_position, plot_reliability

    nm = _names(result)
    series = [(nm[r["id"]], result["metrics"][r["id"]]) for r in result["runs"]]
    return [("per-position", "Per-position acceptance", plot_per_position(series, with_anchors=False)),
            ("histogram", "Acceptance-length histogram", plot_histogram(series)),
            ("ddtree", "DDTree τ vs budget", plot_ddtree(series)),
            ("categories", "τ per category", plot_categories(series)),
            ("reliability", "Confidence head: reliability", plot_reliability(series))]


def default_out_dir(runs_root: Path, ids: Sequence[str]) -> Path:
    name = "compare-" + "_vs_".join(ids)
    if len(name) > 180:
        name = "compare-" + ids[0][:60] + "_vs_" + hashlib.sha256("\n".join(ids).encode()).hexdigest()[:12]
    return runs_root / name


def write_compare(result: dict, out_dir: Path) -> tuple[Path, Path]:
    from .render import Document

    ids = [r["id"] for r in result["runs"]]
    doc = Document("dflash-ops compare: " + " vs ".join(ids))
    doc.verdict(result.get("verdict") or verdict_lines(result))
    doc.warnings("Forced comparison (--force) despite mismatches:", [m["message"] for m in result["mismatches"]])
    doc.warnings("Environment differences that can change the numbers:", env_warning_lines(result))
    doc.warnings("Warnings:", result["warnings"])
    doc.para(stats_note(result), cls="note")
    doc.table(*side_by_side(result), heading="Side by side")
    doc.table(*difference_rows(result), heading="Difference vs baseline")
    doc.table(*per_position_rows(result), heading="Per-position acceptance")
    cat = category_rows(result)
    if cat:
        doc.table(*cat, heading="Per category (τ macro)")
    dd = ddtree_rows(result)
    if dd:
        doc.table(*dd, heading="DDTree per budget")
        doc.para(ddtree_note(result), cls="note")
    heads = confidence_tables(result)
    for heading, head, rows in heads:
        doc.table(head, rows, heading=heading)
    if heads:
        doc.para(confidence_note(result), cls="note")
    pub = result.get("published")
    if pub:
        src = pub["source"]
        doc.para(f"Published column: {pub['name']} — {pub['label']}. Source: {src.get('title')} "
                 f"({src.get('authors')}, arXiv {src.get('arxiv')}), {src.get('measures')}; setup "
                 f"{pub['setup'].get('target')}, T={pub['temperature']:g}, B={pub['setup'].get('block_size')}; "
                 f"τ {pub['setup'].get('tau')}." + (f" Caveat: {pub['caveat']}." if pub.get("caveat") else ""),
                 cls="published")
    if result.get("published_note"):
        doc.para(result["published_note"].capitalize() + ".", cls="note")
    doc.para(TAU_CONVENTIONS, cls="note")
    other = [f"{d['field']}: " + ", ".join(f"{k}={v}" for k, v in d["values"].items())
             for d in result["other_differences"]]
    if other:
        doc.para("Other differences (do not change the numbers): " + "; ".join(other), cls="note")
    for key, heading, svg in compare_plots(result):
        doc.plot(key, heading, svg)
    return doc.write(out_dir, "compare")


# --------------------------------------------------------------------------- picking runs

@dataclass
class Picked:
    """The runs ``compare`` compares, one per label, and why each; ``paired`` False when no
    choice pairs (then the newest of each, and the closest candidate pairs)."""
    runs: list[EvalRun]
    why: list[str]
    paired: bool
    closest: list[dict]


def _prompt_count(r: EvalRun):
    return len(r.results) or r.prompts_planned


def _mismatch_names(a: EvalRun, b: EvalRun) -> list[str]:
    """Why ``b`` does not pair with ``a``, briefly, ``b``'s value first: ``mode online vs
    offline``, ``prompts 12 vs 2`` (a different prompt count is said as such, not as the hash of
    the prompt set it changes), ``max_new_tokens 32 vs 256``."""
    out = []
    for m in key_mismatches(a, b) or check_pair(a, b)[0]:
        name = m.field.removeprefix("decoding setting ")
        if m.field.startswith(("suite sha256", "prompt ids")) and _prompt_count(a) != _prompt_count(b):
            name, m = "prompts", replace(m, value=str(_prompt_count(b)), baseline_value=str(_prompt_count(a)))
        text = f"{name} {m.value} vs {m.baseline_value}"
        if text not in out:
            out.append(text)
    return out


def pick_runs(labels: Sequence[str], candidates: Sequence[list[EvalRun]]) -> Picked:
    """For each label, of the runs it may mean (``candidates``, from the resolver), the newest
    that pair with each other: the newest baseline run that has a pairing run of every other
    label, and each other label's newest run pairing with it. Finished runs are preferred."""
    pools = [sorted([r for r in c if r.status == "done"] or list(c), key=EvalRun.sort_key, reverse=True)
             for c in candidates]
    for base in pools[0]:
        partners = [next((r for r in pool if r.id != base.id and not check_pair(base, r)[0]), None)
                    for pool in pools[1:]]
        if all(partners):
            runs = [base, *partners]
            why = [_why(label, run, pool, base if i else None) for i, (label, run, pool)
                   in enumerate(zip(labels, runs, pools))]
            return Picked(runs, why, True, [])
    runs = [pool[0] for pool in pools]
    why = [f"{label} → {r.id} (the newest {label} run; no {label} run pairs with runs of the other labels)"
           for label, r in zip(labels, runs)]
    closest = []
    for label, pool in zip(labels[1:], pools[1:]):
        pairs = [(a, b, _mismatch_names(a, b)) for a in pools[0][:20] for b in pool[:20] if a.id != b.id]
        pairs.sort(key=lambda p: len(p[2]))      # fewest mismatches first; stable: newest first among equals
        closest += [{"label": label, "runs": [a.id, b.id], "mismatches": m, "why": _differ(m)}
                    for a, b, m in pairs[:3]]
    return Picked(runs, why, False, closest)


def _differ(fields: list[str]) -> str:
    return ", ".join(fields) if fields else "the same run"


def _why(label: str, run: EvalRun, pool: list[EvalRun], base: Optional[EvalRun]) -> str:
    """``v5 → ID (the newest v5 run that pairs with ...; skipped 2 newer: ID (mode), ...)``."""
    if label == run.id:
        return f"{label} → {run.id} (named by its id)"
    newer = [r for r in pool if r.sort_key() > run.sort_key()]
    if not newer:
        return f"{label} → {run.id} (the newest {label} run)"
    if base is None:
        return f"{label} → {run.id} (the newest {label} run with a pairing run of every other label; " \
               f"{len(newer)} newer one(s) have none)"
    skipped = ", ".join(f"{r.id} ({_differ(_mismatch_names(base, r))})" for r in newer[:3])
    more = f" and {len(newer) - 3} more" if len(newer) > 3 else ""
    return f"{label} → {run.id} (the newest {label} run that pairs with {base.id}; skipped newer: {skipped}{more})"


def compare_labels(labels: Sequence[str], candidates: Sequence[list[EvalRun]], runs_root: Path, *,
                   force: bool = False, resamples: int = 10000, seed: int = 0, published: Optional[str] = None,
                   use_published: bool = True, out: Optional[Path] = None) -> dict:
    """Pick the runs for ``labels`` (:func:`pick_runs`; ``candidates``: every run each label may
    mean, those whose files do not read left out and named in ``result["skipped"]``) and compare
    them; unless refused, write compare.md/.html (default folder: ``runs_root/compare-A_vs_B``) and
    name them in ``result["outputs"]``."""
    if len(labels) < 2:
        raise CompareError("compare needs at least two runs (A is the baseline)")
    if resamples < 100:
        raise CompareError("--resamples must be at least 100")
    pools = [readable(c) for c in candidates]
    skipped = list(dict.fromkeys(why for pool in pools for why in pool.skipped))
    for label, pool in zip(labels, pools):
        if not pool and pool.skipped:
            raise CompareError(f"no run of {label!r} can be read: {pool.skipped[0]}")
    picked = pick_runs(labels, pools)
    result = compare_runs(picked.runs, force=force, resamples=resamples, seed=seed, published=published,
                          use_published=use_published)
    result["picked"] = [{"label": lb, "id": r.id, "why": w} for lb, r, w in zip(labels, picked.runs, picked.why)]
    result["closest"] = picked.closest
    result["skipped"] = skipped
    if not result["refused"]:
        md_path, html_path = write_compare(result, out or default_out_dir(runs_root, [r.id for r in picked.runs]))
        result["outputs"] = {"md": str(md_path), "html": str(html_path)}
    return result


def refusal(result: dict) -> NotPaired:
    m = result["mismatches"]
    return NotPaired(f"refusing to compare: {len(m)} mismatch(es) (first: {m[0]['message']}); --force compares "
                     "the common prompts anyway")
