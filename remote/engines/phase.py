"""The worker's engine phase (``eval --engine``): the run's prompts served by the host's engine,
with the run's drafter and without it, beside our own online decoding of the same prompts.

Where the engine is comes from the worker's own arguments (the host's inventory entry, never the
run's settings): ``--engine-kind vllm|sglang`` and ``--engine-python PATH`` (servers we start:
one with the drafter, one without, each in its own process group on a free loopback port, their
logs ``engine-drafter.log`` / ``engine-plain.log`` in the output folder, stopped at the end, on
SIGTERM (``cancel``) and by a later worker of the run should this one be killed: ``engine.pids``)
or ``--engine-url URL`` (a server already running, used only once it is checked to serve this
target with this drafter's draft length; no server without the drafter, so no speedup).

Per prompt, :func:`serve_row` sends every turn as the run sends it to our own decoding (a chat turn
as messages with the run's thinking setting, rendered by the engine's own template on vLLM, whose
rendering is checked against ours; a token-id prompt, and every SGLang turn, as token ids), with
the run's stop tokens, temperature and max new tokens, and returns the row's ``engine`` object
(docs/run-format.md): the engine's own counts, its output, time and speed, the same without the
drafter, and the checks that say why its τ differs from ours (:func:`explain`). Stdlib only;
the one check that needs our models (the drafter computed as the engine computes it,
:mod:`remote.engines.quirks`) is the worker's ``rerun`` callback.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from remote.contract.engines import DECODING_CAUSES, ENGINES, KINDS, LOGS
from remote.engines import engine
from remote.engines.accounting import engine_overshoot, reconcile
from remote.engines.server import kill_recorded

PIDS = "engine.pids"
# On a GPU the two servers share the worker's GPU(s) with its own target and drafter: each gets this
# share of GPU memory instead of the engine's default (vLLM 0.9, which leaves no room for the second
# server). The inventory's `args` come after it, so they can set another.
GPU_SHARE = 0.3


def add_arguments(parser) -> None:
    g = parser.add_argument_group("the host's serving engine (with --engine; from the inventory's `engine:`)")
    g.add_argument("--engine-kind", choices=KINDS, default=None, help="vllm or sglang")
    g.add_argument("--engine-python", default=None, metavar="PATH",
                   help="the engine's own environment's python: servers are started there")
    g.add_argument("--engine-url", default=None, metavar="URL",
                   help="a server already running (as seen from this host), used once checked")
    g.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for the servers we start (repeat it)")


def argument_problems(args, settings) -> list[str]:
    """What is wrong with the engine's flags (``args``) for a run of ``settings``."""
    if not settings.engine:
        return []
    if not args.engine_kind:
        return ["--engine needs the host's engine: --engine-kind vllm|sglang with --engine-python PATH or "
                "--engine-url URL (dflash-ops passes the inventory's `engine:`)"]
    if bool(args.engine_python) == bool(args.engine_url):
        return ["--engine: give exactly one of --engine-python (start the engine) and --engine-url (use a server "
                "already running)"]
    return []


def client_for(kind: str, url: str):
    """A client of a running ``kind`` server at ``url``."""
    return engine(kind).Client(url)


@dataclass
class TurnRequest:
    """One turn as the engine is asked it."""
    prompt_ids: list[int]           # our rendering (sent as is for token-id prompts and SGLang)
    messages: list[dict] | None     # a chat turn: the engine renders it with its own template (vLLM)
    enable_thinking: bool | None
    max_new_tokens: int
    stop_token_ids: list[int]
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


@dataclass
class OurTurn:
    """The same turn decoded by us (online)."""
    prompt_ids: list[int]
    output_ids: list[int]
    acceptance_lengths: list[int]


