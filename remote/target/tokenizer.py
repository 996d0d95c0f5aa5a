"""A tiny, deterministic Qwen-style chat tokenizer for tests and the demo target (no hub access).

Byte-level BPE over printable ASCII (plus tab and newline) trained with ``tokenizers`` on the default
suite and a few built-in paragraphs. Any other character is normalized to ``?`` so every input encodes
(nothing is silently dropped). The whole vocabulary, special tokens included, stays below
``vocab_size``, so with the default 255 every id is < 255 and id 255 stays free for a drafter's mask
token on a 256-row tiny target (remote/drafters/tiny.py).
"""
from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # special: dropped by skip_special_tokens
THINK_TOKENS = ["<think>", "</think>"]  # added but not special, as in Qwen3 (kept when decoding)

# Qwen3-style template: `<|im_start|>role\n...<|im_end|>\n`; with add_generation_prompt and
# enable_thinking=False an empty think block is emitted so the model answers directly.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

PARAGRAPHS = [
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n    return a + b\n\n\nfor i in range(10):\n    print(add(i, i))\n",
    "If a shirt costs 12 dollars and is discounted by 25 percent, the new price is 12 - 3 = 9 dollars. "
    "The answer is 9.",
    "Speculative decoding lets a small draft model propose several tokens that the target model then "
    "verifies in one forward pass; greedy verification keeps the output identical to the target's own.",
    "Hello! How can I help you today? Sure, here is a short answer, followed by an example and a summary.",
    "import json\nwith open('data.jsonl') as f:\n    rows = [json.loads(line) for line in f if line.strip()]\n",
]


def _training_text() -> list[str]:
    texts = list(PARAGRAPHS)
    default = Path(__file__).parents[1] / "suites" / "default.jsonl"
    for line in default.read_text(encoding="utf-8").splitlines():
        if line.strip():
            texts.extend(json.loads(line).get("turns", []))
    return texts


def _alphabet() -> list[str]:
    """The byte-level symbols of tab, newline and printable ASCII."""
    from tokenizers import pre_tokenizers

    chars = "\t\n" + "".join(chr(c) for c in range(32, 127))
    (mapped, _), = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(chars)
    return list(mapped)


def build_tiny_tokenizer(out_dir, vocab_size: int = 255):
    """Train, save (``save_pretrained(out_dir)``) and return the tiny tokenizer.

    ``AutoTokenizer.from_pretrained(out_dir)`` then loads it offline. Deterministic: the same
    ``vocab_size`` gives the same vocabulary and merges.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = _alphabet()
    extra = len(SPECIAL_TOKENS) + len(THINK_TOKENS)
    if vocab_size < len(alphabet) + extra:
        raise ValueError(f"vocab_size {vocab_size} is too small: the alphabet and special tokens need "
                         f"{len(alphabet) + extra}")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(Regex(r"[^\t\n\x20-\x7e]"), "?")
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - extra, initial_alphabet=alphabet,
                                  limit_alphabet=len(alphabet), special_tokens=[], show_progress=False)
    tok.train_from_iterator(_training_text(), trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 model_max_length=4096)
    hf.chat_template = CHAT_TEMPLATE
    assert len(hf) <= vocab_size, (len(hf), vocab_size)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out_dir))
    return hf
