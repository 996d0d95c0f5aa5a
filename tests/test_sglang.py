"""SGLangClient against a real HTTP server speaking SGLang's protocol (tests/sglang_server.py)."""
from __future__ import annotations

import socket
import time

import pytest
import torch

from remote.suites.prompts import PromptRow, reference_turns
from remote.contract.credentials import redact
from remote.engines.sglang_client import SGLangClient, SGLangError
from remote.target.tokenizer import build_tiny_tokenizer
from models import random_target
from sglang_server import serve_sglang

pytestmark = pytest.mark.xdist_group("sglang")     # the module's servers start once, in one worker
PROMPT = [11, 42, 7, 99, 3, 250, 18, 64]


@pytest.fixture(scope="module")
def target():
    return random_target()


@pytest.fixture(scope="module")
def lively():
    """A random tiny target whose greedy output does not collapse into one repeated token."""
    from models import freeze
    from remote.drafters.tiny import tiny_target

    return freeze(tiny_target(seed=1, init_std=0.5))


@pytest.fixture(scope="module")
def lively_url(lively, tok):
    with serve_sglang(lively, tok) as u:
        yield u


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def url(target, tok):
    with serve_sglang(target, tok) as u:
        yield u


def argmax_loop(model, ids: list[int], n: int) -> list[int]:
    """Greedy decoding written out: full forward, argmax, append (independent of model.generate)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.models
def test_health_and_model_info(url):
    client = SGLangClient(url)
    client.health()
    assert client.model_info()["model_path"] == "tiny-qwen3"


@pytest.mark.models
def test_model_info_falls_back_to_the_old_route(target):
    with serve_sglang(target, model_info_path="/model_info") as u:
        assert SGLangClient(u).model_info()["model_path"] == "tiny-qwen3"


@pytest.mark.models
@pytest.mark.parametrize("which", ["target", "lively"])
def test_generate_equals_the_targets_own_greedy_output(which, request):
    model, url = request.getfixturevalue(which), request.getfixturevalue("url" if which == "target" else "lively_url")
    out = SGLangClient(url).generate(PROMPT, 12)
    assert len(out) == 12 and out == argmax_loop(model, PROMPT, 12)
    ids = torch.tensor([PROMPT])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert out == ref[0, len(PROMPT):].tolist()


@pytest.mark.models
def test_stop_token_ids_are_honoured(lively_url):
    client = SGLangClient(lively_url)
    full = client.generate(PROMPT, 12)
    k = next(i for i in range(2, len(full)) if full[i] not in full[:i])  # a token first seen at position k
    raw = client.generate_raw(PROMPT, 12, stop_token_ids=[full[k]])
    assert raw["output_ids"] == full[: k + 1]  # the matched stop token ends the completion
    assert raw["meta_info"]["finish_reason"] == {"type": "stop", "matched": full[k]}
    assert raw["meta_info"]["completion_tokens"] == k + 1 and raw["meta_info"]["prompt_tokens"] == len(PROMPT)
    assert client.generate_raw(PROMPT, 5)["meta_info"]["finish_reason"]["type"] == "length"
    assert client.generate(PROMPT, 12, stop_token_ids=[]) == full


@pytest.mark.models
def test_batch_answers_are_accepted(url):
    import json
    import urllib.request

    body = json.dumps([{"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 4}}]).encode()
    req = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
    batch = json.loads(urllib.request.urlopen(req, timeout=30).read())
    assert isinstance(batch, list) and len(batch) == 1
    assert batch[0]["output_ids"] == SGLangClient(url).generate(PROMPT, 4)


def test_unreachable_server_fails_fast_and_clearly():
    port = closed_port()
    client = SGLangClient(f"http://127.0.0.1:{port}", timeout=600)
    t0 = time.monotonic()
    with pytest.raises(SGLangError, match=rf"SGLang at http://127.0.0.1:{port} is not reachable: connection refused"):
        client.health()
    with pytest.raises(SGLangError, match="not reachable"):
        client.generate([1, 2, 3], 4)
    assert time.monotonic() - t0 < 5


def test_a_server_that_never_answers_times_out():
    with socket.socket() as listener:  # accepts connections (the kernel backlog) but never replies
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        client = SGLangClient(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=1)
        t0 = time.monotonic()
        with pytest.raises(SGLangError, match=r"did not answer POST /generate within 1s"):
            client.generate([1, 2, 3], 4)
        with pytest.raises(SGLangError, match=r"did not answer GET /health within 0.5s"):
            client.health(timeout=0.5)
        assert time.monotonic() - t0 < 4


@pytest.mark.models
def test_http_500_carries_the_servers_message(url):
    with pytest.raises(SGLangError, match=r"answered HTTP 500 to POST /generate: IndexError: .*index out of range") as e:
        SGLangClient(url).generate([1, 2, 100000], 4)  # an id outside the embedding crashes the model
    assert e.value.status == 500


@pytest.mark.models
def test_http_404_is_clear(url):
    client = SGLangClient(url + "/no/such/prefix")
    with pytest.raises(SGLangError, match="HTTP 404 to GET /health"):
        client.health()


def test_credentials_never_appear_in_messages():
    port = closed_port()
    client = SGLangClient(f"http://alice:s3cret@127.0.0.1:{port}/?token=abc", api_key="k-123")
    assert "s3cret" not in repr(client) and "alice" not in client.display and "token" not in client.display
    with pytest.raises(SGLangError) as e:
        client.health()
    assert not any(secret in str(e.value) for secret in ("s3cret", "alice", "abc", "k-123"))
    assert redact("https://u:p@host:8443/base/?q=1#f") == "https://host:8443/base"


def test_basic_auth_from_the_url_reaches_the_server():
    import base64
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        SGLangClient(f"http://alice:s3cret@127.0.0.1:{server.server_address[1]}").health()
    finally:
        server.shutdown()
        server.server_close()
    assert seen == ["Basic " + base64.b64encode(b"alice:s3cret").decode()]


@pytest.mark.models
def test_multi_turn_through_sglang(lively_url, tok):
    """Turn by turn with SGLang as the reference: the second prompt holds the first completion."""
    client = SGLangClient(lively_url)
    row = PromptRow("chat", "chat", ["Write a haiku about rain.", "Now one about snow."], None)
    stops = [tok.eos_token_id]
    turns = reference_turns(row, tok, lambda ids: client.generate(ids, 10, stops), False)
    assert len(turns) == 2 and turns[0].output_ids
    first = tok.decode(turns[0].output_ids, skip_special_tokens=True)
    second_prompt = tok.decode(turns[1].prompt_ids)
    assert second_prompt == ("<|im_start|>user\nWrite a haiku about rain.<|im_end|>\n"
                             f"<|im_start|>assistant\n{first}<|im_end|>\n"
                             "<|im_start|>user\nNow one about snow.<|im_end|>\n"
                             "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert turns[1].output_ids == client.generate(turns[1].prompt_ids, 10, stops)