class EnginePhase:
    """The engine servers of one worker and how to ask them."""

    def __init__(self, kind: str, target: str, drafter: str, out: Path, num_drafts: int, python: str | None = None,
                 url: str | None = None, extra_args: list[str] | tuple = (), dtype: str | None = None, seed: int = 0,
                 device: str = "cpu",
                 log: Callable[[str], None] = lambda _: None):
        self.kind, self.target, self.drafter, self.out = kind, str(target), str(drafter), Path(out)
        self.num_drafts, self.python, self.url, self.extra_args = int(num_drafts), python, url, list(extra_args)
        self.dtype, self.seed, self.log = dtype, seed, log
        self.module = engine(kind)
        if str(device).startswith("cuda"):
            self.extra_args = [self.module.GPU_SHARE_FLAG, str(GPU_SHARE)] + self.extra_args
        self.servers: dict = {}
        self.clients: dict = {}
        self.served: dict = {}
        self.versions: dict | None = None

    @property
    def name(self) -> str:
        return ENGINES[self.kind].name

    @property
    def quirk(self) -> str | None:
        """A known way this engine computes the drafter differently (:mod:`remote.engines.quirks`)."""
        return self.module.QUIRK

    def launch(self) -> "EnginePhase":
        """Start our servers without waiting for them (the worker loads its models meanwhile), or
        check the running one. A server an earlier worker of this run left behind is killed first."""
        self.out.mkdir(parents=True, exist_ok=True)
        left = kill_recorded(self.out / PIDS)
        if left:
            self.log(f"killed the engine server(s) an earlier worker of this run left running: pid {left}")
        if self.url:
            client = client_for(self.kind, self.url)
            self.served["drafter"] = client.check_serves(self.target, self.num_drafts, True, drafter=self.drafter)
            self.clients["drafter"] = client
            return self
        self.versions = self.module.engine_versions(self.python)
        for name, drafter in (("drafter", self.drafter), ("plain", None)):
            log_path = self.out / LOGS[name]
            log_path.unlink(missing_ok=True)
            server = self.module.launch(self.target, drafter, log_path, python=self.python, num_drafts=self.num_drafts,
                                        dtype=self.dtype, seed=self.seed, extra_args=self.extra_args)
            server.process.name = f"{self.name} server {'with' if drafter else 'without'} the drafter"
            server.process.record(self.out / PIDS)
            self.servers[name] = server
            self.clients[name] = server.client
        return self

    def wait(self, timeout: float | None = None) -> "EnginePhase":
        """Our servers answering, and serving what they were started with (checked, not assumed)."""
        for name, server in self.servers.items():
            server.wait_ready(timeout or self.module.START_TIMEOUT)
            self.log(f"{server.process.name} ready in {server.startup_s:.0f}s at {server.url}")
        for name, server in self.servers.items():
            spec = name == "drafter"
            self.served[name] = server.client.check_serves(self.target, self.num_drafts if spec else None, spec,
                                                           drafter=self.drafter if spec else None)
        return self

    def describe(self) -> dict:
        """env.json's ``engine``."""
        return {"kind": self.kind, "python": self.python, "url": self.url, "versions": self.versions,
                "version": (self.versions or {}).get(self.kind) or (self.served.get("drafter") or {}).get("version"),
                "num_speculative_tokens": self.num_drafts, "dtype": self.dtype, "extra_args": self.extra_args,
                "served": self.served,
                "servers": {name: {"url": s.url, "argv": s.argv, "startup_s": s.startup_s, "log": LOGS[name]}
                            for name, s in self.servers.items()}}

    def served_dtype_differs(self) -> str | None:
        """The dtype a running server reports when it is not ours (None: the same, or not known)."""
        got = (self.served.get("drafter") or {}).get("dtype")
        return got if got and self.dtype and got not in ("auto", self.dtype) else None

    def request(self, name: str, turn: TurnRequest) -> dict:
        client = self.clients[name]
        kw = {"temperature": turn.temperature, "top_p": turn.top_p, "top_k": turn.top_k, "seed": turn.seed}
        if turn.messages is not None and client.renders_chat:
            template = None if turn.enable_thinking is None else {"enable_thinking": turn.enable_thinking}
            return client.chat(turn.messages, turn.max_new_tokens, turn.stop_token_ids, template, **kw)
        return client.complete(turn.prompt_ids, turn.max_new_tokens, turn.stop_token_ids, **kw)

    def stop(self, grace: float = 20.0) -> None:
        """Stop our servers (SIGTERM to each group, SIGKILL after ``grace`` s); safe to repeat and to
        call from a signal handler."""
        for server in self.servers.values():
            server.stop(grace)
        if self.servers:
            (self.out / PIDS).unlink(missing_ok=True)


