"""What clients switching from OpenAI or vLLM expect of the HTTP server: a completion's text
continues its prompt's (SentencePiece's leading space kept), vLLM's sampling fields refused
unless at their no-op values, ``n`` beyond the slots queued, the retrieve-model route, the
``usage: null`` of streamed chunks with ``include_usage``, a taken port refused at once, and
chat messages and fields as OpenAI defines them."""

from __future__ import annotations

import pathlib
import socket

import httpx
import numpy as np
import pytest

from jaxspec.server import BackgroundServer
from jaxspec.serving import ServingEngine

from serverkit import ENGINE_KW, served_model, sse_data
from tiny import tiny_model



@pytest.fixture(scope="module")
def server():
    eng = ServingEngine(served_model(seed=2), **ENGINE_KW).start(variants=[(True, False)])
    srv = BackgroundServer(eng, "tiny")
    yield srv, eng
    srv.close()
    eng.stop()


def _post(srv, path, body):
    return httpx.post(srv.url + path, json=body, timeout=300)


def test_completion_text_keeps_sentencepiece_leading_space(tmp_path: pathlib.Path):
    from test_tokenizer_gguf import learn_spm_vocab, write_tokenizer_gguf

    from jaxspec.gguf_io import GGUFFile
    tok = GGUFFile(write_tokenizer_gguf(tmp_path / "spm.gguf",
                                        learn_spm_vocab(np.random.default_rng(3)))).tokenizer()
    model = tiny_model(seed=1, scale=3.0, vocab=len(tok), eos_token_ids=(tok.eos_token_id,))
    model.tokenizer = tok
    eng = ServingEngine(model, **ENGINE_KW).start(variants=[(True, False)])
    srv = BackgroundServer(eng, "spm")
    spaced = 0
    try:
        for prompt in ["the cat", "the dog sat on", "hello world", "tell me a story about"]:
            for stream in (False, True):
                body = {"prompt": prompt, "max_tokens": 6, "temperature": 0,
                        "return_token_ids": True, "stream": stream}
                r = _post(srv, "/v1/completions", body)
                assert r.status_code == 200, r.text
                if stream:
                    ev = [e for e in sse_data(r.text) if e != "[DONE]"]
                    text = "".join(e["choices"][0]["text"] for e in ev)
                    ids = [t for e in ev for t in e["choices"][0].get("token_ids") or []]
                else:
                    text = r.json()["choices"][0]["text"]
                    ids = r.json()["choices"][0]["token_ids"]
                p_ids = tok(prompt)["input_ids"]
                head = tok.decode(p_ids, skip_special_tokens=True)
                whole = tok.decode(p_ids + ids, skip_special_tokens=True)
                assert head + text == whole, (prompt, text, whole)
                spaced += text.startswith(" ")
    finally:
        srv.close()
        eng.stop()
    assert spaced  # some first token was a word's start: the space the fix keeps


@pytest.mark.parametrize("field,value", [("ignore_eos", True), ("min_tokens", 3),
                                         ("repetition_penalty", 1.2), ("min_p", 0.1),
                                         ("stop_token_ids", [5]), ("guided_choice", ["a", "b"]),
                                         ("include_stop_str_in_output", True)])
def test_vllm_sampling_fields_refused_unless_no_ops(server, field, value):
    srv, _ = server
    r = _post(srv, "/v1/completions", {"prompt": "a b", "max_tokens": 2, field: value})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_vllm_sampling_fields_at_no_op_values_pass(server):
    srv, _ = server
    r = _post(srv, "/v1/completions", {"prompt": "a b", "max_tokens": 2, "ignore_eos": False,
                                       "min_tokens": 0, "repetition_penalty": 1.0, "min_p": 0,
                                       "stop_token_ids": [], "skip_special_tokens": True})
    assert r.status_code == 200, r.text


def test_n_beyond_the_slots_waits_in_the_queue(server):
    srv, eng = server
    n = eng.B + 2
    r = _post(srv, "/v1/completions", {"prompt": "a b c", "max_tokens": 3, "n": n,
                                       "temperature": 0})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"]
    assert sorted(c["index"] for c in ch) == list(range(n))
    assert len({c["text"] for c in ch}) == 1  # greedy: the same text n times
    r = _post(srv, "/v1/completions", {"prompt": "a", "n": 129})
    assert r.status_code == 400 and "<= 128" in r.text


