"""A serving chunk that ends where a stream ends (`jaxspec.decoding.run_chunk`'s ``end_after``):
it stops after the round in which a row finished (at most ``end_after``), and the rows that go on
commit exactly what an uninterrupted chunk commits (greedy, float32); through the engine, a short
stream's last tokens come out of a chunk of just the rounds it needed, and every stream's tokens
equal `generate`'s."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import Speculation
from jaxspec.decoding import run_chunk, set_block_tables, set_rows
from jaxspec.serving import END_EARLY_MAX_ROWS, SamplingOptions, Sequence, ServingEngine

from serverkit import served_model


def _spec(kind):
    return None if kind == "plain" else Speculation(draft="self", gamma=2, sink=2, window=6,
                                                    adaptive=False)


@pytest.mark.parametrize("kind", ["plain", "chain"])
def test_chunk_ends_after_a_row_finishes(kind):
    model = served_model(eos=False)
    e = ServingEngine(model, max_batch=3, max_len=128, rounds_per_chunk=8, prefill_chunk=16,
                      page_size=8, speculation=_spec(kind))
    rd, dec, MB = e._round(True), e.decoder, e.max_blocks
    rng = np.random.default_rng()
    st = set_block_tables(e.state, np.arange(3, dtype=np.int32),
                          rng.permutation(e.n_blocks)[:3 * MB].reshape(3, MB).astype(np.int32))
    prompts = [rng.integers(5, 60, size=int(n)).tolist() for n in rng.integers(8, 20, size=2)]
    for b in (0, 1):
        st = dec.prefill_paged_row(st, b, prompts[b][:-1], 0)
    short, long_ = int(rng.integers(2, 5)), 40  # row 0 ends within the chunk, row 1 does not
    st = set_rows(st, np.asarray([0, 1, 3], np.int32),
                  np.asarray([prompts[0][-1], prompts[1][-1], 0], np.int32),
                  np.asarray([short, long_, 0], np.int32), np.zeros((3, 2), np.uint32),
                  np.asarray([len(p) - 1 for p in prompts] + [0], np.int32))
    sp = e._sampling(True, False)
    args = (dec.params, dec.dparams, sp)

    # no early end: the chunk runs all its rounds (row 2 is idle throughout)
    full, outs_full = run_chunk(*args, jax.tree.map(jnp.copy, st), jnp.int32(8), jnp.int32(0),
                                rd=rd)
    assert int(outs_full.steps) == 8 and bool(outs_full.done[0]) and not bool(outs_full.done[1])
    # early end: it stops after the round in which row 0 committed its last token
    cut, outs = run_chunk(*args, jax.tree.map(jnp.copy, st), jnp.int32(8), jnp.int32(7), rd=rd)
    n = int(outs.steps)
    assert bool(outs.done[0]) and not bool(outs.done[1]) and 1 <= n < 8
    assert int(outs.n_out[0]) == short
    # (the round before the last one had not finished row 0: the chunk ended at the first end)
    prev, prev_outs = run_chunk(*args, jax.tree.map(jnp.copy, st), jnp.int32(n - 1),
                                jnp.int32(0), rd=rd) if n > 1 else (None, None)
    if prev_outs is not None:
        assert not bool(prev_outs.done[0])
    # a row that finishes after round end_after does not end the chunk
    late, outs_late = run_chunk(*args, jax.tree.map(jnp.copy, st), jnp.int32(8), jnp.int32(n - 1),
                                rd=rd)
    assert int(outs_late.steps) == 8
    # row 1 goes on in the next chunk: what it commits over both equals the uninterrupted run's
    rest, outs2 = run_chunk(*args, cut, jnp.int32(8 - n), jnp.int32(0), rd=rd)
    got = (np.asarray(outs.out)[1, :int(outs.n_out[1])].tolist()
           + np.asarray(outs2.out)[1, :int(outs2.n_out[1])].tolist())
    want = np.asarray(outs_full.out)[1, :int(outs_full.n_out[1])].tolist()
    m = min(len(got), len(want))  # (speculative rounds commit a varying count per round)
    assert m >= 8 and got[:m] == want[:m]


def test_engine_ends_chunks_where_streams_end():
    """Streams of different budgets, started together: every chunk that a stream ended in ran
    only up to that stream's last round, and every stream's tokens equal `generate`'s."""
    model = served_model(eos=False)
    rng = np.random.default_rng()
    k = min(3, END_EARLY_MAX_ROWS)
    prompts = [rng.integers(5, 60, size=int(n)).tolist() for n in rng.integers(6, 20, size=k)]
    budgets = sorted(rng.choice(np.arange(3, 30), size=k, replace=False).tolist())
    e = ServingEngine(model, max_batch=4, max_len=96, rounds_per_chunk=32, page_size=8)
    e.chunk_seconds = 1e9  # (chunks as long as rounds_per_chunk allows: the cost model aside)
    seen = []
    real = e.decoder.call_chunk

    def spy(program, sp, state, max_rounds, pieces=None, end_after=0):
        st, outs = real(program, sp, state, max_rounds, pieces, end_after)
        seen.append((int(max_rounds), int(end_after), int(outs.steps), np.asarray(outs.n_out),
                     np.asarray(outs.done)))
        return st, outs
    e.decoder.call_chunk = spy
    seqs = [Sequence(p, SamplingOptions(max_tokens=b, temperature=0.0))
            for p, b in zip(prompts, budgets)]
    e.start(variants=[(True, False)])
    try:
        e.pause_admission()
        e.submit(seqs)
        e.resume_admission()
        for s in seqs:
            assert s.finished.wait(600)
    finally:
        e.stop()
    for p, b, s in zip(prompts, budgets, seqs):
        ref = jaxspec.generate(model, [p], max_new_tokens=b).tokens[0]
        assert s.tokens == list(ref), (b, s.tokens, ref)
    ended = 0
    for max_rounds, end_after, steps, n_out, done in seen:
        if steps == 0:
            continue  # (warm-up)
        assert end_after == max_rounds - 1
        finished = done & (n_out > 0)
        if finished.any():
            ended += 1
            # the chunk stopped in the round its first finishing row ended
            assert steps == int(n_out[finished].min()) or steps == max_rounds
    assert ended >= 2  # (the streams' distinct budgets ended distinct chunks)
