"""Compact chunks (`ServingEngine(compact_rows=True)`): while at most half the slots decode, a
chunk runs only their rows, taken out of the slots' state and put back. The answers are those of
the full batch: greedy ones equal `jaxspec.generate` of each prompt alone (float32), seeded sampled
ones equal the same request on an engine that never compacts; with plain decoding, the
self-draft and a draft model."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.decoding import ChunkOutputs, compactable, put_rows, spread_outputs, take_rows
from jaxspec.paged import shared_context
from jaxspec.session import Decoder
from jaxspec.serving import SamplingOptions, Sequence, ServingEngine
from jaxspec.sharding import shard_model

from tiny import tiny_model

KW = dict(max_batch=4, max_len=64, rounds_per_chunk=3, prefill_chunk=16)


def speculations(model):
    return {"plain": None,
            "self": jaxspec.Speculation(draft="self", gamma=2, sink=2, window=6, adaptive=False),
            "model": jaxspec.Speculation(draft=tiny_model(seed=7, scale=3.0), gamma=2,
                                         adaptive=False)}


def serve(engine, prompts, options):
    seqs = [Sequence(list(p), o) for p, o in zip(prompts, options)]
    engine.submit(seqs)
    for s in seqs:
        assert s.finished.wait(120) and s.error is None, s.error
    return [list(s.tokens) for s in seqs]


@pytest.mark.parametrize("kind,paged", [("plain", False), ("self", False), ("model", False),
                                        ("self", True)])
def test_compact_chunks_answer_as_the_full_batch(kind, paged):
    """Dense slots, and a block pool (its rows move without their K/V: the pool stays whole)."""
    model = tiny_model(seed=3, scale=3.0)
    spec = speculations(model)[kind]
    rng = np.random.default_rng()
    kw = dict(KW, page_size=8, share_min_tokens=None) if paged else KW
    compact = ServingEngine(model, speculation=spec, compact_rows=True, **kw).start(
        variants=[(True, False), (False, False)])
    full = ServingEngine(model, speculation=spec, compact_rows=False, **kw).start(
        variants=[(False, False)])
    try:
        assert compact.compact_rows and not full.compact_rows
        # one and two requests at a time, until compact chunks have run for both sizes
        deadline = time.time() + 240
        rounds = 0
        while compact.metrics()["compact_chunks"] < 6 or rounds < 4:
            assert time.time() < deadline, compact.metrics()
            k = 1 + rounds % 2
            prompts = [rng.integers(2, 60, size=int(rng.integers(3, 20))).tolist()
                       for _ in range(k)]
            n_new = int(rng.integers(4, 20))
            greedy = [SamplingOptions(max_tokens=n_new, temperature=0.0) for _ in prompts]
            got = serve(compact, prompts, greedy)
            want = jaxspec.generate(model, prompts, max_new_tokens=n_new, speculation=spec,
                                    ignore_eos=False).tokens
            assert got == [list(w) for w in want], (kind, prompts)
            seeded = [SamplingOptions(max_tokens=n_new, temperature=1.0,
                                      seed=int(rng.integers(1 << 30))) for _ in prompts]
            assert serve(compact, prompts, seeded) == serve(full, prompts, seeded), (kind, prompts)
            rounds += 1
        assert compact.metrics()["compact_chunks"] > 0 and full.metrics()["compact_chunks"] == 0
    finally:
        compact.stop()
        full.stop()


def test_off_where_it_cannot_apply():
    model = tiny_model(seed=1)
    mesh = jaxspec.make_mesh(2, 1)
    sharded = ServingEngine(shard_model(model, mesh), compact_rows=True, **KW)
    assert not sharded.compact_rows
    assert ServingEngine(model, **KW).compact_rows  # the CPU default
    assert ServingEngine(model, page_size=16, **KW).compact_rows


def test_a_block_pool_is_not_copied():
    """`take_rows` of a paged state moves the rows' tables and counters; both states hold the
    one pool (a copy of it would cost its whole size per chunk), and `put_rows` takes the rows'
    state's pool (the one its chunk wrote)."""
    model = tiny_model(seed=2)
    dec = Decoder(model, None)
    rng = np.random.default_rng()
    state = dec.paged_state(6, 40, 8, 5, 8)
    c = state.cache
    state = state.replace(cache=c.replace(
        block_table=jnp.asarray(rng.integers(0, 40, c.block_table.shape), jnp.int32),
        lengths=jnp.asarray(rng.integers(0, 40, 6), jnp.int32)),
        n_out=jnp.asarray(rng.integers(0, 8, 6), jnp.int32))
    assert compactable(state)
    rows = jnp.asarray([4, 1], jnp.int32)
    sub = take_rows(state, rows)
    assert sub.cache.k is state.cache.k and sub.cache.v is state.cache.v
    np.testing.assert_array_equal(sub.cache.block_table, np.asarray(state.cache.block_table)[[4, 1]])
    np.testing.assert_array_equal(sub.n_out, np.asarray(state.n_out)[[4, 1]])
    tables = np.asarray(state.cache.block_table)
    k2 = sub.cache.k + 1
    changed = sub.replace(cache=sub.cache.replace(k=k2, block_table=sub.cache.block_table + 1))
    after = put_rows(jax.tree.map(jnp.copy, state), rows, changed)
    assert after.cache.k is k2
    want = tables.copy()
    want[[4, 1]] += 1
    np.testing.assert_array_equal(after.cache.block_table, want)
    assert not compactable(state.replace(cache=state.cache.replace(
        shared=shared_context(state.cache.k, state.cache.v, tables[0],
                                            np.int32(8), np.ones(6, bool)))))


