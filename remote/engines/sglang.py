"""SGLang as the serving engine: start its server with a DFlash drafter (or none), generate from
token ids through its native ``/generate``, and read the engine's own acceptance counters.

(Reference completions from an SGLang server the user runs are :mod:`remote.engines.sglang_client`; this module
is the engine beside our own decoding, ``eval --engine`` with ``engine: {kind: sglang, ...}``.)

The server is ``python -m sglang.launch_server --model-path TARGET --speculative-algorithm DFLASH
--speculative-draft-model-path DRAFTER --speculative-num-draft-tokens B`` (B: the drafter's block,
the anchor included). What SGLang counts, per request (``meta_info``; ``tokenizer_manager.py``
``_calculate_spec_decoding_metrics``):

- ``spec_verify_ct``: verify steps (the prefill is none);
- ``spec_accept_token_num``: draft tokens accepted; ``spec_draft_token_num`` = steps × (B − 1);
- ``spec_accept_histogram[n]``: steps that accepted n drafts;
- ``spec_accept_length`` (the engine's τ) = ``completion_tokens / spec_verify_ct``: every output
  token over the steps, **the prefill's token included** (vLLM's τ leaves it out).

Nothing here imports SGLang; the engine runs in its own environment and is spoken to over HTTP.
"""
from __future__ import annotations

import time
from pathlib import Path

from remote.contract.engines import ENGINES
from remote.engines.counts import Answer
from remote.engines.server import (LOOPBACK, EngineError, HTTPClient, OwnServer, ServerProcess, check_port_free,
                                   check_served, environment_python, environment_versions, free_port)

KIND = "sglang"
PYTHON_ENV, INSTALL = ENGINES[KIND].python_env, ENGINES[KIND].install
SERVER_MODULE = "sglang.launch_server"
ALGORITHM = "DFLASH"                        # SGLang's speculative algorithm for DFlash drafters
START_TIMEOUT = 900.0
GPU_SHARE_FLAG = "--mem-fraction-static"    # the share of GPU memory a server takes
QUIRK = None                                # no known way it computes the drafter differently


def engine_python(python: str | None = None) -> str:
    return environment_python(python, PYTHON_ENV, "SGLang", INSTALL)


def engine_versions(python: str, timeout: float = 120.0) -> dict:
    """``{"sglang": VERSION, "distribution": "sglang", "torch": ..., "transformers": ...}``."""
    return environment_versions(engine_python(python), "sglang", "SGLang", INSTALL, timeout)


def server_argv(python: str, target: str | Path, drafter: str | Path | None = None, block_size: int | None = None,
                port: int = 30000, host: str = LOOPBACK, dtype: str | None = None, seed: int = 0,
                extra_args: list[str] | tuple = ()) -> list[str]:
    """The server's argv; with a drafter, DFlash speculative decoding with ``block_size`` draft
    tokens per verify (SGLang counts the anchor among them). The radix cache is off so every
    request prefills (and drafts from) its whole prompt."""
    argv = [python, "-m", SERVER_MODULE, "--model-path", str(target), "--host", host, "--port", str(int(port)),
            "--random-seed", str(int(seed)), "--disable-radix-cache", "--enable-metrics"]
    if dtype:
        argv += ["--dtype", dtype]
    if drafter is not None:
        argv += ["--speculative-algorithm", ALGORITHM, "--speculative-draft-model-path", str(drafter),
                 "--speculative-num-draft-tokens", str(int(block_size))]
    return argv + [str(a) for a in extra_args]


def result(answer: dict, wall_s: float) -> dict:
    """One ``/generate`` answer as :func:`remote.engines.vllm.result` 's dict: ``drafts`` = verify
    steps, ``accepted``, ``histogram`` (steps by drafts accepted), ``accepted_per_pos`` (from the
    histogram), ``tau`` = SGLang's ``spec_accept_length`` with ``tokens`` = completion tokens and
    ``cycles`` = verify steps; no per-step counts (SGLang reports none)."""
    if isinstance(answer, list) and len(answer) == 1:
        answer = answer[0]
    if not isinstance(answer, dict) or not isinstance(answer.get("output_ids"), list):
        raise EngineError(f"SGLang answered /generate without output_ids: {str(answer)[:300]}", "bad_answer")
    meta = answer.get("meta_info") or {}
    output_ids = [int(i) for i in answer["output_ids"]]
    finish = meta.get("finish_reason")
    completion = int(meta.get("completion_tokens", len(output_ids)))
    out = Answer(output_ids, None, finish.get("type") if isinstance(finish, dict) else finish, completion, wall_s,
                 {k: meta.get(k) for k in ("e2e_latency", "decode_throughput")})
    steps = meta.get("spec_verify_ct")
    if steps:
        hist = [int(n) for n in meta.get("spec_accept_histogram") or []] or None
        accepted = meta.get("spec_accept_token_num")
        if accepted is None and hist:
            accepted = sum(n * c for n, c in enumerate(hist))
        draft_tokens = meta.get("spec_draft_token_num")
        k = int(draft_tokens) // int(steps) if draft_tokens else (len(hist) - 1 if hist else None)
        out.cycles, out.tokens, out.drafts = int(steps), completion, int(steps)
        out.draft_tokens = int(draft_tokens) if draft_tokens is not None else None
        out.accepted = int(accepted) if accepted is not None else None
        out.histogram, out.num_speculative_tokens = hist, k
        out.tau = float(meta.get("spec_accept_length") or completion / int(steps))
        out.accepted_per_pos = [sum(hist[p + 1:]) for p in range(k)] if hist and k else None
    return out.as_dict()


