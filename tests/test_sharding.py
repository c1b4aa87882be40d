"""Sharding: meshes, partition rules, KV-head replication, sharded generation == single device.

Needs 8 (simulated) devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (what
``make test`` sets). Without them the whole module re-runs itself in a subprocess with the flag
(the flag cannot be set after jax has started).
"""

import json
import os
import socket
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxspec
from jaxspec import attention, sharding as shd
from jaxspec.session import Decoder
from jaxspec.speculation import Speculation
from tiny import tiny_config, tiny_model

HAVE8 = len(jax.devices()) >= 8
need8 = pytest.mark.skipif(not HAVE8, reason="needs 8 devices (runs in a subprocess instead)")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

MESHES = [(1, 8), (2, 4), (4, 2), (8, 1)]
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [3] * 21]  # 3 rows: padded on data = 2, 4, 8
NEW = 10


def test_in_subprocess_with_8_devices():
    if HAVE8:
        pytest.skip("8 devices here: the tests ran directly")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu", JAXSPEC_SHARDING_CHILD="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        os.path.abspath(__file__)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


# ----------------------------------------------------------------------------- models
_CACHE = {}


def _target():  # 8 heads / 8 KV heads: divides every model axis
    if "t" not in _CACHE:
        _CACHE["t"] = tiny_model(seed=0, heads=8, kv_heads=8, hidden=64, head_dim=8, vocab=64)
    return _CACHE["t"]


def _draft():
    if "d" not in _CACHE:
        _CACHE["d"] = tiny_model(seed=1, layers=1, heads=8, kv_heads=8, hidden=32, head_dim=4,
                                 vocab=64)
    return _CACHE["d"]


def _gqa():  # 8 query heads / 2 KV heads: KV heads replicated on model = 4 and 8
    if "g" not in _CACHE:
        _CACHE["g"] = tiny_model(seed=2, heads=8, kv_heads=2, hidden=64, head_dim=8, vocab=64)
    return _CACHE["g"]


SPECS = {
    "plain": lambda: None,
    "self_chain": lambda: Speculation(draft="self", gamma=3, sink=2, window=6, adaptive=False),
    "draft_chain": lambda: Speculation(draft=_draft(), gamma=3, window=None, adaptive=False),
    "self_tree": lambda: Speculation(draft="self", sink=2, window=6, tree=(2, 2, 1), adaptive=False),
}
TREE_MESHES = [(2, 4)]  # trees compile slowly on CPU: one mesh keeps the file fast
_REF = {}


def _reference(name, model_fn=_target, impl="auto"):
    key = (name, model_fn.__name__, impl)
    if key not in _REF:
        _REF[key] = jaxspec.generate(model_fn(), PROMPTS, max_new_tokens=NEW,
                                     speculation=SPECS[name](), attn_impl=impl).tokens
    return _REF[key]


class _Spy:
    """Records the shardings of the caches the decode loops receive."""

    def __init__(self, monkeypatch):
        self.cache, self.draft_cache, self.active = None, None, []
        run, per_shard = Decoder.run, attention.per_shard_attention

        def spy(dec, rd, sp, state, max_rounds):
            self.cache = state.cache.k.sharding
            if getattr(state.draft, "cache", None) is not None:  # a draft model's
                self.draft_cache = state.draft.cache.k.sharding
            return run(dec, rd, sp, state, max_rounds)

        def spy_attn(fn, *args, **kw):
            self.active.append(shd.active_mesh() is not None)
            return per_shard(fn, *args, **kw)
        monkeypatch.setattr(Decoder, "run", spy)
        monkeypatch.setattr(attention, "per_shard_attention", spy_attn)


def _kv_spec(mesh):
    d, m = mesh.shape["data"], mesh.shape["model"]
    return P(None, "data" if d > 1 else None, "model" if m > 1 else None, None, None)


def _spec5(sharding):
    """The spec of a [L, B, K, S, D] array's sharding, trailing Nones written out."""
    t = tuple(sharding.spec)
    return P(*(t + (None,) * (5 - len(t))))


# ----------------------------------------------------------------------------- mesh / rules
@need8
def test_make_mesh():
    mesh = jaxspec.make_mesh()
    assert mesh.axis_names == ("data", "model") and dict(mesh.shape) == {"data": 1, "model": 8}
    assert tuple(mesh.axis_types) == (AxisType.Auto, AxisType.Auto)
    assert dict(jaxspec.make_mesh(2).shape) == {"data": 2, "model": 4}
    assert dict(jaxspec.make_mesh(2, 2).shape) == {"data": 2, "model": 2}  # 4 of 8 devices
    with pytest.raises(shd.ShardingError, match="3 does not divide|data=3"):
        jaxspec.make_mesh(3)
    with pytest.raises(shd.ShardingError, match="needs 16 devices"):
        jaxspec.make_mesh(4, 4)


