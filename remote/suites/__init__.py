"""Prompt suites: the built-in JSONL files beside this package's modules, users' files, Hugging Face
data sets, chat formatting and turn-by-turn reference completions."""
