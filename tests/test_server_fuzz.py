"""Property-based fuzzing of the OpenAI-compatible server over a loopback socket: random JSON shapes
and types in every field, near-valid requests with one field gone wrong, unicode (lone surrogates
included), huge and non-finite numbers, deeply nested values, truncated and random byte strings,
odd methods, paths and headers. Every answer must be a 2xx (a well-formed completion, or a stream
that ends with ``[DONE]`` and carries no error) or a 4xx with OpenAI's error body; never a 5xx,
never a hang; ``/health`` stays OK and every slot is free again afterwards.

The default run sends a few hundred requests; ``-m slow`` runs the 10,000-request variant and
prints its figures."""

import json
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from jaxspec.server import BackgroundServer  # noqa: E402
from jaxspec.serving import ServingEngine  # noqa: E402

from serverkit import (ENGINE_KW, WORDS, is_openai_error, metrics, served_model,  # noqa: E402
                       sse_data)

pytestmark = pytest.mark.timeout(1800)

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENDPOINTS = ["/v1/completions", "/v1/chat/completions"]
OTHER_PATHS = ["/health", "/v1/models", "/metrics", "/", "/v1/nothing", "/v1/completions/x",
               "/%2e%2e/etc/passwd", "/v1//completions"]


@pytest.fixture(scope="module")
def server():
    engine = ServingEngine(served_model(), **ENGINE_KW).start()
    s = BackgroundServer(engine, "tiny", api_key=KEY)
    yield s
    s.close()
    engine.stop()


# ----------------------------------------------------------------------------- strategies
surrogates = st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3)
any_text = st.one_of(st.text(max_size=30), st.text(st.characters(codec=None), max_size=30),
                     surrogates, st.sampled_from(["", " ", "\x00", "tiny", "hello world"]))
words = st.lists(st.sampled_from(WORDS), min_size=1, max_size=12).map(" ".join)
numbers = st.one_of(st.integers(-3, 200), st.integers(), st.integers(-10 ** 40, 10 ** 40),
                    st.floats(), st.floats(-1e-300, 1e-300), st.sampled_from([
                        0, -1, 1, 2 ** 31, 2 ** 63, -2 ** 63, 2 ** 64, 1e308, 5e-324, 0.5]))
scalars = st.one_of(st.none(), st.booleans(), numbers, any_text)
json_values = st.recursive(scalars, lambda c: st.one_of(
    st.lists(c, max_size=4), st.dictionaries(any_text, c, max_size=4)), max_leaves=12)
token_ids = st.lists(st.one_of(st.integers(0, 70), st.integers(-5, 10 ** 6), st.integers()),
                     min_size=0, max_size=8)
roles = st.sampled_from(["system", "user", "assistant", "developer", "tool", "wizard", ""])
content = st.one_of(words, any_text, st.none(), json_values, st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(words, any_text)}),
    st.fixed_dictionaries({"type": any_text, "text": json_values}), json_values), max_size=3))
message = st.one_of(st.fixed_dictionaries({"role": roles, "content": content}),
                    st.dictionaries(any_text, json_values, max_size=3), json_values)

FIELD = {
    "model": st.one_of(st.just("tiny"), any_text, json_values),
    "prompt": st.one_of(words, any_text, token_ids, st.lists(words, max_size=4),
                        st.lists(token_ids, max_size=3), json_values),
    "messages": st.one_of(st.lists(message, max_size=4), json_values),
    "max_tokens": st.one_of(st.integers(1, 40), numbers, json_values),
    "max_completion_tokens": st.one_of(st.integers(1, 40), numbers, json_values),
    "temperature": st.one_of(st.floats(0, 2), numbers, json_values),
    "top_p": st.one_of(st.floats(0, 1), numbers, json_values),
    "top_k": st.one_of(st.integers(-2, 100), numbers, json_values),
    "n": st.one_of(st.integers(0, 5), numbers, json_values),
    "seed": st.one_of(st.integers(), numbers, json_values),
    "stop": st.one_of(any_text, words, st.lists(st.one_of(words, any_text), max_size=6),
                      json_values),
    "stream": st.one_of(st.booleans(), json_values),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}),
                                json_values),
    "return_token_ids": st.one_of(st.booleans(), json_values),
    "logprobs": st.one_of(st.booleans(), numbers, json_values),
    "top_logprobs": st.one_of(numbers, json_values),
    "echo": st.one_of(st.booleans(), json_values),
    "best_of": st.one_of(numbers, json_values),
    "user": any_text,
}


