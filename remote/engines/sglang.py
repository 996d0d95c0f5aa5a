"""SGLang as the serving engine: start its server with a drafter of the DFlash family (or none),
generate from token ids through its native ``/generate``, and read the engine's own acceptance counters.

(Reference completions from an SGLang server the user runs are :mod:`remote.engines.sglang_client`; this module
is the engine beside our own decoding, ``eval --engine`` with ``engine: {kind: sglang, ...}``.)

The server is ``python -m sglang.launch_server --model-path TARGET --speculative-algorithm ALGORITHM
--speculative-draft-model-path DRAFTER --speculative-num-draft-tokens B`` (B: the drafter's block,
the anchor included), the algorithm by the drafter's family (:data:`ALGORITHMS`): DFLASH for DFlash
and SpecForge's Domino (with ``--speculative-domino-candidate-pool-size 0``: every draft scored over
the full vocabulary, as ours are; SGLang's default 2048 scores an approximate candidate pool),
DSPARK for DSpark (with ``--speculative-dspark-block-size`` γ = B − 1, the drafted tokens: without
it SGLang takes γ from the checkpoint's ``block_size``, which counts the anchor in SpecForge's
checkpoints). What SGLang counts, per request and the same for every algorithm (``meta_info``;
``tokenizer_manager_components/spec_decoding_meta.py``, earlier ``tokenizer_manager.py``), under the
names of its releases, newest first (:data:`COUNTERS`):

- ``spec_verify_ct``: verify steps (the prefill is none);
- ``spec_num_correct_drafts`` (``spec_accepted_drafts``, ``spec_accept_token_num``): draft tokens accepted;
- ``spec_num_proposed_drafts`` (``spec_proposed_drafts``, ``spec_draft_token_num``) = steps × (B − 1),
  also where DSpark's verify budget verified fewer of them;
- ``spec_correct_drafts_histogram`` (``spec_accept_histogram``)``[n]``: steps that accepted n drafts,
  as long as the largest n seen;
- ``spec_accept_length`` (the engine's τ) = ``completion_tokens / spec_verify_ct``: every output
  token over the steps, **the prefill's token included** (vLLM's τ leaves it out).

Nothing here imports SGLang; the engine runs in its own environment and is spoken to over HTTP.
"""
from __future__ import annotations

import time
from pathlib import Path

from remote.contract.engines import ENGINES
from remote.drafters.config import DFLASH, DOMINO, DSPARK
from remote.engines.counts import Answer
from remote.engines.server import (LOOPBACK, EngineError, HTTPClient, OwnServer, ServerProcess, check_port_free,
                                   check_served, environment_python, environment_versions, free_port)

KIND = "sglang"
PYTHON_ENV, INSTALL = ENGINES[KIND].python_env, ENGINES[KIND].install
SERVER_MODULE = "sglang.launch_server"
ALGORITHMS = {DFLASH: "DFLASH", DOMINO: "DFLASH", DSPARK: "DSPARK"}   # --speculative-algorithm by drafter family
# meta_info's counters: ours -> SGLang's names, newest release first (the module docstring)
COUNTERS = {"accepted": ("spec_num_correct_drafts", "spec_accepted_drafts", "spec_accept_token_num"),
            "proposed": ("spec_num_proposed_drafts", "spec_proposed_drafts", "spec_draft_token_num"),
            "histogram": ("spec_correct_drafts_histogram", "spec_accept_histogram")}
START_TIMEOUT = 900.0
GPU_SHARE_FLAG = "--mem-fraction-static"    # the share of GPU memory a server takes
QUIRK = None                                # no known way it computes the drafter differently


def engine_python(python: str | None = None) -> str:
    return environment_python(python, PYTHON_ENV, "SGLang", INSTALL)


def engine_versions(python: str, timeout: float = 120.0) -> dict:
    """``{"sglang": VERSION, "distribution": "sglang", "torch": ..., "transformers": ...}``."""
    return environment_versions(engine_python(python), "sglang", "SGLang", INSTALL, timeout)


def drafter_family(drafter: str | Path) -> str:
    """The family of the drafter at ``drafter`` (from its config: no tensors are read)."""
    from remote.drafters.checkpoint import open_checkpoint

    return open_checkpoint(drafter).config.family