class SGLangEngineClient:
    """Talks to one SGLang server at ``url`` (native API). ``process``: the :class:`ServerProcess`
    when the server is ours (a failed request then says whether it died)."""

    kind = KIND
    renders_chat = False    # every turn is sent as token ids (our rendering)

    def __init__(self, url: str, timeout: float = 600.0, process: ServerProcess | None = None):
        self.url, self.process = url.rstrip("/"), process
        self.http = HTTPClient(self.url, timeout, name="SGLang server", on_failure=process.failure if process else None)

    def healthy(self, timeout: float = 5.0) -> bool:
        return self.http.ok("/health", timeout)

    def server_info(self) -> dict:
        try:
            info = self.http.json("GET", "/get_server_info", timeout=30)
        except EngineError as e:
            if e.status != 404:
                raise
            info = self.http.json("GET", "/server_info", timeout=30)
        if not isinstance(info, dict):
            raise EngineError(f"SGLang server at {self.url}: server info is not a JSON object", "bad_answer")
        return info

    def served(self) -> dict:
        """What the server says it serves: version, model path, dtype, whether it speculates, with
        which algorithm, drafter and draft tokens per verify (B − 1: SGLang counts the anchor)."""
        info = self.server_info()
        tokens = info.get("speculative_num_draft_tokens")
        algorithm = info.get("speculative_algorithm")
        return {"url": self.url, "version": info.get("version"), "model": info.get("model_path"),
                "root": info.get("model_path"), "dtype": info.get("dtype"), "speculative": bool(algorithm),
                "algorithm": algorithm, "drafter": info.get("speculative_draft_model_path"),
                "num_speculative_tokens": int(tokens) - 1 if tokens else None}

    def check_serves(self, target: str | Path | None = None, num_speculative_tokens: int | None = None,
                     speculative: bool = True, drafter: str | Path | None = None) -> dict:
        """The served settings, or EngineError (``mismatch``) naming what differs: the model, the
        drafter, speculation on/off, the algorithm, the draft tokens per verify."""
        got = self.served()
        problems = []
        if target is not None and not _same_path(got["model"], target):
            problems.append(f"it serves {got['model']}, not {target}")
        if speculative and got["speculative"] and str(got["algorithm"]).upper() != ALGORITHM:
            problems.append(f"its speculative algorithm is {got['algorithm']}, not {ALGORITHM}")
        if speculative and drafter is not None and got["drafter"] and not _same_path(got["drafter"], drafter):
            problems.append(f"its drafter is {got['drafter']}, not {drafter}")
        return check_served("SGLang server", self.url, got, problems, speculative, num_speculative_tokens)

    def complete(self, prompt_ids: list[int], max_tokens: int, stop_token_ids: list[int] | None = None,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None) -> dict:
        """One completion from token ids, with exactly the given stop tokens (the model's own EOS is
        ignored unless listed); :func:`result` 's dict."""
        params = {"temperature": float(temperature), "top_p": float(top_p), "max_new_tokens": int(max_tokens),
                  "stop_token_ids": [int(i) for i in (stop_token_ids or [])], "ignore_eos": True}
        if top_k:
            params["top_k"] = int(top_k)
        t0 = time.perf_counter()
        answer = self.http.json("POST", "/generate", {"input_ids": [int(i) for i in prompt_ids],
                                                      "sampling_params": params})
        return result(answer, time.perf_counter() - t0)


def _same_path(served: str | None, want: str | Path) -> bool:
    want = str(Path(want).expanduser())
    return served is not None and served.rstrip("/") in (want.rstrip("/"), str(Path(want).resolve()))


class SGLangServer(OwnServer):
    """An SGLang server this process started and owns (:class:`remote.engines.server.OwnServer`)."""

    name = "SGLang server"
    client_class = SGLangEngineClient

    @classmethod
    def launch(cls, target: str | Path, drafter: str | Path | None = None, log_path: str | Path = "sglang.log",
               python: str | None = None, block_size: int | None = None, port: int | None = None,
               dtype: str | None = None, seed: int = 0, extra_args: list[str] | tuple = ()) -> "SGLangServer":
        python = engine_python(python)
        if port is None:
            port = free_port()
        else:
            check_port_free(port)
        argv = server_argv(python, target, drafter, block_size, port, LOOPBACK, dtype, seed, extra_args)
        process = ServerProcess(argv, log_path, name=cls.name)
        settings = {"target": str(target), "drafter": str(drafter) if drafter is not None else None,
                    "num_speculative_tokens": block_size - 1 if drafter is not None and block_size else None,
                    "dtype": dtype, "seed": seed, "port": port}
        return cls(process, f"http://{LOOPBACK}:{port}", argv, None, settings)

    def wait_ready(self, timeout: float = START_TIMEOUT) -> "SGLangServer":
        return super().wait_ready(timeout)


Client = SGLangEngineClient


def launch(target: str | Path, drafter: str | Path | None, log_path: str | Path, *, python: str | None,
           num_drafts: int, dtype: str | None, seed: int, extra_args: list[str] | tuple = ()) -> SGLangServer:
    """A server for the engine phase (:mod:`remote.engines.phase`), not waited for: ``num_drafts`` + 1
    draft tokens per verify (SGLang counts the anchor among them)."""
    return SGLangServer.launch(target, drafter, log_path, python=python, block_size=num_drafts + 1, dtype=dtype,
                               seed=seed, extra_args=extra_args)
