"""API-key authentication of the OpenAI-compatible server (`jaxspec.server`): every route the app
has (enumerated from the app itself, so a new route is covered the day it is added) and unknown
paths answer 401 in OpenAI's error format without ``Authorization: Bearer KEY``; ``/health``
never needs the key, ``/metrics`` and ``/`` only with their ``public`` switches; the official
openai client works with the key and fails with another; keys are compared in constant time."""

import argparse
import hashlib
import hmac
import json
import re
import secrets

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from jaxspec.server import (API_KEY_ENV, BackgroundServer, add_arguments,  # noqa: E402
                            create_app, resolve_api_key)
from jaxspec.serving import ServingEngine  # noqa: E402

from serverkit import ENGINE_KW, is_openai_error, served_model  # noqa: E402

pytestmark = pytest.mark.timeout(240)

KEY = "sk-" + secrets.token_urlsafe(24)
# a valid minimal request body per POST route (greedy, 2 tokens)
BODIES = {"/v1/completions": {"prompt": "hello world", "max_tokens": 2, "temperature": 0},
          "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}],
                                   "max_tokens": 2, "temperature": 0}}


@pytest.fixture(scope="module")
def engine():
    e = ServingEngine(served_model(), **ENGINE_KW).start()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def server(engine):
    s = BackgroundServer(engine, "tiny", api_key=KEY)
    yield s
    s.close()


@pytest.fixture(scope="module")
def open_metrics_server(engine):
    s = BackgroundServer(engine, "tiny", api_key=KEY, metrics_public=True, page_public=True)
    yield s
    s.close()


def _routes(app) -> list[tuple[str, str]]:
    """(method, path) of every HTTP route of the app, plus two paths it does not have. A path
    parameter gets a value the route answers: the served model's name."""
    out = []
    for r in app.routes:
        for m in sorted(getattr(r, "methods", None) or ()):
            if m != "HEAD":
                out.append((m, re.sub(r"\{[^}]*\}", "tiny", r.path)))
    return out + [("GET", "/v1/nothing"), ("POST", "/admin")]


_CLIENT = httpx.Client(timeout=60)  # one client: a new one per request costs ~0.1 s


def _send(url, method, path, headers):
    body = BODIES.get(path)
    return _CLIENT.request(method, url + path, headers=headers,
                           content=None if body is None else json.dumps(body).encode())


def _assert_401(r):
    assert r.status_code == 401, (r.request.method, r.request.url, r.status_code, r.text)
    assert is_openai_error(r.status_code, r.content), r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key" and "API key" in err["message"]
    assert r.headers["www-authenticate"] == "Bearer"
    assert KEY not in r.text


WRONG = [None, "Bearer", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", f"Basic {KEY}",
         f"Bearer {secrets.token_urlsafe(24)}", KEY, f"Bearer  {KEY.upper()}"]


def test_every_route_needs_the_key(server):
    routes = _routes(server.app)
    assert {p for _, p in routes} >= {"/", "/health", "/metrics", "/v1/models",
                                      "/v1/completions", "/v1/chat/completions"}
    with_key = {"Authorization": f"Bearer {KEY}"}
    for method, path in routes:
        for auth in WRONG:
            headers = {} if auth is None else {"Authorization": auth}
            r = _send(server.url, method, path, headers)
            if path == "/health":
                assert r.status_code == 200, r.text
            else:
                _assert_401(r)
        r = _send(server.url, method, path, with_key)
        want = 404 if path in ("/v1/nothing", "/admin") else 200
        assert r.status_code == want, (method, path, r.text)
        # the scheme is case-insensitive (RFC 7235)
        r = _send(server.url, method, path, {"Authorization": f"bearer {KEY}"})
        assert r.status_code == want, (method, path, r.text)


def test_public_metrics_and_page(open_metrics_server):
    url = open_metrics_server.url
    assert _CLIENT.get(url + "/metrics").status_code == 200
    r = _CLIENT.get(url + "/")
    assert r.status_code == 200 and 'id="api_key"' in r.text
    assert _CLIENT.get(url + "/health").status_code == 200
    for method, path in _routes(open_metrics_server.app):
        if path not in ("/", "/health", "/metrics"):
            _assert_401(_send(url, method, path, {}))


def test_openai_client_with_and_without_the_key(server):
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in good.models.list().data] == ["tiny"]
    r = good.completions.create(model="tiny", prompt="hello world", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    chunks = list(good.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "tell me a story"}], max_tokens=4,
        temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    for key in ("wrong-key", KEY + "0", KEY[:8]):
        bad = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="tiny", prompt="hello", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            list(bad.chat.completions.create(model="tiny", max_tokens=2, stream=True,
                                             messages=[{"role": "user", "content": "hi"}]))


def test_key_compared_in_constant_time(server, monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)
    monkeypatch.setattr(hmac, "compare_digest", spy)
    for token, ok in ((KEY, True), (KEY + "x", False), ("k", False), (KEY[:-1] + "!", False)):
        r = _CLIENT.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == (200 if ok else 401)
    # every check went through compare_digest, on equal-length digests (no length leak)
    assert len(calls) == 4
    want = hashlib.sha256(KEY.encode()).digest()
    for (a, b), token in zip(calls, (KEY, KEY + "x", "k", KEY[:-1] + "!")):
        assert len(a) == len(b) == 32
        assert {a, b} == ({want} if token == KEY else {want, hashlib.sha256(token.encode())
                                                       .digest()})


def test_no_key_means_no_authentication(engine):
    s = BackgroundServer(engine, "tiny")
    try:
        for method, path in _routes(s.app):
            r = _send(s.url, method, path, {})
            assert r.status_code == (404 if path in ("/v1/nothing", "/admin") else 200), path
    finally:
        s.close()


def test_api_key_from_flag_or_environment(capsys):
    assert resolve_api_key(None, {}) is None
    assert resolve_api_key(None, {API_KEY_ENV: ""}) is None
    assert resolve_api_key(None, {API_KEY_ENV: "k1"}) == "k1"
    assert resolve_api_key("k2", {API_KEY_ENV: "k1"}) == "k2"  # the flag wins
    with pytest.raises(ValueError, match=API_KEY_ENV):
        resolve_api_key(None, {API_KEY_ENV: " padded "})
    p = add_arguments(argparse.ArgumentParser(prog="serve"))
    assert p.parse_args(["--api-key", "abc"]).api_key == "abc"
    for bad in ("", " abc"):
        with pytest.raises(SystemExit):
            p.parse_args(["--api-key", bad])
        assert "--api-key" in capsys.readouterr().err
    with pytest.raises(ValueError, match="api_key"):
        create_app(object(), api_key="")