@st.composite
def near_valid(draw, chat: bool, mutate: bool = True):
    """A valid request with a few fields replaced by anything, and maybe unknown keys (or, with
    ``mutate=False``, a valid request: the fuzzer must also reach real completions)."""
    body = {"model": "tiny", "max_tokens": draw(st.integers(1, 24)),
            "temperature": draw(st.sampled_from([0, 0.7, 1.0]))}
    if draw(st.integers(0, 2)) == 0:
        body["stream"] = True
        if draw(st.booleans()):
            body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": draw(words)}]
    else:
        body["prompt"] = draw(words)
    if not mutate:
        return json.dumps(body).encode()
    for name in draw(st.lists(st.sampled_from(sorted(FIELD)), max_size=4, unique=True)):
        if draw(st.integers(0, 5)) == 0:
            body.pop(name, None)
        else:
            body[name] = draw(FIELD[name])
    body.update(draw(st.dictionaries(any_text, json_values, max_size=2)))
    return json.dumps(body).encode()


def _nested(depth: int, kind: int) -> bytes:
    if kind == 0:
        return b"[" * depth + b"]" * depth
    if kind == 1:
        return b'{"prompt": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}"
    if kind == 2:
        return b'{"messages": [{"role": "user", "content": ' + b"[" * depth + b"]" * depth + \
            b"}]}"
    return b"[" * depth  # unterminated


huge_numbers = st.builds(
    lambda field, digits, form: (b'{"prompt": "hello", "%s": ' % field.encode()
                                 + form.replace(b"D", b"9" * digits) + b"}"),
    st.sampled_from(["max_tokens", "n", "seed", "temperature", "top_k", "prompt"]),
    st.integers(1, 6000),
    st.sampled_from([b"D", b"-D", b"1e+D", b"0.D", b"[D]", b"1eD", b"D.5e-D"]))


@st.composite
def corrupted(draw):
    raw = draw(near_valid(draw(st.booleans())))
    how = draw(st.integers(0, 2))
    if how == 0:  # truncated
        return raw[:draw(st.integers(0, len(raw)))]
    if how == 1:  # a byte replaced
        i = draw(st.integers(0, len(raw) - 1))
        return raw[:i] + bytes([draw(st.integers(0, 255))]) + raw[i + 1:]
    enc = draw(st.sampled_from(["utf-16", "utf-32", "latin-1"]))  # other encodings
    return raw.decode().encode(enc, errors="replace")


bodies = st.one_of(
    near_valid(False, mutate=False), near_valid(True, mutate=False),
    near_valid(False), near_valid(True), near_valid(False), near_valid(True),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=200),
    st.builds(_nested, st.integers(1, 200_000), st.integers(0, 3)),
    huge_numbers, corrupted())


@st.composite
def requests(draw):
    r = draw(st.integers(0, 9))
    if r < 8:
        method, path = "POST", draw(st.sampled_from(ENDPOINTS))
    else:
        method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]))
        path = draw(st.sampled_from(OTHER_PATHS + ENDPOINTS))
    headers = dict(AUTH)
    a = draw(st.integers(0, 19))
    if a == 0:
        headers.pop("Authorization")
    elif a == 1:
        headers["Authorization"] = draw(st.sampled_from(
            ["Bearer", f"Bearer {KEY}x", f"Basic {KEY}", f"Bearer {KEY} {KEY}", KEY,
             b"Bearer \xe9\xff"]))
    ct = draw(st.sampled_from(["application/json", "application/json", "text/plain",
                               "multipart/form-data; boundary=x", None]))
    if ct is not None:
        headers["Content-Type"] = ct
    return method, path, headers, draw(bodies)