@pytest.mark.parametrize("kind,kept", [("plain", False), ("model", False), ("model", True)])
def test_take_and_put_rows_move_exactly_those_rows(kind, kept):
    """Every per-row array of a state (the caches, a draft model's cache and last token, the
    counters) of random contents: `take_rows` gives those rows, `put_rows` writes changed rows
    back and leaves the others; `spread_outputs` puts a chunk's outputs where its rows are.
    ``kept``: through programs compiled once per shapes (a server's), which a state that went
    through another program reuses."""
    programs = {} if kept else None
    model = tiny_model(seed=2)
    spec = None if kind == "plain" else speculations(model)["model"]
    dec = Decoder(model, spec)
    B = 5
    rng = np.random.default_rng()
    state = jax.tree.map(
        lambda x: jnp.asarray(rng.integers(0, 100, np.shape(x))).astype(jnp.asarray(x).dtype)
        if np.ndim(x) else x, dec.empty_state(B, 32, 8))
    assert compactable(state) and (state.draft is not None) == (kind == "model")
    rows = rng.permutation(B)[:3].astype(np.int32)
    others = np.setdiff1d(np.arange(B), rows)
    before = jax.tree.map(np.asarray, state)
    sub = take_rows(state, jnp.asarray(rows), programs)
    changed = jax.tree.map(lambda x: (~x if x.dtype == bool else x + 1) if np.ndim(x) else x, sub)
    after = put_rows(jax.tree.map(jnp.copy, state), jnp.asarray(rows), changed, programs)
    if kept:  # a state whose arrays carry an equivalent sharding of another kind (as a state
        # out of another program can): the same programs, no new one
        assert len(programs) == 2
        mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("x",))
        named = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        other = jax.tree.map(lambda x: jax.device_put(x, named), after)
        assert other.n_out.sharding != after.n_out.sharding
        again = take_rows(other, jnp.asarray(rows), programs)
        assert len(programs) == 2
        for x, y in zip(jax.tree.leaves(again), jax.tree.leaves(changed)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    n = 0
    for old, got, new, mid in zip(jax.tree.leaves(before), jax.tree.leaves(after),
                                  jax.tree.leaves(changed), jax.tree.leaves(sub)):
        old, got, new, mid = map(np.asarray, (old, got, new, mid))
        if old.ndim == 0:
            continue
        axis = 1 if old.ndim == 5 else 0  # [L, B, K, S, D] caches
        np.testing.assert_array_equal(mid, np.take(old, rows, axis=axis))
        np.testing.assert_array_equal(np.take(got, rows, axis=axis), new)
        np.testing.assert_array_equal(np.take(got, others, axis=axis),
                                      np.take(old, others, axis=axis))
        n += 1
    assert n == len([x for x in jax.tree.leaves(before) if np.ndim(x)])
    outs = jax.tree.map(lambda x: jnp.asarray(rng.integers(1, 9, np.shape(x))).astype(x.dtype),
                        ChunkOutputs(out=sub.out, from_draft=sub.from_draft, n_out=sub.n_out,
                                     done=sub.done, lengths=sub.cache.lengths, steps=sub.steps,
                                     stats=sub.stats))
    wide = spread_outputs(outs, jnp.asarray(rows), batch=B)
    np.testing.assert_array_equal(np.asarray(wide.out)[rows], np.asarray(outs.out))
    np.testing.assert_array_equal(np.asarray(wide.n_out)[others], 0)
    assert np.asarray(wide.done)[others].all()


def test_compact_programs_compiled_ahead_are_the_ones_chunks_run():
    """On a GPU the engine compiles every compact batch's program in the background after its
    warm-up, from abstract shapes: those programs must be found by the chunks that run on real
    rows (a key that differs in a sharding or a shape would compile them all again)."""
    model = tiny_model(seed=4)
    engine = ServingEngine(model, page_size=8, compact_rows=True, **KW)
    assert engine.compact_rows
    engine.warmup(variants=[(True, False)])
    engine._compile_compact([(True, False)])
    engine._compiler.shutdown(wait=True)
    assert {k[1] for k in engine._compiling} == {1, 2}
    for n in (1, 2):
        rows = np.arange(n, dtype=np.int32)
        sub = take_rows(engine.state, jnp.asarray(rows))
        program, _ = engine.decoder.chunk_program(
            engine._round(True), engine._sampling(True, False, rows), sub, compile=False)
        assert program is not None, n
