"""Inputs, configs and command lines the other test files do not cover (each test a bug found)."""

import numpy as np
import pytest

import jaxspec
from jaxspec import cli

from tiny import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=1, vocab=97, scale=3.0, ctx=128)


PROMPTS = [[5], [3, 9, 27, 81, 50, 11, 2], [60, 61]]


# ------------------------------------------------------------------ sliding-window models
def test_sliding_window_exact_past_the_window(tmp_path):
    """A Mistral config with sliding_window: jaxspec used to attend to every earlier token, exact
    only while prompt + new tokens <= window + 1, and refused longer sequences (the server capped
    max_len to window + 1). Now the window is applied: transformers' tokens at any length
    (tests/test_sliding_window.py covers the paths)."""
    pytest.importorskip("torch")
    from hf_models import convert_hf, make_hf_model, torch_greedy
    hf = make_hf_model("mistral", seed=4, sliding_window=8, num_hidden_layers=1)
    m = convert_hf(hf, tmp_path)
    assert m.config.sliding_window == 8
    for prompt, new in (([7, 1, 99, 45, 3], 20), ([1] * 12, 3)):  # both past window + 1
        res = jaxspec.generate(m, [prompt], max_new_tokens=new)
        assert res.tokens[0] == torch_greedy(hf, prompt, new)
    from jaxspec.serving import ServingEngine
    assert ServingEngine(m, max_batch=1, max_len=64).max_len == 64


# ------------------------------------------------------------------ attention dispatch
def test_head_dims_that_are_not_powers_of_2_run_the_kernels():
    """80, 96, 100 exist in llama-architecture checkpoints. The Triton kernels once raised for
    such head dims (and impl='auto' on a GPU fell back to the jnp attention); their tiles now
    hold the next power of 2 of lanes with those past D masked. Generation through the kernels
    (interpreted here) equals the jnp path, plain and speculative."""
    m = tiny_model(seed=2, vocab=97, hidden=24, heads=2, kv_heads=1, head_dim=12, ctx=64)
    want = jaxspec.generate(m, PROMPTS, max_new_tokens=5, attn_impl="xla").tokens
    assert jaxspec.generate(m, PROMPTS, max_new_tokens=5, attn_impl="interpret").tokens == want
    spec = jaxspec.Speculation(gamma=2, sink=2, window=4, adaptive=False)
    assert jaxspec.generate(m, PROMPTS, max_new_tokens=5, speculation=spec,
                            attn_impl="interpret").tokens == want


# ------------------------------------------------------------------ generate() arguments
def test_numpy_scalar_sampling_settings(model):
    """np.float32 temperature / top_p were refused with 'must be a finite number >= 0, got 0.7'."""
    greedy = jaxspec.generate(model, PROMPTS, max_new_tokens=6).tokens
    res = jaxspec.generate(model, PROMPTS, max_new_tokens=6, temperature=np.float32(0.7),
                           top_k=np.int64(1), top_p=np.float32(0.9), seed=np.int32(3))
    assert res.tokens == greedy


def test_stop_tokens_as_array_or_single_id(model):
    """stop_tokens=np.array([...]) raised numpy's 'truth value ... is ambiguous'; a single id
    raised "'int' object is not iterable"."""
    first = jaxspec.generate(model, PROMPTS, max_new_tokens=6).tokens[1][0]
    want = jaxspec.generate(model, PROMPTS, max_new_tokens=6, stop_tokens=[first]).tokens
    assert want[1] == [first]
    for stop in (np.array([first]), first, np.int64(first)):
        assert jaxspec.generate(model, PROMPTS, max_new_tokens=6, stop_tokens=stop).tokens == want


def test_bad_arguments_give_clear_errors(model):
    with pytest.raises(TypeError, match="token ids"):  # was silently truncated to token 1
        jaxspec.generate(model, [[1.5, 2]], max_new_tokens=2)
    with pytest.raises(TypeError, match="seed"):  # was "None is not a valid value for jnp.array"
        jaxspec.generate(model, PROMPTS, max_new_tokens=2, seed=None)
    with pytest.raises(ValueError, match="prefill_chunk"):  # was ZeroDivisionError
        jaxspec.generate(model, PROMPTS, max_new_tokens=2, prefill_chunk=0)
    with pytest.raises(TypeError, match="stop tokens"):
        jaxspec.generate(model, PROMPTS, max_new_tokens=2, stop_tokens=[0.5])


# ------------------------------------------------------------------ command line
def test_cli_rejects_zero_tp_and_bad_gamma(model, tmp_path, capsys):
    """--tp 0 was silently ignored (a single-device run); --gamma foo said only "invalid literal
    for int() with base 10"."""
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", str(tmp_path / "none"), "--prompt", "x", "--tp", "0"])
    assert e.value.code == 2 and "--tp" in capsys.readouterr().err
    path = jaxspec.save(model, tmp_path / "ckpt")
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", str(path), "--prompt", "x", "--draft", "self", "--gamma", "foo"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--gamma" in err and "Traceback" not in err