@need8
@pytest.mark.parametrize("dm", MESHES)
def test_param_and_cache_specs(dm):
    mesh = jaxspec.make_mesh(*dm)
    m = "model" if dm[1] > 1 else None
    model = shd.shard_model(_target(), mesh)
    assert model.mesh is mesh and model.config == _target().config
    p = model.params
    L = p["layers"]
    want = {"wq": P(None, None, m), "wk": P(None, None, m), "wv": P(None, None, m),
            "wo": P(None, m, None), "w_gate": P(None, None, m), "w_up": P(None, None, m),
            "w_down": P(None, m, None), "attn_norm": P(None, None), "mlp_norm": P(None, None)}
    for name, spec in want.items():
        assert L[name].sharding.spec == spec, name
    assert p["embed"].sharding.spec == P(m, None)
    assert p["lm_head"].sharding.spec == P(None, m)
    assert p["final_norm"].sharding.spec == P(None)
    cs = shd.cache_sharding(model.config, mesh, batch=8)
    assert cs.spec == _kv_spec(mesh)
    # the values are untouched
    for a, b in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(_target().params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@need8
def test_refusals_name_the_numbers():
    smol = tiny_config(heads=9, kv_heads=3, hidden=72, head_dim=8)  # SmolLM2-like
    with pytest.raises(shd.ShardingError, match="9 attention heads .* 2 devices"):
        shd.check_config(smol, jaxspec.make_mesh(4, 2))
    odd = tiny_config(heads=12, kv_heads=3, hidden=96, head_dim=8)
    with pytest.raises(shd.ShardingError, match="3 KV heads .* 4 devices"):
        shd.shard_model(jaxspec.Model(config=odd, params={}), jaxspec.make_mesh(2, 4))
    # 9 heads over model=3 / 1 work
    shd.check_config(smol, jaxspec.make_mesh(2, 3, devices=jax.devices()[:6]))


# ----------------------------------------------------------------------------- generation
@need8
@pytest.mark.parametrize("name,dm", [
    pytest.param(n, dm, id=f"{n}-dm{i}") for n in SPECS for i, dm in enumerate(MESHES)])
def test_sharded_generation_matches_single_device(name, dm, monkeypatch):
    if name == "self_tree" and dm not in TREE_MESHES:
        pytest.skip("tree speculation is checked on one mesh")
    ref = _reference(name)
    mesh = jaxspec.make_mesh(*dm)
    model = shd.shard_model(_target(), mesh)
    spy = _Spy(monkeypatch)
    res = jaxspec.generate(model, PROMPTS, max_new_tokens=NEW, speculation=SPECS[name]())
    assert res.tokens == ref
    assert res.stats["batch"] == len(PROMPTS)
    assert _spec5(spy.cache) == _kv_spec(mesh)
    if name == "draft_chain":
        assert _spec5(spy.draft_cache) == _kv_spec(mesh)
    if dm[0] * dm[1] > 1:
        assert spy.active and all(spy.active), "attention did not run per shard"


@need8
def test_biased_llama_sharded_matches_single_device():
    """Llama's o_proj and MLP biases: replicated where their matmul's output is (o, down), split
    with the MLP columns (gate, up); sharded self-speculation == single-device plain decoding."""
    model = tiny_model(seed=3, heads=8, kv_heads=4, hidden=64, head_dim=8, vocab=64,
                       attention_bias=True, mlp_bias=True)
    ref = jaxspec.generate(model, PROMPTS, max_new_tokens=NEW).tokens
    mesh = jaxspec.make_mesh(2, 4)
    sharded = shd.shard_model(model, mesh)
    L = sharded.params["layers"]
    for name, spec in (("bo", P(None, None)), ("b_down", P(None, None)),
                       ("b_gate", P(None, "model")), ("b_up", P(None, "model")),
                       ("bq", P(None, "model"))):
        assert L[name].sharding.spec == spec, name
    res = jaxspec.generate(sharded, PROMPTS, max_new_tokens=NEW,
                           speculation=Speculation(draft="self", gamma=3, sink=2, window=6, adaptive=False))
    assert res.tokens == ref


@need8
def test_kernel_per_shard_interpret(monkeypatch):
    """The Pallas kernel (interpret mode) inside shard_map: plain and chain speculation."""
    mesh = jaxspec.make_mesh(2, 4)
    model = shd.shard_model(_target(), mesh)
    # sparse T=1 drafts, T=gamma+1 verification and chunked prefill, all through the kernel
    res = jaxspec.generate(model, PROMPTS, max_new_tokens=NEW, speculation=SPECS["self_chain"](),
                           attn_impl="interpret")
    assert res.tokens == _reference("self_chain")


@need8
def test_kv_head_replication(tmp_path, monkeypatch):
    """2 KV heads on model = 4: widened to 4 (one per device), exact; also through load()."""
    mesh = jaxspec.make_mesh(2, 4)
    model = shd.shard_model(_gqa(), mesh)
    assert model.config.num_kv_heads == 4 and model.config.num_heads == 8
    wk = np.asarray(model.params["layers"]["wk"])  # [L, D, 4 * Dh]
    wk0 = np.asarray(_gqa().params["layers"]["wk"])
    Dh = 8
    np.testing.assert_array_equal(wk[..., 0:Dh], wk0[..., 0:Dh])
    np.testing.assert_array_equal(wk[..., Dh:2 * Dh], wk0[..., 0:Dh])
    np.testing.assert_array_equal(wk[..., 2 * Dh:3 * Dh], wk0[..., Dh:2 * Dh])
    assert model.params["layers"]["wk"].sharding.spec == P(None, None, "model")
    for name in ("plain", "self_chain"):
        ref = _reference(name, _gqa)
        spy = _Spy(monkeypatch)
        res = jaxspec.generate(model, PROMPTS, max_new_tokens=NEW, speculation=SPECS[name]())
        assert res.tokens == ref, name
        assert _spec5(spy.cache) == P(None, "data", "model", None, None)
    # saving the widened model writes the checkpoint's 2 KV heads again
    jaxspec.save(model, tmp_path / "saved")
    again = jaxspec.load(tmp_path / "saved")
    assert again.config == _gqa().config
    for name, x in _gqa().params["layers"].items():
        np.testing.assert_array_equal(np.asarray(again.params["layers"][name]), np.asarray(x))
    # checkpoints keep 2 KV heads: load() restores wk replicated over model, generate widens
    jaxspec.save(_gqa(), tmp_path / "ckpt")
    loaded = jaxspec.load(tmp_path / "ckpt", mesh=mesh)
    assert loaded.params["layers"]["wq"].sharding.spec == P(None, None, "model")
    assert loaded.params["layers"]["wk"].sharding.spec == P(None, None, None)
    assert loaded.params["embed"].sharding.spec == P("model", None)
    wide = shd.prepare(loaded)  # what generate runs: only wk / wv are new arrays
    assert wide.config.num_kv_heads == 4 and wide.params["layers"]["wq"] is \
        loaded.params["layers"]["wq"]
    spy = _Spy(monkeypatch)
    res = jaxspec.generate(loaded, PROMPTS, max_new_tokens=NEW)
    assert res.tokens == _reference("plain", _gqa)
    assert _spec5(spy.cache) == P(None, "data", "model", None, None)


@need8
def test_unsharded_params_with_mesh_and_errors():
    mesh = jaxspec.make_mesh(4, 2)
    # an in-memory model that only names a mesh is laid out by generate
    m = jaxspec.Model(config=_target().config, params=_target().params, mesh=mesh)
    assert jaxspec.generate(m, PROMPTS, max_new_tokens=NEW).tokens == _reference("plain")
    # a sharded draft with an unsharded target is refused
    spec = Speculation(draft=shd.shard_model(_draft(), mesh), gamma=2, window=None, adaptive=False)
    with pytest.raises(shd.ShardingError, match="draft model is sharded"):
        jaxspec.generate(_target(), PROMPTS, max_new_tokens=4, speculation=spec)


@need8
def test_mesh_follows_replaced_weights_and_jax_meshes():
    """On a mesh the laid-out copy was kept by id(params): after arrays of the same dict were
    replaced, generate decoded with the old ones (single-device decoding made a new copy). A
    mesh from jax.make_mesh (Explicit axes by default) was accepted, then a step failed to trace."""
    m = jaxspec.Model(config=_gqa().config, params=dict(_gqa().params))
    other = tiny_model(seed=7, heads=8, kv_heads=2, hidden=64, head_dim=8, vocab=64)
    want = jaxspec.generate(other, PROMPTS, max_new_tokens=NEW).tokens
    sm = shd.shard_model(m, jaxspec.make_mesh(2, 4))  # KV heads widened 2 -> 4
    first = jaxspec.generate(sm, PROMPTS, max_new_tokens=NEW).tokens
    assert first == jaxspec.generate(_gqa(), PROMPTS, max_new_tokens=NEW).tokens != want
    lm = jaxspec.Model(config=m.config, params=m.params, mesh=jaxspec.make_mesh(2, 4))
    assert jaxspec.generate(lm, PROMPTS, max_new_tokens=NEW).tokens == first
    for k in other.params:  # new arrays in the same dict
        lm.params[k] = other.params[k]
    assert jaxspec.generate(lm, PROMPTS, max_new_tokens=NEW).tokens == want
    explicit = jax.make_mesh((2, 4), ("data", "model"),
                             axis_types=(AxisType.Explicit, AxisType.Explicit))
    em = shd.shard_model(other, explicit)
    assert jaxspec.generate(em, PROMPTS, max_new_tokens=NEW).tokens == want


@need8
def test_samples_whose_groups_cross_the_data_shards():
    """n samples per prompt form groups of n rows; 3 prompts x n=2 on a data axis of 2 put 3
    rows on each shard, so a group crossed two shards and generate raised after the prefill
    (the README's 3 prompts x n=8 on 2 x 4 too). Each row now reads its group's prefix."""
    m = _target()
    rng = np.random.default_rng(5)
    system = rng.integers(0, 64, size=40).tolist()
    prompts = [system + rng.integers(0, 64, size=k).tolist() for k in (1, 5, 12)]
    rows = [p for p in prompts for _ in range(2)]
    want = jaxspec.generate(m, rows, max_new_tokens=5).tokens
    sm = shd.shard_model(m, jaxspec.make_mesh(2, 2))
    for share in (None, "auto"):
        assert jaxspec.generate(sm, prompts, max_new_tokens=5, n=2,
                                shared_prefix=share).tokens == want
    spec = Speculation(draft="self", gamma=2, sink=2, window=6, adaptive=False)
    assert jaxspec.generate(sm, prompts, max_new_tokens=5, n=2, shared_prefix="auto",
                            speculation=spec).tokens == want
    # a draft model the mesh cannot split is named as the draft
    bad = Speculation(draft=tiny_model(seed=3, heads=4, kv_heads=4, hidden=32, head_dim=8,
                                       vocab=64), gamma=2, window=None, adaptive=False)
    with pytest.raises(shd.ShardingError, match="the draft model"):
        jaxspec.generate(shd.shard_model(m, jaxspec.make_mesh(1, 8)), PROMPTS, max_new_tokens=2,
                         speculation=bad)


# ----------------------------------------------------------------------------- multi-process
_WORKER = textwrap.dedent("""
    import json, os, sys
    pid, port, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, {here!r})
    import jax
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{{port}}", num_processes=2,
                               process_id=pid)
    import jaxspec
    from jaxspec import sharding as shd
    assert jax.process_count() == 2 and len(jax.devices()) == 8
    assert len(jax.local_devices()) == 4
    mesh = jaxspec.make_mesh(2, 4)
    model = jaxspec.load(ckpt, mesh=mesh)  # Orbax restores each process's shards
    assert model.params["layers"]["wq"].sharding.spec == shd.P(None, None, "model")
    assert not model.params["layers"]["wq"].is_fully_addressable
    res = jaxspec.generate(model, {prompts!r}, max_new_tokens={new})
    print("RESULT " + json.dumps(res.tokens), flush=True)
""")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_multi_process_two_by_four(tmp_path):
    """2 local processes x 4 CPU devices, one 2 x 4 mesh through jax.distributed."""
    if os.environ.get("JAXSPEC_SHARDING_CHILD"):
        pytest.skip("ran in the parent process")
    script = tmp_path / "worker.py"
    script.write_text(_WORKER.format(here=HERE, prompts=PROMPTS, new=NEW))
    port = str(_free_port())
    jaxspec.save(_gqa(), tmp_path / "ckpt")  # same weights in every process
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    procs = [subprocess.Popen([sys.executable, str(script), str(i), port,
                               str(tmp_path / "ckpt")], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=300)
            outs.append((p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for rc, out in outs:
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if rc != 0 or not lines:
            if "distributed" in out and ("UNIMPLEMENTED" in out or "not supported" in out):
                pytest.skip(f"jax.distributed with several CPU processes unavailable: {out[-500:]}")
            raise AssertionError(f"worker failed (rc={rc}):\n{out[-3000:]}")
        results.append(json.loads(lines[-1][len("RESULT "):]))
    assert results[0] == results[1]
    assert results[0] == _reference("plain", _gqa)


@need8
def test_cli_tp_dp_flags():
    from jaxspec.args import mesh_from_args as _mesh_from_args
    from jaxspec.cli import build_parser
    parse = lambda *a: build_parser().parse_args(["generate", "ckpt", *a])
    assert _mesh_from_args(parse()) is None
    assert _mesh_from_args(parse("--tp", "1")) is None
    assert dict(_mesh_from_args(parse("--tp", "4", "--dp", "2")).shape) == {"data": 2, "model": 4}
    assert dict(_mesh_from_args(parse("--dp", "2")).shape) == {"data": 2, "model": 4}
    assert dict(_mesh_from_args(parse("--tp", "2")).shape) == {"data": 1, "model": 2}
    with pytest.raises(ValueError, match="needs 16 devices"):  # names --tp / --dp
        _mesh_from_args(parse("--tp", "8", "--dp", "2"))
