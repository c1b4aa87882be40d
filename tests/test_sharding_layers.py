"""Per-layer (unrolled) parameters on a mesh: the layout `jaxspec.sharding.decode_params` picks on GPU.

On GPU the layers are split into per-layer arrays (XLA copies slices of stacked weights before
their matmuls); on a mesh those arrays must keep the shardings of the partition rules. On CPU the
stacked, scanned layout stays the default, so these tests force the split with
``sharding.DEFAULT_LAYOUT = "unrolled"`` and check that sharded generation gives exactly the single-device
(stacked) tokens in float32, and that each per-layer array carries the intended sharding.

Needs 8 (simulated) devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``; without
them the module re-runs itself in a subprocess with the flag.
"""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxspec
from jaxspec import sharding as shd
from jaxspec.session import Decoder
from jaxspec.speculation import Speculation
from tiny import tiny_model

HAVE8 = len(jax.devices()) >= 8
need8 = pytest.mark.skipif(not HAVE8, reason="needs 8 devices (runs in a subprocess instead)")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MESHES = [(2, 4), (1, 8)]
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [3] * 21]
NEW = 10


def test_in_subprocess_with_8_devices():
    if HAVE8:
        pytest.skip("8 devices here: the tests ran directly")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        os.path.abspath(__file__)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


# Fresh models for every use: decode_params replaces a model's params in place.
def _target():  # 8 / 8 heads: divides every model axis
    return tiny_model(seed=0, heads=8, kv_heads=8, hidden=64, head_dim=8, vocab=64)


def _gqa():  # 8 query / 2 KV heads: widened to one KV head per device on model = 4 and 8
    return tiny_model(seed=2, heads=8, kv_heads=2, hidden=64, head_dim=8, vocab=64,
                      attention_bias=True)


def _draft():
    return tiny_model(seed=1, layers=1, heads=8, kv_heads=8, hidden=32, head_dim=4, vocab=64)


SPECS = {
    "plain": lambda: None,
    "self_chain": lambda: Speculation(draft="self", gamma=3, sink=2, window=6, adaptive=False),
    "draft_chain": lambda: Speculation(draft=_draft(), gamma=3, window=None, adaptive=False),
}
_RING = lambda: Speculation(draft=_draft(), gamma=2, sink=2, window=6, adaptive=False)  # noqa: E731
_TREE = lambda: Speculation(draft="self", sink=2, window=6, tree=(2, 1), adaptive=False)  # noqa: E731
_REF = {}


def _reference(name, model_fn=_target, prompts=PROMPTS):
    """Single device, stacked (scanned) layers: the CPU default."""
    key = (name, model_fn.__name__, str(prompts))
    if key not in _REF:
        old, shd.DEFAULT_LAYOUT = shd.DEFAULT_LAYOUT, "auto"
        try:
            spec = {**SPECS, "self_tree": _TREE, "draft_ring": _RING}[name]()
            _REF[key] = jaxspec.generate(model_fn(), prompts, max_new_tokens=NEW,
                                         speculation=spec).tokens
        finally:
            shd.DEFAULT_LAYOUT = old
    return _REF[key]


def _layer_specs(m):
    """The intended spec of every per-layer parameter on a model axis named ``m``."""
    return {"wq": P(None, m), "wk": P(None, m), "wv": P(None, m), "bq": P(m), "bk": P(m),
            "bv": P(m), "wo": P(m, None), "w_gate": P(None, m), "w_up": P(None, m),
            "w_down": P(m, None), "attn_norm": P(None), "mlp_norm": P(None),
            # a llama's attention_bias includes o_proj's: replicated like wo's output
            "bo": P(None), "b_gate": P(m), "b_up": P(m), "b_down": P(None)}


def _check_per_layer(params, mesh, num_layers):
    layers = params["layers"]
    assert isinstance(layers, list) and len(layers) == num_layers
    want = _layer_specs("model")
    for i, lay in enumerate(layers):
        for name, x in lay.items():
            assert isinstance(x.sharding, jax.sharding.NamedSharding), (i, name)
            assert x.sharding.mesh == mesh, (i, name)
            assert x.sharding.spec == want[name], (i, name, x.sharding.spec)
    assert params["embed"].sharding.spec == P("model", None)
    if "lm_head" in params:
        assert params["lm_head"].sharding.spec == P(None, "model")