# ----------------------------------------------------------------------------- one prompt


def serve_row(phase: EnginePhase, requests: list[TurnRequest], ours: list[OurTurn], block_size: int,
              rerun: Callable[[int], list[int] | None] | None = None) -> dict:
    """The row's ``engine`` object: every turn served with the drafter (and without, when we run that
    server), combined (:func:`combine`), checked against our own decoding (:func:`checks`) and
    explained (:func:`explain`). ``rerun(turn)``: our acceptance lengths of that turn with the
    drafter computed as the engine computes it (its quirk; None where that changes nothing)."""
    spec = [phase.request("drafter", t) for t in requests]
    plain = [phase.request("plain", t) for t in requests] if "plain" in phase.clients else None
    engine = combine(phase.kind, spec, plain)
    c = checks(spec, requests, ours, block_size, phase.num_drafts)
    if phase.served_dtype_differs():
        c["dtype"] = {"engine": phase.served_dtype_differs(), "ours": phase.dtype}
    if rerun is not None and c["same_output"] and c["temperature"] == 0 and c["first_difference"] is not None:
        c["kernel"] = kernel_check(spec, ours, block_size, rerun, phase.quirk)
    engine["checks"] = c
    engine["causes"] = explain(c)
    return engine


def _sum(values):
    return None if any(v is None for v in values) else sum(values)


def _sum_lists(lists):
    if any(v is None for v in lists):
        return None
    width = max(len(v) for v in lists)
    return [sum((v + [0] * width)[i] for v in lists) for i in range(width)]


TURN_KEYS = ("output_ids", "finish_reason", "cycles", "tokens", "drafts", "accepted", "accepted_per_pos", "histogram",
             "per_step_accepted", "tau", "wall_s", "metrics_delta")