def test_cli_window_none_means_full_draft_cache():
    """A draft model with a full cache (Speculation(window=None, adaptive=False)) was unreachable from the CLI."""
    p = cli.build_parser()
    assert p.parse_args(["generate", "m", "--window", "none"]).window is None
    assert p.parse_args(["generate", "m", "--window", "64"]).window == 64
    with pytest.raises(SystemExit):
        p.parse_args(["generate", "m", "--window", "big"])


# ------------------------------------------------------------------ randomness
def test_random_init_is_the_same_in_every_process():
    """init_params jittered the norm weights with fold_in(rng, hash(name)): str hashes are salted
    per process, so one rng gave different weights in every run (random-weight benchmarks and
    seeded tests were not reproducible)."""
    import os
    import subprocess
    import sys
    code = ("import jax, jax.numpy as jnp; from tiny import tiny_config; "
            "from jaxspec.model import init_params; "
            "p = init_params(tiny_config(vocab=16, layers=1), jax.random.PRNGKey(0)); "
            "print(repr(float(jnp.sum(p['final_norm'] ** 2))))")
    outs = []
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed, JAX_PLATFORMS="cpu",
                   PYTHONPATH=os.pathsep.join([os.path.dirname(__file__),
                                               os.path.dirname(os.path.dirname(__file__))]))
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(r.stdout.strip().splitlines()[-1])
    assert outs[0] == outs[1]


def test_seeds_past_32_bits(model):
    """Without x64 JAX keeps only a seed's low 32 bits (seed 2**32 + 5 sampled exactly what seed 5
    did) and overflows from 2**63 on."""
    kw = dict(max_new_tokens=8, temperature=1.0)
    a = jaxspec.generate(model, PROMPTS, seed=5, **kw).tokens
    assert jaxspec.generate(model, PROMPTS, seed=5, **kw).tokens == a
    assert jaxspec.generate(model, PROMPTS, seed=2 ** 32 + 5, **kw).tokens != a
    big = jaxspec.generate(model, PROMPTS, seed=2 ** 64 + 5, **kw).tokens
    assert jaxspec.generate(model, PROMPTS, seed=2 ** 64 + 5, **kw).tokens == big


# ------------------------------------------------------------------ speculation
def test_draft_model_with_max_new_tokens_past_the_context():
    """max_new_tokens past the context is cut at the context for plain decoding, but a draft model
    of the same context was refused ("prompts + new tokens reach 1007")."""
    target = tiny_model(seed=1, vocab=97, scale=3.0, ctx=48)
    draft = tiny_model(seed=2, vocab=97, scale=3.0, ctx=48, layers=1)
    want = jaxspec.generate(target, PROMPTS, max_new_tokens=1000).tokens
    assert [len(t) for t in want] == [48 - len(p) for p in PROMPTS]
    spec = jaxspec.Speculation(draft=draft, gamma=3, window=None, adaptive=False)
    assert jaxspec.generate(target, PROMPTS, max_new_tokens=1000, speculation=spec).tokens == want


def test_max_len_too_small_says_why(model):
    """The error blamed 'prompts plus new tokens' also when the prefill's whole chunks were what
    did not fit; it now names the reason that set the size."""
    with pytest.raises(ValueError, match=r"max_len=8 is too small: prompts of up to 5 tokens plus 10 "
                                         r"new tokens and 1 slot for the last token need 16"):
        jaxspec.generate(model, [[1, 2, 3, 4, 5]], max_new_tokens=10, max_len=8)
    long = [i % 90 + 1 for i in range(100)]
    with pytest.raises(ValueError, match=r"max_len=110 is too small: the prefill of prompts of up "
                                         r"to 100 tokens writes whole chunks of 64 slots"):
        jaxspec.generate(model, [long], max_new_tokens=1, max_len=110, prefill_chunk=64)
    res = jaxspec.generate(model, [long], max_new_tokens=1, max_len=128, prefill_chunk=64)
    assert len(res.tokens[0]) == 1


def test_server_full_cache_draft_context(model):
    """A full-cache draft model shorter than the server's max_len would have attended past its
    own context: max_len is capped to it (as to the target's), also through `jaxspec serve`'s
    engine, which always passes a max_len."""
    from jaxspec.serving import ServingEngine
    draft = tiny_model(seed=7, vocab=97, ctx=48)
    spec = jaxspec.Speculation(draft=draft, gamma=2, window=None, adaptive=False)
    assert ServingEngine(model, max_batch=1, max_len=100, speculation=spec).max_len == 48
    assert ServingEngine(model, max_batch=1, speculation=spec).max_len == 48
    assert ServingEngine(model, max_batch=1, max_len=500).max_len == 128  # the target's context
    ring = jaxspec.Speculation(draft=draft, gamma=2, sink=2, window=8, adaptive=False)  # any length
    assert ServingEngine(model, max_batch=1, max_len=100, speculation=ring).max_len == 100