# ----------------------------------------------------------------------------- named cases
HOSTILE = [
    # (path, raw body, status, text in the error message)
    ("c", b'{"prompt": "a", "temperature": 1%s}' % (b"0" * 400), 400, "'temperature' must be <= 2"),
    ("c", b'{"prompt": "a", "top_p": -1%s}' % (b"0" * 100), 400, "'top_p' must be > 0"),
    ("c", b'{"prompt": "a", "max_tokens": 1%s}' % (b"0" * 50), 400, "at most 65536"),
    ("c", b'{"prompt": "a", "max_tokens": 1%s}' % (b"0" * 5000), 400, "not valid JSON"),
    ("c", b'{"prompt": "a", "temperature": NaN}', 400, "must be finite"),
    ("c", b'{"prompt": "a", "max_tokens": Infinity}', 400, "must be an integer"),
    ("c", b'{"prompt": "ab\\ud800"}', 400, "lone surrogate U+D800 at character 2"),
    ("c", b'{"prompt": ["a", "\\udfff"]}', 400, "prompt[1] is not valid Unicode"),
    ("c", b'{"prompt": "a", "stop": ["\\ud800"]}', 400, "stop[0] is not valid Unicode"),
    ("c", b'{"prompt": "a", "model": "\\ud800"}', 404, "does not exist"),
    ("h", b'{"messages": [{"role": "user", "content": "\\udbff"}]}', 400,
     "messages[0].content is not valid Unicode"),
    ("h", b'{"messages": [{"role": "\\ud800", "content": "a"}]}', 400, "is not one of"),
    ("c", b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
    ("h", b'{"messages": [{"role": "user", "content": ' + b"[" * 50_000 + b"]" * 50_000 + b"}]}",
     400, "nested too deeply"),
    ("c", "{\"prompt\": \"a\"}".encode("utf-16"), 200, None),  # JSON may be UTF-16
    ("c", b"\xff\xfe\x00", 400, "not valid JSON"),
    ("c", b'{"prompt": "a", "top_k": 1%s, "max_tokens": 4}' % (b"0" * 30), 200, None),
    ("c", b'{"prompt": "a", "seed": -1%s, "max_tokens": 4}' % (b"0" * 30), 200, None),
    ("c", b'{"prompt": "a", "temperature": 1e-320, "max_tokens": 4}', 200, None),
    ("c", b'{"prompt": "a", "top_p": 5e-324, "max_tokens": 4}', 200, None),
    ("c", b'{"prompt": [[0, 1, 2], [62]], "max_tokens": 4}', 200, None),
]


@pytest.mark.parametrize("path,raw,status,text", HOSTILE, ids=[str(i) for i in range(len(HOSTILE))])
def test_hostile_values(server, path, raw, status, text):
    path = {"c": "/v1/completions", "h": "/v1/chat/completions"}[path]
    r = httpx.post(server.url + path, content=raw, headers=AUTH, timeout=30)
    assert r.status_code == status, r.text
    if status >= 400:
        assert is_openai_error(r.status_code, r.content), r.text
        assert text in r.json()["error"]["message"], r.text
    else:
        assert all(c["finish_reason"] in ("stop", "length") for c in r.json()["choices"])


# ----------------------------------------------------------------------------- the property
class Tally:
    def __init__(self):
        self.requests = 0
        self.by_status: dict[int, int] = {}
        self.streams = 0
        self.t0 = time.time()


def _check(client: httpx.Client, tally: Tally, method, path, headers, body):
    r = client.request(method, path, headers=headers, content=body)
    tally.requests += 1
    tally.by_status[r.status_code] = tally.by_status.get(r.status_code, 0) + 1
    where = f"{method} {path} {body[:300]!r} -> {r.status_code} {r.text[:500]}"
    assert 200 <= r.status_code < 300 or 400 <= r.status_code < 500, where
    if r.status_code >= 400:
        assert is_openai_error(r.status_code, r.content), where
        return
    if method != "POST" or path not in ENDPOINTS:
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        tally.streams += 1
        events = sse_data(r.text)
        assert events and events[-1] == "[DONE]", where
        for ev in events[:-1]:
            assert "error" not in ev, where
        finals = [c for ev in events[:-1] for c in ev["choices"] if c.get("finish_reason")]
        assert finals and all(c["finish_reason"] in ("stop", "length") for c in finals), where
    else:
        obj = r.json()
        assert obj["choices"] and all(c["finish_reason"] in ("stop", "length")
                                      for c in obj["choices"]), where
        assert obj["usage"]["completion_tokens"] >= 0, where


def _run(server, n_examples):
    tally = Tally()
    client = httpx.Client(base_url=server.url, timeout=httpx.Timeout(30.0))

    @settings(max_examples=n_examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(requests())
    def prop(req):
        _check(client, tally, *req)
        if tally.requests % 100 == 0:
            assert client.get("/health").status_code == 200

    try:
        prop()
    finally:
        client.close()
    # the server is fine afterwards: healthy, every slot and queue entry released
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    deadline = time.time() + 30
    while time.time() < deadline:
        m = metrics(server.url, AUTH)
        if m["jaxspec_slots_busy"] == 0 and m["jaxspec_queue_depth"] == 0:
            break
        time.sleep(0.1)
    assert m["jaxspec_slots_busy"] == 0 and m["jaxspec_queue_depth"] == 0, m
    assert not any(k.startswith("jaxspec_http_requests_total") and 'code="5' in k for k in m), m
    return tally


def _report(tally: Tally) -> str:
    dt = time.time() - tally.t0
    ok = sum(v for k, v in tally.by_status.items() if k < 300)
    return (f"{tally.requests} requests in {dt:.1f} s ({tally.requests / dt:.0f}/s): {ok} 2xx "
            f"({tally.streams} streams), {tally.requests - ok} 4xx, 0 5xx, 0 hangs; by status "
            f"{dict(sorted(tally.by_status.items()))}")


def test_fuzz_every_endpoint(server):
    # (600 draws: about 7% of them are valid requests with valid headers, so 300 drew fewer than
    # 20 completions now and then)
    tally = _run(server, 600)
    print(_report(tally))
    assert tally.requests >= 600
    # the fuzzer reaches both outcomes: real completions and refusals
    assert sum(v for k, v in tally.by_status.items() if k < 300) >= 20, tally.by_status
    assert sum(v for k, v in tally.by_status.items() if k >= 400) >= 100, tally.by_status


@pytest.mark.slow
def test_fuzz_every_endpoint_10k(server):
    tally = _run(server, 10_000)
    print(_report(tally))
    assert tally.requests >= 10_000