def combine(kind: str, spec: list[dict], plain: list[dict] | None) -> dict:
    """One row's engine counts from its turns' answers (:func:`remote.engines.vllm.result`): sums,
    the last turn's output, τ = tokens / cycles exactly as the engine counts a request (pooled over
    turns), and the same prompt without the drafter: its time, speed and whether it output the same."""
    cycles, tokens = _sum([t["cycles"] for t in spec]), _sum([t["tokens"] for t in spec])
    wall = sum(t["wall_s"] for t in spec)
    out_tokens = sum(len(t["output_ids"]) for t in spec)
    deltas = [t.get("metrics_delta") for t in spec]
    e = {"kind": kind, "cycles": cycles, "tokens": tokens, "tau": tokens / cycles if cycles else None,
         "drafts": _sum([t["drafts"] for t in spec]), "draft_tokens": _sum([t["draft_tokens"] for t in spec]),
         "accepted": _sum([t["accepted"] for t in spec]),
         "accepted_per_pos": _sum_lists([t["accepted_per_pos"] for t in spec]),
         "histogram": _sum_lists([t["histogram"] for t in spec]),
         "per_step_accepted": None if any(t["per_step_accepted"] is None for t in spec)
         else [a for t in spec for a in t["per_step_accepted"]],
         "num_speculative_tokens": spec[0]["num_speculative_tokens"],
         "output_ids": spec[-1]["output_ids"], "finish_reason": spec[-1]["finish_reason"],
         "wall_s": wall, "tokens_per_s": out_tokens / wall if wall > 0 else None,
         "engine_timing": spec[-1].get("engine_timing"),
         "metrics_delta": None if any(d is None for d in deltas) else
         {k: _sum_lists([d[k] for d in deltas]) if k == "accepted_per_pos" else sum(d[k] for d in deltas)
          for k in deltas[0]}}
    if len(spec) > 1:
        e["turns"] = [{k: t.get(k) for k in TURN_KEYS} for t in spec]
    if plain is not None:
        plain_wall = sum(t["wall_s"] for t in plain)
        plain_tokens = sum(len(t["output_ids"]) for t in plain)
        e["plain"] = {"output_ids": plain[-1]["output_ids"], "wall_s": plain_wall, "tokens": plain_tokens,
                      "tokens_per_s": plain_tokens / plain_wall if plain_wall > 0 else None,
                      "same_output": all(p["output_ids"] == s["output_ids"] for p, s in zip(plain, spec))}
        e["speedup"] = (e["tokens_per_s"] / e["plain"]["tokens_per_s"]   # each its own tokens: at T > 0 two samples
                        if e["tokens_per_s"] is not None and e["plain"]["tokens_per_s"] else None)
    return e


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def checks(spec: list[dict], requests: list[TurnRequest], ours: list[OurTurn], block_size: int,
           num_drafts: int) -> dict:
    """What can be checked about one prompt without our models: the prompt the engine rendered
    (chat turns) against ours, its output against ours, its draft length against the drafter's,
    the temperature, whether its τ counts the prefill's token, its overshoot past the output, and
    per turn the step-by-step reconciliation with our cycles (:func:`remote.engines.accounting.reconcile`)."""
    c: dict = {"temperature": requests[0].temperature}
    chat = [i for i, r in enumerate(requests) if r.messages is not None and spec[i].get("prompt_ids") is not None]
    c["prompt_match"] = all(spec[i]["prompt_ids"] == ours[i].prompt_ids for i in chat) if chat else None
    for i in chat:
        if spec[i]["prompt_ids"] != ours[i].prompt_ids:
            c["prompt_difference"] = {"turn": i, "position": _first_difference(spec[i]["prompt_ids"], ours[i].prompt_ids),
                                      "engine_tokens": len(spec[i]["prompt_ids"]), "our_tokens": len(ours[i].prompt_ids)}
            break
    c["same_output"] = all(s["output_ids"] == o.output_ids for s, o in zip(spec, ours))
    for i, (s, o) in enumerate(zip(spec, ours)):
        pos = _first_difference(s["output_ids"], o.output_ids)
        if pos is not None:
            at = lambda ids: ids[pos] if pos < len(ids) else None   # noqa: E731
            c["output_difference"] = {"turn": i, "position": pos, "engine": at(s["output_ids"]),
                                      "ours": at(o.output_ids)}
            break
    c["num_speculative_tokens"] = {"engine": spec[0]["num_speculative_tokens"], "drafter": num_drafts}
    known = [s for s in spec if s["accepted"] is not None and s["tokens"] is not None]
    c["counts_prefill_token"] = bool(known) and all(s["tokens"] - s["cycles"] - s["accepted"] == 1 for s in known)
    c["overshoot"] = sum(engine_overshoot(s) for s in known) if known else 0
    # the overshoot is the last step's matched drafts past the end: never negative, never more than
    # that step accepted (K where the steps are not reported)
    c["overshoot_fits"] = all(0 <= engine_overshoot(s) <= (s["per_step_accepted"][-1] if s["per_step_accepted"]
                                                           else s["num_speculative_tokens"] or 0) for s in known)
    c["finish_reasons"] = [s["finish_reason"] for s in spec]
    c["reconcile"] = [reconcile(s, o.acceptance_lengths, block_size) if o.acceptance_lengths and s["cycles"] else None
                      for s, o in zip(spec, ours)]
    firsts = [(i, r["first_difference"]) for i, r in enumerate(c["reconcile"])
              if r and r["first_difference"] is not None]
    c["first_difference"] = {"turn": firsts[0][0], "cycle": firsts[0][1]} if firsts else None
    c["steps_known"] = all(s["per_step_accepted"] is not None for s in spec)
    our_cycles = sum(len(o.acceptance_lengths) for o in ours)
    our_tokens = sum(sum(o.acceptance_lengths) for o in ours)
    e_cycles, e_tokens = _sum([s["cycles"] for s in spec]), _sum([s["tokens"] for s in spec])
    c["counts"] = {"engine": {"cycles": e_cycles, "accepted": _sum([s["accepted"] for s in spec])},
                   "ours": {"cycles": our_cycles, "accepted": our_tokens - our_cycles}}
    c["tau"] = {"engine": e_tokens / e_cycles if e_cycles else None,
                "ours": our_tokens / our_cycles if our_cycles else None}
    c["last_cycles"] = _steps_differ(spec, [o.acceptance_lengths for o in ours]) if c["steps_known"] else None
    return c