class _Spy:
    """Records the params (and draft params) the decode loops receive."""

    def __init__(self, monkeypatch):
        self.params, self.dparams = [], []
        run = Decoder.run

        def spy(dec, rd, sp, state, max_rounds):
            self.params.append(dec.params)
            if dec.draft is not None and rd.drafter is not None:
                self.dparams.append(dec.dparams)
            return run(dec, rd, sp, state, max_rounds)
        monkeypatch.setattr(Decoder, "run", spy)


# ----------------------------------------------------------------------------- layout
@need8
@pytest.mark.parametrize("dm", MESHES)
def test_per_layer_params_keep_their_shardings(dm, monkeypatch):
    mesh = jaxspec.make_mesh(*dm)
    src = _gqa()
    stacked = {n: np.asarray(x) for n, x in src.params["layers"].items()}
    model = shd.shard_model(src, mesh)  # 2 KV heads widened to dm[1]
    wide_k = np.asarray(model.params["layers"]["wk"])
    monkeypatch.setattr(shd, "DEFAULT_LAYOUT", "unrolled")
    params = shd.decode_params(model)
    assert params is model.params  # replaced in place: no second copy kept
    _check_per_layer(params, mesh, model.config.num_layers)
    for i, lay in enumerate(params["layers"]):
        np.testing.assert_array_equal(np.asarray(lay["wk"]), wide_k[i])
        np.testing.assert_array_equal(np.asarray(lay["wq"]), stacked["wq"][i])
        np.testing.assert_array_equal(np.asarray(lay["w_down"]), stacked["w_down"][i])
    # per-layer params count as laid out: generate does not lay them out again
    assert shd.prepare(model) is model
    assert shd.decode_params(model) is params  # idempotent
    # shard_model moves per-layer params to another mesh by the same rules
    other = jaxspec.make_mesh(4, 2)
    moved = shd.shard_model(model, other)
    _check_per_layer(moved.params, other, model.config.num_layers)
    np.testing.assert_array_equal(np.asarray(moved.params["layers"][1]["wk"]), wide_k[1])
    # the scan layout stacks them back, with the stacked shardings
    monkeypatch.setattr(shd, "DEFAULT_LAYOUT", "scan")
    back = shd.decode_params(model)["layers"]
    assert back["wq"].sharding.spec == P(None, None, "model")
    assert back["w_down"].sharding.spec == P(None, "model", None)
    assert back["attn_norm"].sharding.spec == P(None, None)
    np.testing.assert_array_equal(np.asarray(back["wq"]), stacked["wq"])
    np.testing.assert_array_equal(np.asarray(back["wk"]), wide_k)


def test_auto_layout_on_cpu_keeps_the_scan():
    model = _target()
    assert isinstance(shd.decode_params(model)["layers"], dict)
    with pytest.raises(ValueError, match="layout"):
        shd.decode_params(model, layout="bogus")


# ----------------------------------------------------------------------------- generation
@need8
@pytest.mark.parametrize("name,dm", [
    pytest.param(n, dm, id=f"{n}-dm{i}") for n in SPECS for i, dm in enumerate(MESHES)])
def test_per_layer_sharded_generation_matches_single_device(name, dm, monkeypatch):
    ref = _reference(name)
    monkeypatch.setattr(shd, "DEFAULT_LAYOUT", "unrolled")
    mesh = jaxspec.make_mesh(*dm)
    model = shd.shard_model(_target(), mesh)
    spy = _Spy(monkeypatch)
    res = jaxspec.generate(model, PROMPTS, max_new_tokens=NEW, speculation=SPECS[name]())
    assert res.tokens == ref
    assert spy.params, "no decode loop ran"
    _check_per_layer(spy.params[-1], mesh, model.config.num_layers)
    if name.startswith("draft"):
        _check_per_layer(spy.dparams[-1], mesh, 1)


@need8
def test_per_layer_tree_on_mesh(monkeypatch):
    ref = _reference("self_tree")
    monkeypatch.setattr(shd, "DEFAULT_LAYOUT", "unrolled")
    mesh = jaxspec.make_mesh(2, 4)
    model = shd.shard_model(_target(), mesh)
    res = jaxspec.generate(model, PROMPTS, max_new_tokens=NEW, speculation=_TREE())
    assert res.tokens == ref
    _check_per_layer(model.params, mesh, model.config.num_layers)