def test_retrieve_model(server):
    srv, _ = server
    r = httpx.get(srv.url + "/v1/models/tiny", timeout=30)
    assert r.status_code == 200 and r.json()["id"] == "tiny" and r.json()["object"] == "model"
    assert r.json() == httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]
    r = httpx.get(srv.url + "/v1/models/other", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_streamed_chunks_carry_null_usage_with_include_usage(server):
    srv, _ = server
    for path, body in (("/v1/completions", {"prompt": "a b"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "a b"}]})):
        r = _post(srv, path, {**body, "max_tokens": 3, "stream": True,
                              "stream_options": {"include_usage": True}})
        ev = [e for e in sse_data(r.text) if e != "[DONE]"]
        assert ev[-1]["usage"]["completion_tokens"] > 0 and ev[-1]["choices"] == []
        assert all("usage" in e and e["usage"] is None for e in ev[:-1])
        r = _post(srv, path, {**body, "max_tokens": 3, "stream": True})
        assert all("usage" not in e for e in sse_data(r.text) if e != "[DONE]")


def test_a_taken_port_is_refused_before_loading():
    from jaxspec.server import _listen_socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=f"--port {port}: cannot listen there"):
            _listen_socket("127.0.0.1", port)
    free = _listen_socket("127.0.0.1", 0)
    assert free.getsockname()[1] > 0
    # the port is held while the model loads: a second server on it is refused at once
    with pytest.raises(OSError, match="cannot listen there"):
        _listen_socket("127.0.0.1", free.getsockname()[1])
    free.close()
    # a host name binds IPv4, as uvicorn does (not whatever getaddrinfo lists first: ::1 where
    # /etc/hosts maps localhost to it, and then 127.0.0.1 refuses)
    real = socket.getaddrinfo

    def v6_first(host, *a, **kw):
        v6 = [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", a[0] if a else 0, 0, 0))]
        return v6 + real(host, *a, **kw) if host == "localhost" else real(host, *a, **kw)

    import unittest.mock
    with unittest.mock.patch.object(socket, "getaddrinfo", v6_first):
        local = _listen_socket("localhost", 0)
    try:
        assert local.family == socket.AF_INET
        with socket.create_connection(("127.0.0.1", local.getsockname()[1]), timeout=5):
            pass
    finally:
        local.close()


def test_chat_content_parts_and_roles():
    """Text parts are separate pieces of text (joined by a newline, as vLLM does, not glued into
    one word); OpenAI's "developer" role is the chat template's "system"; a part that is not
    text is refused naming it."""
    from jaxspec.server import APIError, ServerLimits, _chat_messages
    words = ["What is the capital", "of France?"]
    body = {"messages": [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": w} for w in words]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]}]}
    got = _chat_messages(body, ServerLimits())
    assert [m["role"] for m in got] == ["system", "user", "assistant"]
    assert got[1]["content"] == "\n".join(words) and got[2]["content"] == "I cannot."
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    with pytest.raises(APIError, match=r"messages\[0\]\.content\[1\].*image_url"):
        _chat_messages({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "look"}, image]}]}, ServerLimits())
    with pytest.raises(APIError, match="only text parts"):  # (a user's refusal is no part)
        _chat_messages({"messages": [{"role": "user", "content": [
            {"type": "refusal", "refusal": "no"}]}]}, ServerLimits())


def test_chat_fields_this_server_cannot_honour_and_response_fields(server):
    srv, _ = server
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2,
            "temperature": 0}
    for extra, param in (({"modalities": ["text", "audio"], "audio": {"voice": "alloy"}},
                          "modalities"),
                         ({"audio": {"voice": "alloy"}}, "audio"),
                         ({"web_search_options": {}}, "web_search_options"),
                         ({"modalities": "text"}, "modalities")):
        r = _post(srv, "/v1/chat/completions", {**chat, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    r = _post(srv, "/v1/chat/completions", {**chat, "modalities": ["text"]})
    assert r.status_code == 200, r.text
    assert "system_fingerprint" in r.json() and r.json()["system_fingerprint"] is None
    r = _post(srv, "/v1/chat/completions", {**chat, "stream": True})
    assert all(e["system_fingerprint"] is None for e in sse_data(r.text) if e != "[DONE]")
    # errors name the field the client sent
    r = _post(srv, "/v1/chat/completions", {**chat, "max_tokens": None,
                                            "max_completion_tokens": 10 ** 6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text
    assert "max_completion_tokens" in r.json()["error"]["message"]
    r = _post(srv, "/v1/chat/completions", {**chat, "stream": True,
                                            "stream_options": {"include_usage": "yes"}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "stream_options.include_usage"