def _steps_differ(spec: list[dict], lengths: list[list[int]]) -> bool:
    return any(list(s["per_step_accepted"]) != [int(n) - 1 for n in ls] for s, ls in zip(spec, lengths))


def kernel_check(spec: list[dict], ours: list[OurTurn], block_size: int,
                 rerun: Callable[[int], list[int] | None], quirk: str) -> dict:
    """Our decoding redone with the drafter computed as the engine computes it (``quirk``, e.g.
    vLLM's CPU context-key norm): ``reproduces`` when then every full-block cycle's count equals the
    engine's, on every turn; ``last_cycles``: whether the steps still differ after that (the cut
    last blocks)."""
    lengths = []
    for i in range(len(ours)):
        got = rerun(i)
        if got is None:
            return {"check": quirk, "applicable": False, "reproduces": False}
        lengths.append(got)
    recs = [reconcile(s, ls, block_size) for s, ls in zip(spec, lengths)]
    return {"check": quirk, "applicable": True,
            "reproduces": all(r["first_difference"] is None for r in recs),
            "last_cycles": _steps_differ(spec, lengths),
            "cycles": [len(ls) for ls in lengths], "accepted": [sum(ls) - len(ls) for ls in lengths]}


def explain(c: dict) -> list[str]:
    """The causes (:data:`remote.contract.engines.CAUSES`) that checks show for a prompt whose engine τ differs from ours:
    none when both τ agree. Something that changes what is decoded (the prompt the engine
    rendered, its draft length, sampling, dtype, an output that differs) is named first, and then
    no step-by-step cause is claimed; otherwise the ways the same decoding is counted or drafted:
    the prefill's token in the engine's τ, matched drafts past a stop token or max_tokens, the cut
    last blocks, a drafter the engine computes differently (reproduced by its engine's quirk, or not)."""
    tau = c["tau"]
    if tau["engine"] is None or tau["ours"] is None or abs(tau["engine"] - tau["ours"]) < 1e-9:
        return []
    out = []
    if c["prompt_match"] is False:
        out.append("template")
    k = c["num_speculative_tokens"]
    if k["engine"] is not None and k["engine"] != k["drafter"]:
        out.append("num_draft_tokens")
    if c["temperature"] > 0:
        out.append("temperature")
    if c.get("dtype"):
        out.append("dtype")
    if not c["same_output"] and not out:
        out.append("divergence")
    if c["counts_prefill_token"]:
        out.append("prefill_token")
    if any(cause in out for cause in DECODING_CAUSES):
        return out
    if c["overshoot"] > 0 and c["overshoot_fits"]:
        out.append("stop_overshoot" if "stop" in c["finish_reasons"] else "length_overshoot")
    kernel = c.get("kernel")
    if c["first_difference"] is not None:
        out.append("kernel_quirk" if kernel and kernel["reproduces"] else "drafter_differs")
        if kernel and kernel["reproduces"] and kernel["last_cycles"]:
            out.append("last_cycles")
    elif c["last_cycles"]:
        out.append("last_cycles")
    counts = c["counts"]
    if not out or not c["overshoot_fits"] or (out == ["prefill_token"] and counts["engine"] != counts["ours"]):
        out.append("unexplained")
    return out


def chat_messages(turn_texts: list[str], outputs: list[list[int]], decode: Callable[[list[int]], str]) -> list[list[dict]]:
    """Each turn's messages as our decoding saw them (remote.suites.prompts.reference_turns): the earlier
    user turns, our earlier answers decoded to text, and the new user turn."""
    messages, out = [], []
    for i, text in enumerate(turn_texts):
        messages = messages + [{"role": "user", "content": text}]
        out.append(list(messages))
        if i < len(outputs):
            messages = messages + [{"role": "assistant", "content": decode(outputs[i])}]
    return out
