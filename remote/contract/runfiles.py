"""The files of a run folder as a reader may trust them: ``results.jsonl`` rows, ``summary.json``
and ``env.json`` (docs/run-format.md), checked for what every report, listing and comparison
reads of them. Stdlib only.

A run folder travels between machines, so its files are untrusted input: :func:`parse` decodes
UTF-8 and bounds the nesting before JSON is parsed; :func:`check_row`, :func:`check_summary` and
:func:`check_env` check types and bounds (numbers finite, counts whole and non-negative, acceptance
lengths 1..the run's longest cycle, DDTree budgets 1..``MAX_BUDGET``); fields not named here are
left as they are. The block size a run declares is bounded by ``formats.MAX_BLOCK_SIZE`` where the
reader takes it (orchestrator/runs/folders.py). Each error is one line naming the field.
"""
from __future__ import annotations

import json
import math
import re
from typing import Callable

from .metrics import TREE_STAGES
from .settings import MAX_BUDGET

MAX_DEPTH = 64      # objects and lists inside each other: a run's files use fewer than 10


class RunFileError(ValueError):
    """A run file that is not what the worker writes: ``acceptance_lengths[2]: -5 is not ...``."""


# --------------------------------------------------------------------------- JSON

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_BRACKET = re.compile(r"[\[\]{}]")


def _depth(text: str) -> int:
    """How deep the lists and objects of a JSON text nest (strings skipped), counted up to just
    past :data:`MAX_DEPTH`."""
    depth = deepest = 0
    for m in _BRACKET.finditer(_STRING.sub("", text)):
        depth += 1 if m.group() in "[{" else -1
        if depth > deepest:
            deepest = depth
            if deepest > MAX_DEPTH:
                break
    return deepest