@need8
def test_per_layer_load_widen_and_draft(tmp_path, monkeypatch):
    """A checkpoint restored sharded (2 KV heads, q/k/v biases), widened by generate to 8, split
    into per-layer arrays, with a per-layer ring-buffer draft model on the same mesh: the
    single-device tokens."""
    dm = (1, 8)
    jaxspec.save(_gqa(), tmp_path / "t")
    jaxspec.save(_draft(), tmp_path / "d")
    mesh = jaxspec.make_mesh(*dm)
    loaded = jaxspec.load(tmp_path / "t", mesh=mesh)
    draft = jaxspec.load(tmp_path / "d", mesh=mesh)
    ref = _reference("plain", _gqa)
    ref_d = _reference("draft_ring", _gqa)
    monkeypatch.setattr(shd, "DEFAULT_LAYOUT", "unrolled")
    spy = _Spy(monkeypatch)
    assert jaxspec.generate(loaded, PROMPTS, max_new_tokens=NEW).tokens == ref
    wide = shd.prepare(loaded)  # what generate ran: KV heads widened to one per device
    assert wide.config.num_kv_heads == dm[1]
    _check_per_layer(spy.params[-1], mesh, wide.config.num_layers)
    assert spy.params[-1]["layers"][0]["wk"].shape == (64, dm[1] * 8)
    spec = Speculation(draft=draft, gamma=2, sink=2, window=6, adaptive=False)
    assert jaxspec.generate(loaded, PROMPTS, max_new_tokens=NEW, speculation=spec).tokens == ref_d
    _check_per_layer(spy.dparams[-1], mesh, 1)
    # a per-layer model is saved stacked
    jaxspec.save(wide, tmp_path / "again")
    again = jaxspec.load(tmp_path / "again")
    assert isinstance(again.params["layers"], dict)


@need8
def test_per_layer_shared_prefix_on_mesh(monkeypatch):
    rng = np.random.default_rng(0)
    system = rng.integers(0, 64, size=40).tolist()
    prompts = [system + rng.integers(0, 64, size=k).tolist() for k in (1, 5, 12, 3)]
    ref = jaxspec.generate(_target(), prompts, max_new_tokens=NEW).tokens
    monkeypatch.setattr(shd, "DEFAULT_LAYOUT", "unrolled")
    mesh = jaxspec.make_mesh(2, 4)
    model = shd.shard_model(_target(), mesh)
    res = jaxspec.generate(model, prompts, max_new_tokens=NEW, shared_prefix="auto")
    assert res.tokens == ref
    _check_per_layer(model.params, mesh, model.config.num_layers)


@need8
def test_serving_engine_on_a_mesh():
    """The serving engine on a model sharded over a ``data x model`` mesh (its decode chunks run
    on the engine's device thread, inside the mesh; a request is prefilled alone into its slot,
    its one row computed on every data shard): the single-device greedy tokens, plain and
    self-speculative, with dense slots and with a paged pool (the paged kernel per shard, in
    interpret mode) whose requests about one document attend to its shared context together. A
    slot count that does not divide over the data axis is refused."""
    from jaxspec.serving import SamplingOptions, Sequence, ServingEngine
    doc = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2]  # two full blocks of 8, and one
    prompts = [doc + [7, 7], doc + [2, 8, 1]] + PROMPTS
    ref = jaxspec.generate(_gqa(), prompts, max_new_tokens=NEW).tokens
    model = shd.shard_model(_gqa(), jaxspec.make_mesh(2, 2))
    self_spec = Speculation(gamma=2, sink=2, window=6, adaptive=False)
    for kw in (dict(), dict(speculation=self_spec),
               dict(page_size=8, attn_impl="interpret", speculation=self_spec,
                    share_min_tokens=0)):
        engine = ServingEngine(model, max_batch=4, max_len=64, **kw).start(
            variants=[(True, False)])  # greedy requests only
        try:
            engine.pause_admission()
            seqs = [Sequence(p, SamplingOptions(max_tokens=NEW, temperature=0)) for p in prompts]
            engine.submit(seqs)
            engine.resume_admission()
            for q in seqs:
                assert q.finished.wait(300) and q.error is None, q.error
            m = engine.metrics()
        finally:
            engine.stop()
        assert [q.tokens for q in seqs] == ref, kw
        if "share_min_tokens" in kw:
            assert m["shared_context_copies"] >= 1, m
    with pytest.raises(ValueError, match="multiple of 2"):
        ServingEngine(model, max_batch=3, max_len=64)
