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


def test_tiny_temperature_samples_near_greedy(model):
    """A temperature of 1e-10 scaled the logits past 1e9, where XLA's two roundings of the
    scaled row max (one for the max, one inside exp(x - max)) differed: exp(+ulp) = inf, NaN
    probabilities, and every draw returned the last token id. Plain, speculative, tree and
    invariant sampling all went through it."""
    greedy = jaxspec.generate(model, PROMPTS, max_new_tokens=6).tokens
    for t in (1e-10, 1e-30):
        assert jaxspec.generate(model, PROMPTS, max_new_tokens=6, temperature=t).tokens == greedy
    spec = jaxspec.Speculation(gamma=2, sink=1, window=3, adaptive=False, retrieve=0)
    res = jaxspec.generate(model, PROMPTS, max_new_tokens=6, temperature=1e-10, speculation=spec)
    assert res.tokens == greedy


def test_generate_follows_replaced_weights(model):
    """generate kept a decoder per model keyed by the embedding table's id, with its own copy of
    the weights: after model.params was replaced (other layers, the same embedding) it went on
    decoding with the old weights."""
    m = tiny_model(seed=1, vocab=97, scale=3.0, ctx=128)
    other = tiny_model(seed=5, vocab=97, scale=3.0, ctx=128)
    first = jaxspec.generate(m, PROMPTS, max_new_tokens=6).tokens
    m.params = dict(other.params, embed=m.params["embed"])  # new layers, the same embedding
    want = jaxspec.generate(jaxspec.Model(config=m.config, params=dict(m.params)), PROMPTS,
                            max_new_tokens=6).tokens
    assert want != first
    assert jaxspec.generate(m, PROMPTS, max_new_tokens=6).tokens == want
    n = len(m.decoders)
    assert jaxspec.generate(m, PROMPTS, max_new_tokens=6).tokens == want  # kept now
    assert len(m.decoders) == n


def test_more_arguments_give_clear_errors(model, tmp_path):
    """Each of these crashed deep inside jax or numpy, or was taken silently."""
    gen = lambda **kw: jaxspec.generate(model, PROMPTS, **{"max_new_tokens": 2, **kw})  # noqa: E731
    # unhashable settings reached the decoder cache's key before any check
    with pytest.raises(ValueError, match="gamma"):
        gen(speculation=jaxspec.Speculation(gamma=[4]))
    with pytest.raises(ValueError, match="prefill_chunk"):
        gen(prefill_chunk=[16])
    with pytest.raises(ValueError, match="prefill_chunk"):  # was truncated to 2
        gen(prefill_chunk=2.5)
    with pytest.raises(ValueError, match="attn_impl"):
        gen(attn_impl=["xla"])
    with pytest.raises(ValueError, match="top_k"):  # OverflowError inside jax
        gen(top_k=2 ** 40)
    with pytest.raises(ValueError, match="outside the vocabulary"):  # stopping quietly off
        gen(stop_tokens=[97])
    with pytest.raises(TypeError, match="bytes"):  # read as token ids
        jaxspec.generate(model, [b"\x01\x02"], max_new_tokens=2)
    with pytest.raises(ValueError, match="tree"):  # quietly [2]
        gen(speculation=jaxspec.Speculation(tree=[2.5]))
    # taken as they mean now
    want = gen().tokens
    assert gen(max_new_tokens=10 ** 30).tokens[0][:2] == want[0]  # OverflowError: to the context
    assert jaxspec.generate(model, [np.asarray(p) for p in PROMPTS], max_new_tokens=2).tokens == want
    import jax.numpy as jnp
    assert jaxspec.generate(model, [jnp.asarray(p) for p in PROMPTS], max_new_tokens=2).tokens == want
    stop = want[1][0]
    assert gen(stop_tokens=float(stop)).tokens == gen(stop_tokens=[stop]).tokens
    two = [[7, 8, 9, 1], [7, 8, 9, 2]]
    assert (jaxspec.generate(model, two, max_new_tokens=2, shared_prefix=np.array([7, 8, 9])).tokens
            == jaxspec.generate(model, two, max_new_tokens=2).tokens)