def speculative_args(family: str, drafter: str | Path, block_size: int) -> list[str]:
    """The server's speculative flags for a drafter of ``family`` (module docstring): its algorithm,
    ``block_size`` draft tokens per verify (the anchor included), and that algorithm's own flags."""
    argv = ["--speculative-algorithm", ALGORITHMS[family], "--speculative-draft-model-path", str(drafter),
            "--speculative-num-draft-tokens", str(int(block_size))]
    if family == DSPARK:
        argv += ["--speculative-dspark-block-size", str(int(block_size) - 1)]
    if family == DOMINO:
        argv += ["--speculative-domino-candidate-pool-size", "0"]
    return argv


def server_argv(python: str, target: str | Path, drafter: str | Path | None = None, block_size: int | None = None,
                port: int = 30000, host: str = LOOPBACK, dtype: str | None = None, seed: int = 0,
                extra_args: list[str] | tuple = (), family: str | None = None) -> list[str]:
    """The server's argv; with a drafter, speculative decoding with ``block_size`` draft tokens per
    verify by its family's algorithm (``family``, else read from the drafter's config). The radix
    cache is off so every request prefills (and drafts from) its whole prompt; ``extra_args`` come
    last, so they can set another value of any flag."""
    argv = [python, "-m", SERVER_MODULE, "--model-path", str(target), "--host", host, "--port", str(int(port)),
            "--random-seed", str(int(seed)), "--disable-radix-cache", "--enable-metrics"]
    if dtype:
        argv += ["--dtype", dtype]
    if drafter is not None:
        argv += speculative_args(family or drafter_family(drafter), drafter, block_size)
    return argv + [str(a) for a in extra_args]


def _counter(meta: dict, name: str):
    """The counter ``name`` (:data:`COUNTERS`) under whichever of SGLang's names the answer uses."""
    return next((meta[key] for key in COUNTERS[name] if meta.get(key) is not None), None)


def result(answer: dict, wall_s: float) -> dict:
    """One ``/generate`` answer as :func:`remote.engines.vllm.result` 's dict: ``drafts`` = verify
    steps, ``accepted``, ``draft_tokens`` (proposed), ``histogram`` (steps by drafts accepted,
    0..K), ``accepted_per_pos`` (from the histogram), ``tau`` = SGLang's ``spec_accept_length``
    with ``tokens`` = completion tokens and ``cycles`` = verify steps; no per-step counts (SGLang
    reports none). K = proposed / steps."""
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
        hist = [int(n) for n in _counter(meta, "histogram") or []] or None
        accepted, proposed = _counter(meta, "accepted"), _counter(meta, "proposed")
        if accepted is None and hist:
            accepted = sum(n * c for n, c in enumerate(hist))
        k = int(proposed) // int(steps) if proposed else None
        if hist and k is not None and len(hist) <= k:      # SGLang's ends at the most drafts a step accepted
            hist += [0] * (k + 1 - len(hist))
        out.cycles, out.tokens, out.drafts = int(steps), completion, int(steps)
        out.draft_tokens = int(proposed) if proposed is not None else None
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
        drafter, speculation on/off, the algorithm (the one for ``drafter``'s family; without
        ``drafter``, one of :data:`ALGORITHMS`), the draft tokens per verify."""
        got = self.served()
        problems = []
        if target is not None and not _same_path(got["model"], target):
            problems.append(f"it serves {got['model']}, not {target}")
        if speculative and got["speculative"]:
            want = ALGORITHMS[drafter_family(drafter)] if drafter is not None else None
            algorithm = str(got["algorithm"]).upper()
            if want is not None and algorithm != want:
                problems.append(f"its speculative algorithm is {got['algorithm']}, not {want}")
            elif want is None and algorithm not in ALGORITHMS.values():
                problems.append(f"its speculative algorithm is {got['algorithm']}, not "
                                f"{' or '.join(sorted(set(ALGORITHMS.values())))}")
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
        family = drafter_family(drafter) if drafter is not None else None
        argv = server_argv(python, target, drafter, block_size, port, LOOPBACK, dtype, seed, extra_args, family)
        process = ServerProcess(argv, log_path, name=cls.name)
        settings = {"target": str(target), "drafter": str(drafter) if drafter is not None else None,
                    "algorithm": ALGORITHMS[family] if family else None,
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