def parse(data: bytes) -> object:
    """One JSON document from a run file's bytes: UTF-8, nested at most :data:`MAX_DEPTH` deep."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RunFileError(f"not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") from None
    if _depth(text) > MAX_DEPTH:
        raise RunFileError(f"nested more than {MAX_DEPTH} levels deep")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RunFileError(f"not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except (ValueError, RecursionError) as e:       # an integer of more digits than Python converts
        raise RunFileError(f"not JSON ({str(e)[:80]})") from None


# --------------------------------------------------------------------------- types

def _shown(value) -> str:
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    text = json.dumps(value) if isinstance(value, (str, bool)) or value is None else repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


def _at(where: str, key) -> str:
    return f"{where}[{key}]" if isinstance(key, int) else (f"{where}.{key}" if where else str(key))


def _fail(where: str, text: str) -> RunFileError:
    return RunFileError(f"{where}: {text}" if where else text)


class Spec:
    """What a value must be: :meth:`check` raises :class:`RunFileError` naming where it is not."""
    what = "a value"

    def ok(self, value) -> bool:
        return True

    def check(self, value, where: str) -> None:
        if not self.ok(value):
            raise _fail(where, f"{_shown(value)} is not {self.what}")


class Unchecked(Spec):
    pass


class Str(Spec):
    what = "a string"

    def ok(self, value) -> bool:
        return isinstance(value, str)


class Bool(Spec):
    what = "true or false"

    def ok(self, value) -> bool:
        return isinstance(value, bool)


class Num(Spec):
    """A finite number (an integer too), within ``lo..hi`` where given."""
    kind = "a finite number"

    def __init__(self, lo: float | None = None, hi: float | None = None, what: str | None = None):
        self.lo, self.hi = lo, hi
        bounds = f" in {lo}..{hi}" if hi is not None else f" ≥ {lo}" if lo is not None else ""
        self.what = what or self.kind + bounds

    def _typed(self, value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    def ok(self, value) -> bool:
        return self._typed(value) and (self.lo is None or value >= self.lo) and (self.hi is None or value <= self.hi)


class Int(Num):
    """A whole number (not a float, not a boolean), within ``lo..hi`` where given."""
    kind = "an integer"

    def _typed(self, value) -> bool:
        return type(value) is int


class Opt(Spec):
    """``spec``, or null."""

    def __init__(self, spec: Spec):
        self.spec = spec

    def check(self, value, where: str) -> None:
        if value is not None:
            self.spec.check(value, where)


class ListOf(Spec):
    what = "a list"

    def __init__(self, item: Spec):
        self.item = item

    def check(self, value, where: str) -> None:
        if not isinstance(value, list):
            raise _fail(where, f"{_shown(value)} is not a list")
        if type(self.item) is Int and all(type(x) is int for x in value):     # token ids: one pass
            lo, hi = self.item.lo, self.item.hi
            if not value or ((lo is None or min(value) >= lo) and (hi is None or max(value) <= hi)):
                return
        for i, x in enumerate(value):
            self.item.check(x, _at(where, i))


class MapOf(Spec):
    """An object of ``value`` s under keys ``key`` accepts (any key when None)."""
    what = "an object"

    def __init__(self, value: Spec, key: Callable[[str], bool] | None = None, key_what: str = ""):
        self.value, self.key, self.key_what = value, key, key_what

    def check(self, value, where: str) -> None:
        if not isinstance(value, dict):
            raise _fail(where, f"{_shown(value)} is not an object")
        for k, v in value.items():
            if self.key is not None and not self.key(k):
                raise _fail(where, f"key {_shown(k)} is not {self.key_what}")
            self.value.check(v, _at(where, k))


class Obj(Spec):
    """An object: the ``fields`` named are checked where present (``required`` ones must be), others
    are left as they are; ``rule`` checks the object as a whole (an error message, or None)."""
    what = "an object"

    def __init__(self, fields: dict[str, Spec] | None = None, required: tuple[str, ...] = (),
                 rule: Callable[[dict], str | None] | None = None):
        self.fields, self.required, self.rule = fields or {}, required, rule

    def check(self, value, where: str) -> None:
        if not isinstance(value, dict):
            raise _fail(where, f"{_shown(value)} is not an object")
        for name in self.required:
            if name not in value:
                raise _fail(where, f"no {name!r}")
        for name, spec in self.fields.items():
            if name in value:
                spec.check(value[name], _at(where, name))
        why = self.rule(value) if self.rule else None
        if why:
            raise _fail(where, why)


# --------------------------------------------------------------------------- the files

COUNT = Int(0)
TOKENS = ListOf(Int(0))
SECONDS = Num(0)
RATE = Opt(Num())
ANY_OBJECT = Obj()


def _budget(key: str) -> bool:
    return re.fullmatch(r"[1-9][0-9]{0,3}", key) is not None and int(key) <= MAX_BUDGET


def _budgets(value: Spec) -> MapOf:
    return MapOf(value, _budget, f"a DDTree node budget (1..{MAX_BUDGET})")


# an online decoding's time per cycle stage (results rows: Σ seconds; summary.json: seconds per cycle)
STAGE_SECONDS = MapOf(SECONDS, lambda k: k in TREE_STAGES, f"a cycle stage ({', '.join(TREE_STAGES)})")


def _lengths(longest: int) -> ListOf:
    return ListOf(Int(1, longest, f"an acceptance length (1..{longest})"))


def _confidences_fit(row: dict) -> str | None:
    """A cycle with confidences commits at most its drafted positions + 1 tokens."""
    for i, (conf, n) in enumerate(zip(row.get("confidences") or [], row.get("acceptance_lengths") or [])):
        if n > len(conf) + 1:
            return f"cycle {i}: acceptance length {n} with {len(conf)} confidences (at most {len(conf) + 1})"
    return None


def _engine_counts(e: dict) -> str | None:
    return "'cycles' without 'tokens'" if e.get("cycles") and not isinstance(e.get("tokens"), int) else None


ENGINE_ROW = Obj({
    "kind": Opt(Str()), "cycles": Opt(COUNT), "tokens": Opt(COUNT), "tau": RATE, "drafts": Opt(COUNT),
    "accepted": Opt(COUNT), "accepted_per_pos": Opt(ListOf(COUNT)), "histogram": Opt(ListOf(COUNT)),
    "output_ids": Opt(TOKENS), "wall_s": Opt(SECONDS), "tokens_per_s": RATE, "speedup": RATE,
    "plain": Opt(Obj({"wall_s": SECONDS, "output_ids": Opt(TOKENS), "tokens": Opt(COUNT), "tokens_per_s": RATE,
                      "same_output": Opt(Bool())}, required=("wall_s",))),
    "turns": Opt(ListOf(Obj({"output_ids": Opt(TOKENS)}))),
    "checks": Opt(Obj({"overshoot": Opt(Num()), "same_output": Opt(Bool()),
                       "counts": Opt(Obj({"engine": Opt(ANY_OBJECT), "ours": Opt(ANY_OBJECT)})),
                       **{k: Opt(ANY_OBJECT) for k in ("num_speculative_tokens", "dtype", "prompt_difference",
                                                        "output_difference", "first_difference")}})),
    "causes": Opt(ListOf(Str())),
}, rule=_engine_counts)

DIVERGENCE = Opt(Obj({"near_tie": Opt(Bool()), "describe": Opt(Str()), "position": Opt(COUNT), "turn": Opt(COUNT),
                      "margin": RATE}))
_ROW_SPECS: dict[int, Obj] = {}


def row_spec(longest: int) -> Obj:
    """A results.jsonl row of a run whose cycles commit at most ``longest`` tokens (B, or B + 1)."""
    if longest not in _ROW_SPECS:
        lengths = _lengths(longest)
        _ROW_SPECS[longest] = Obj({
            "id": Str(), "category": Opt(Str()), "reference": Opt(Str()),
            "prompt_ids": Opt(TOKENS), "output_ids": Opt(TOKENS), "acceptance_lengths": Opt(lengths),
            "cycles": Opt(COUNT), "tokens": Opt(COUNT), "tau": RATE,
            "ddtree": Opt(_budgets(Obj({"acceptance_lengths": Opt(lengths), "tau": RATE, "output_ids": Opt(TOKENS),
                                        "wall_s": Opt(SECONDS), "cycles_s": Opt(SECONDS), "stage_s": Opt(STAGE_SECONDS),
                                        "lossless": Opt(Bool()), "divergence": DIVERGENCE}))),
            "all_anchors": Opt(Obj({"correct": Opt(ListOf(COUNT)), "count": Opt(ListOf(COUNT))})),
            "expected": Opt(Obj({"alpha_sum": ListOf(Num()), "reach_sum": Opt(ListOf(Num(0))), "count": ListOf(COUNT),
                                 "tau_sum": Num(0), "anchors": COUNT, "expected_tau": RATE},
                                required=("alpha_sum", "count", "tau_sum", "anchors"))),
            "turns": Opt(ListOf(Obj({"prompt_ids": Opt(TOKENS), "output_ids": Opt(TOKENS),
                                     "acceptance_lengths": Opt(lengths), "target_tokens": Opt(COUNT)}))),
            "wall_s": Opt(SECONDS), "target_wall_s": Opt(SECONDS), "target_tokens": Opt(COUNT),
            "lossless": Opt(Bool()),
            "cycles_s": Opt(SECONDS), "stage_s": Opt(STAGE_SECONDS), "divergence": DIVERGENCE,
            "confidences": Opt(ListOf(ListOf(Num(0, 1)))),
            "engine": Opt(ENGINE_ROW),
        }, required=("id",), rule=_confidences_fit)
    return _ROW_SPECS[longest]


_CALIBRATION = Obj({"n": COUNT, **{k: RATE for k in ("ece", "auroc", "brier", "mean_predicted", "mean_observed")}},
                   required=("n", "ece", "auroc", "brier", "mean_predicted", "mean_observed"))
CONFIDENCE = Obj({
    "calibration": Obj({"pooled": _CALIBRATION, "positions": ListOf(_CALIBRATION)}, required=("pooled", "positions")),
    "tau": Obj({"cycles": COUNT, "predicted_tau": RATE, "measured_tau": RATE},
               required=("cycles", "predicted_tau", "measured_tau")),
    "verify_budget": Obj({"points": ListOf(Obj({"threshold": Num(), "tau": RATE, "mean_verify_len": RATE,
                                                "tau_per_verify_token": RATE}, required=("threshold",)))},
                         required=("points",)),
}, required=("calibration", "tau", "verify_budget"))

PER_CYCLE = {"s_per_cycle": Opt(SECONDS), "stage_s_per_cycle": Opt(STAGE_SECONDS)}
SUMMARY = Obj({
    "mode": Opt(Str()), "block_size": Unchecked(),        # bounded where the reader takes the run's block size
    **{k: Opt(COUNT) for k in ("prompts", "responses", "cycles", "tokens")},
    **{k: RATE for k in ("tau_macro", "tau_pooled", "tau_macro_turns", "tau_sglang")},
    "acceptance_histogram": Opt(MapOf(COUNT)),
    **{k: Opt(ListOf(Num())) for k in ("per_position_acceptance", "all_anchors_accuracy", "all_anchors_cumulative")},
    "ddtree": Opt(_budgets(Obj({"tau_macro": RATE, "tau_pooled": RATE, "prompts": Opt(COUNT), "wall_s": Opt(SECONDS),
                                "tokens_per_s": RATE, "target_tokens_per_s": RATE, "speedup": RATE,
                                "lossless": Opt(Bool()), **PER_CYCLE}))),
    "expected": Opt(Obj({"label": Opt(Str()), "alpha": Opt(ListOf(RATE)), "tau_macro": RATE, "tau_pooled": RATE,
                         "per_position_acceptance": Opt(ListOf(Num())), "anchors": Opt(COUNT), "prompts": Opt(COUNT)})),
    "online": Opt(Obj({"wall_s": Opt(SECONDS), "target_wall_s": Opt(SECONDS), "target_tokens": Opt(COUNT),
                       "tokens_per_s": RATE,
                       "target_tokens_per_s": RATE, "speedup": RATE, "lossless": Opt(Bool()),
                       "near_tie_divergences": Opt(COUNT), **PER_CYCLE})),
    "engine": Opt(Obj({"kind": Opt(Str()), "prompts": Opt(COUNT), "tau_macro": RATE, "tau_pooled": RATE,
                       "speedup": RATE, "causes": Opt(MapOf(COUNT))})),
    "confidence": Opt(CONFIDENCE),
    "invalid": Opt(Obj({"message": Opt(Str()), "prompt": Opt(Str())})),
})

_ENGINE_ENV = Obj({"kind": Opt(Str()), "version": Opt(Str())})
SETTINGS = Obj({
    "mode": Opt(Str()), "block_size": Unchecked(), "verify_block": Unchecked(),   # bounded where the reader takes them
    "max_new_tokens": Opt(COUNT), "max_blocks": Opt(COUNT), "enable_thinking": Opt(Bool()),
    "temperature": Opt(Num(0)), "top_p": Opt(Num(0, 1)), "top_k": Opt(COUNT), "seed": Opt(Int()),
    "ddtree_budgets": Opt(ListOf(Int(1, MAX_BUDGET))), "all_anchors": Opt(Bool()), "reference": Opt(Str()),
    "sglang_url": Opt(Str()), "stop_token_ids": Opt(ListOf(Int())), "stop_rule": Opt(Str()),
    "semantics": Opt(Str()),
})
ENV = Obj({
    **{k: Opt(Str()) for k in ("host", "device", "gpu", "dtype", "kernel_path", "started_at", "finished_at")},
    "versions": Opt(ANY_OBJECT),
    "drafter": Opt(Obj({"path": Opt(Str()), "format": Opt(Str()), "config": Opt(ANY_OBJECT),
                        "variant": Opt(ANY_OBJECT)})),
    "target": Opt(Obj({"path": Opt(Str()), "model_type": Opt(Str()),
                       "identity": Opt(Obj({"config_sha256": Opt(Str()), "weights": Opt(MapOf(COUNT))}))})),
    "forced": Opt(ListOf(MapOf(Str()))),    # what `eval --resume --force` resumed despite
    "suite": Opt(Obj({"name": Opt(Str()), "sha256": Opt(Str()), "prompts": Opt(COUNT), "ids": Opt(ListOf(Str()))})),
    "settings": Opt(SETTINGS), "seed": Opt(Int()), "command": Opt(ListOf(Str())),
    "engine": Opt(_ENGINE_ENV), "shards": Opt(ListOf(Obj({"engine": Opt(_ENGINE_ENV)}))),
})


def check_row(row, longest: int) -> None:
    """A results.jsonl row (``longest``: the most tokens one cycle of the run commits)."""
    row_spec(longest).check(row, "")


def check_summary(summary) -> None:
    SUMMARY.check(summary, "")


def check_env(env) -> None:
    ENV.check(env, "")