def test_tree_file_is_read_each_call(model, tmp_path):
    """Speculation(tree=path) was kept by the path: a rewritten file was not read again."""
    import json
    f = tmp_path / "tree.json"
    f.write_text(json.dumps([-1, 0]))
    spec = jaxspec.Speculation(tree=str(f), sink=1, window=4, adaptive=False)
    assert jaxspec.generate(model, PROMPTS, max_new_tokens=4, speculation=spec).stats[
        "tree_nodes"] == 2
    f.write_text(json.dumps([-1, 0, 0, 1]))
    res = jaxspec.generate(model, PROMPTS, max_new_tokens=4, speculation=spec)
    assert res.stats["tree_nodes"] == 4
    assert res.tokens == jaxspec.generate(model, PROMPTS, max_new_tokens=4).tokens


def test_draft_model_with_samples_and_a_shared_prefix():
    """A full-cache draft model's cache was sized from the target's suffix cache but filled with
    whole prompts: with n > 1 or a shared prefix a long prompt raised after the prefill, a
    shorter one wrote past the draft cache (clamped on the CPU, dropped on a GPU)."""
    model = tiny_model(seed=1, vocab=97, scale=3.0, ctx=512)
    rng = np.random.default_rng(3)
    pre = rng.integers(0, 97, size=150).tolist()  # whole rows past the suffixes' 128 slots
    prompts = [pre + rng.integers(0, 97, size=k).tolist() for k in (3, 10, 1)]
    spec = jaxspec.Speculation(draft=model, gamma=3, window=None, adaptive=False)
    want = jaxspec.generate(model, prompts, max_new_tokens=20).tokens
    res = jaxspec.generate(model, prompts, max_new_tokens=20, shared_prefix="auto",
                           speculation=spec)
    assert res.stats["shared_prefix_tokens"] == 150
    assert res.tokens == want and res.stats["acceptance_rate"] == 1.0  # the draft is the target
    rows = [p for p in prompts for _ in range(2)]
    res = jaxspec.generate(model, prompts, max_new_tokens=20, n=2, speculation=spec)
    assert res.tokens == jaxspec.generate(model, rows, max_new_tokens=20).tokens
    assert res.stats["acceptance_rate"] == 1.0


def test_decoder_run_takes_rounds_made_for_the_batch(model):
    """Decoder.run(dec.round(gamma), ...) as the README showed it decoded a sampling batch
    greedily (a round is greedy by default); with a draft model it crashed on the missing draft
    state. Both are now errors that say what to do; rounds made for the batch work."""
    spec = jaxspec.Speculation(draft=model, gamma=3, window=None, adaptive=False)
    dec = jaxspec.Decoder(model, spec)
    b = dec.prepare(PROMPTS, max_new_tokens=6, temperature=1.0)
    with pytest.raises(ValueError, match="greedy=batch.greedy"):
        dec.run(dec.round(3), b.sp, b.state, 4)
    b = dec.prepare(PROMPTS, max_new_tokens=6)
    rd = dec.round(3, greedy=b.greedy, stop_ids=b.stop_ids)
    with pytest.raises(ValueError, match="draft_state"):
        dec.run(rd, b.sp, b.state, 4)
    b.state = b.state.replace(draft=dec.draft_state(b.token_lists, b.state))
    b.state, _ = dec.run(rd, b.sp, b.state, 10)
    assert dec.result(b).tokens == jaxspec.generate(model, PROMPTS, max_new_tokens=6).tokens
    with pytest.raises(ValueError, match="children"):  # top_k past the vocabulary, in jax
        jaxspec.generate(model, PROMPTS, max_new_tokens=2,
                         speculation=jaxspec.Speculation(tree=(98,), window=4, sink=1))


def test_nothing_to_generate(model):
    """max_new_tokens=0: Decoder.decode (the prepare -> decode -> result flow) crashed on the
    missing state, and generate's stats lacked the speculation keys the README lists."""
    dec = jaxspec.Decoder(model, jaxspec.Speculation(gamma=3, sink=1, window=4))
    res = dec.result(dec.decode(dec.prepare(PROMPTS, max_new_tokens=0)))
    assert res.tokens == [[], [], []]
    for k in ("gamma", "acceptance_rate", "tokens_per_step", "plain_steps"):
        assert k in res.stats
    assert res.stats["gamma"] == 3


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
