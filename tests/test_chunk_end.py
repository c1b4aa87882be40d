"""A serving chunk that ends where a stream ends (`jaxspec.decoding.run_chunk`'s ``end_after``):
it stops after the round in which a row finished (at most ``end_after``), and the rows that go on
commit exactly what an uninterrupted chunk commits (greedy, float32); through the engine, a short
stream's last tokens come out of a chunk of just the rounds it needed, and every stream's tokens
equal `generate`'s."""

import time

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
    _, outs_full = run_chunk(*args, jax.tree.map(jnp.copy, st), jnp.int32(8), jnp.int32(0),
                             rd=rd)
    assert int(outs_full.steps) == 8 and bool(outs_full.done[0]) and not bool(outs_full.done[1])
    # early end: it stops after the round in which row 0 committed its last token
    cut, outs = run_chunk(*args, jax.tree.map(jnp.copy, st), jnp.int32(8), jnp.int32(7), rd=rd)
    n = int(outs.steps)
    assert bool(outs.done[0]) and not bool(outs.done[1]) and 1 <= n < 8
    assert int(outs.n_out[0]) == short
    # (the round before the last one had not finished row 0: the chunk ended at the first end)
    if n > 1:
        _, prev_outs = run_chunk(*args, jax.tree.map(jnp.copy, st), jnp.int32(n - 1),
                                 jnp.int32(0), rd=rd)
        assert not bool(prev_outs.done[0])
    # the round it finished in is the bound: end_after = n still ends there, n - 1 does not
    _, outs_at = run_chunk(*args, jax.tree.map(jnp.copy, st), jnp.int32(8), jnp.int32(n), rd=rd)
    assert int(outs_at.steps) == n
    _, outs_late = run_chunk(*args, jax.tree.map(jnp.copy, st), jnp.int32(8), jnp.int32(n - 1),
                             rd=rd)
    assert int(outs_late.steps) == 8
    # row 1 goes on in the next chunk: what it commits over both equals the uninterrupted run's
    _, outs2 = run_chunk(*args, cut, jnp.int32(8 - n), jnp.int32(0), rd=rd)
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

    def spy(program, sp, state, max_rounds, pieces=None, end_after=0, num_pieces=0):
        st, outs = real(program, sp, state, max_rounds, pieces, end_after, num_pieces)
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
            # the chunk stopped in the round its first finishing row ended (plain rounds: a row
            # commits one token per round from the chunk's first)
            assert steps == int(n_out[finished].min())
    assert ended >= 2  # (the streams' distinct budgets ended distinct chunks)


@pytest.mark.parametrize("kind", ["plain", "chain"])
def test_mixed_chunk_goes_on_after_its_pieces(kind):
    """`run_mixed_chunk`: three rounds prefill row 0's prompt in pieces, then plain rounds up to
    ``max_rounds``; rows 1 and 2 commit what `run_chunk` of as many rounds commits after a
    prefill of row 0 (greedy, float32). A row that finishes during the pieces ends the chunk after
    them when ``end_after`` reaches them."""
    from jaxspec.decoding import Pieces, run_mixed_chunk

    model = served_model(eos=False)
    e = ServingEngine(model, max_batch=3, max_len=128, rounds_per_chunk=8, prefill_chunk=16,
                      page_size=8, speculation=_spec(kind), mixed_prefill=8)
    rd, dec, MB = e._round(True), e.decoder, e.max_blocks
    rng = np.random.default_rng()
    st0 = set_block_tables(e.state, np.arange(3, dtype=np.int32),
                           rng.permutation(e.n_blocks)[:3 * MB].reshape(3, MB).astype(np.int32))
    prompts = [rng.integers(5, 60, size=n).tolist() for n in (20, 15, 11)]
    for b in (1, 2):
        st0 = dec.prefill_paged_row(st0, b, prompts[b][:-1], 0)
    fill, C = prompts[0][:-1], 8  # 19 tokens: pieces of 8, 8, 3
    tokens = np.zeros((8, C), np.int32)
    starts = np.minimum(np.arange(8) * C, len(fill)).astype(np.int32)
    ends = np.minimum(starts + C, len(fill)).astype(np.int32)
    for i in range(3):
        tokens[i, :ends[i] - starts[i]] = fill[starts[i]:ends[i]]
    pieces = Pieces(tokens=tokens, rows=np.zeros(8, np.int32), starts=starts, ends=ends)
    sp = e._sampling(True, False)
    args = (dec.params, dec.dparams, sp)

    def start(budget1, budget2=30):
        return set_rows(jax.tree.map(jnp.copy, st0), np.asarray([1, 2, 3], np.int32),
                        np.asarray([prompts[1][-1], prompts[2][-1], 0], np.int32),
                        np.asarray([budget1, budget2, 0], np.int32), np.zeros((3, 2), np.uint32),
                        np.asarray([len(prompts[1]) - 1, len(prompts[2]) - 1, 0], np.int32))

    got, outs = run_mixed_chunk(*args, start(30), jnp.int32(3), pieces, jnp.int32(6),
                                jnp.int32(0), rd=rd)
    ref = dec.prefill_paged_row(start(30), 0, fill, 0)
    ref, ref_outs = run_chunk(*args, ref, jnp.int32(6), jnp.int32(0), rd=rd)
    assert int(outs.steps) == 6 and int(got.cache.lengths[0]) == len(fill)
    n = np.asarray(outs.n_out)
    assert n[0] == 0 and (n[1:] >= 6).all()
    np.testing.assert_array_equal(n, np.asarray(ref_outs.n_out))
    for b in (1, 2):
        assert np.asarray(outs.out)[b, :n[b]].tolist() == np.asarray(ref_outs.out)[b, :n[b]].tolist()

    # row 1 with a budget of 2 finishes in the pieces' rounds: with end_after >= 3 the chunk
    # stops after them, with end_after < 3 it goes on
    for end_after, steps in ((5, 3), (3, 3), (2, 6)):
        _, o = run_mixed_chunk(*args, start(2), jnp.int32(3), pieces, jnp.int32(6),
                               jnp.int32(end_after), rd=rd)
        assert int(o.steps) == steps and bool(o.done[1]) and int(o.n_out[1]) == 2, end_after

    # row 1 finishes in a plain round after the pieces (round r, found by running 1, 2, ...
    # rounds): end_after counts rounds from the chunk's first, so end_after = r ends it there
    # and r - 1 does not (row 2's budget is more than 12 rounds can commit: it never ends one)
    budget = 5 if kind == "plain" else 9

    def run(m, end_after):
        return run_mixed_chunk(*args, start(budget, 200), jnp.int32(min(3, m)), pieces,
                               jnp.int32(m), jnp.int32(end_after), rd=rd)[1]
    r = next(m for m in range(1, 12) if bool(run(m, 0).done[1]))
    if kind == "plain":
        assert r == budget
    if r > 3:
        o = run(12, r)
        assert int(o.steps) == r and int(o.n_out[1]) == budget
        o = run(12, r - 1)
        assert int(o.steps) == 12 and not bool(o.done[2])


def test_piece_cost_fits_a_fixed_and_a_per_key_part():
    """`PieceCost` recovers a piece's fixed time and its time per attended key from chunks of
    several pieces at random offsets (noiseless: exact); pieces all at one offset are predicted
    right there; a time that falls with the offset gives no negative part."""
    from jaxspec.serving import PieceCost

    rng = np.random.default_rng()
    fixed, per_key = rng.uniform(1e-3, 1e-2), rng.uniform(1e-8, 1e-6)
    cost = PieceCost()
    assert cost.predict(100.0) is None
    for _ in range(12):
        keys = rng.uniform(0, 32768, size=int(rng.integers(1, 9)))
        cost.observe(keys, len(keys) * fixed + per_key * keys.sum())
    for k in rng.uniform(0, 65536, size=5):
        assert cost.predict(k) == pytest.approx(fixed + per_key * k, rel=1e-6)
    one = PieceCost()
    k0 = float(rng.uniform(1000, 30000))
    for m in rng.integers(1, 9, size=4):
        one.observe([k0] * int(m), int(m) * (fixed + per_key * k0))
    assert one.predict(k0) == pytest.approx(fixed + per_key * k0, rel=1e-6)
    # (which part it is cannot be told from one offset: a fixed time, the same anywhere)
    assert one.predict(3 * k0) == pytest.approx(one.predict(k0), rel=1e-9)
    for k in rng.uniform(100, 32768, size=20):  # one chunk seen: the same
        single = PieceCost()
        single.observe([k], float(rng.uniform(1e-3, 5e-2)))
        assert single.predict(5 * k) == pytest.approx(single.predict(k), rel=1e-9)
    falls = PieceCost()
    for k in (1000.0, 20000.0, 1000.0, 20000.0):
        falls.observe([k], 0.02 - k * 1e-6)
    assert np.all(falls.coef >= 0) and falls.predict(1e6) > 0


def test_piece_cost_budgets_for_its_tail():
    """`PieceCost.predict` is the fit scaled by the `TAIL` quantile of the last `TAIL_WINDOW`
    chunks' measured / fitted times (1 before `TAIL_MIN` chunks, never below 1): over chunks
    that scatter around their mean, at most about 1 - `TAIL` of them take longer than predicted,
    where the mean alone is exceeded by about half."""
    from jaxspec.serving import PieceCost

    rng = np.random.default_rng()
    fixed, per_key = rng.uniform(5e-3, 2e-2), rng.uniform(1e-7, 1e-6)
    cost = PieceCost()
    seen, over_mean, over_pred = [], 0, 0
    for i in range(200):
        keys = rng.uniform(0, 30000, size=int(rng.integers(1, 4)))
        t = (len(keys) * fixed + per_key * keys.sum()) * rng.lognormal(0.0, 0.4)
        if i >= 64:  # (once the window holds this spread)
            over_mean += t > sum(cost.mean(k) for k in keys)
            over_pred += t > sum(cost.predict(k) for k in keys)
        cost.observe(keys, t)
        seen.append((keys, t))
        if i + 1 < PieceCost.TAIL_MIN:
            assert cost.margin == 1.0 and cost.predict(1e4) == cost.mean(1e4)
        else:
            last = seen[-PieceCost.TAIL_WINDOW:]
            ratios = [t / (len(k) * cost.coef[0] + cost.coef[1] * k.sum() / PieceCost.KEYS)
                      for k, t in last]
            want = min(max(np.quantile(ratios, PieceCost.TAIL), 1.0), PieceCost.TAIL_MAX)
            assert cost.margin == pytest.approx(want, rel=1e-9)
            assert cost.predict(1e4) == pytest.approx(cost.mean(1e4) * want, rel=1e-9)
    n = 200 - 64
    assert over_mean > 0.3 * n and over_pred < 0.2 * n, (over_mean, over_pred)
    exact = PieceCost()  # chunks that take what the fit says: no margin
    for _ in range(40):
        k = rng.uniform(0, 30000, size=int(rng.integers(1, 4)))
        exact.observe(k, len(k) * fixed + per_key * k.sum())
    assert exact.margin == pytest.approx(1.0, abs=1e-9)


def test_pieces_fill_the_chunks_share():
    """A mixed chunk takes its pieces in order (oldest sequence first, each prompt from where it
    is filled) while their predicted times fit the budget: at least one, at most
    `MIXED_ROUNDS`, and one while no piece was measured."""
    import types

    from jaxspec.serving import MIXED_ROUNDS

    e = ServingEngine(served_model(eos=False), max_batch=2, max_len=96, rounds_per_chunk=16,
                      page_size=8, mixed_prefill=8)
    rng = np.random.default_rng()
    seqs = [types.SimpleNamespace(fill=list(range(int(n))), filled=int(f))
            for n, f in zip(rng.integers(20, 60, size=3), rng.integers(0, 12, size=3))]
    e._filling = lambda: seqs
    e._late_hits = lambda s: None
    every = [(s, p) for s in seqs for p in range(s.filled, len(s.fill), 8)]
    out, spent = e._pieces(1e9)
    assert len(out) == 1 and spent is None and out[0][:2] == every[0]
    for _ in range(20):
        e._piece_cost.coef = np.array([rng.uniform(0, 1), rng.uniform(0, 1)])
        budget = float(rng.uniform(0, 8))
        out, spent = e._pieces(budget)
        costs = [e._piece_cost.predict(p + len(s.fill[p:p + 8]) / 2) for s, p in every]
        k = 1
        while k < min(MIXED_ROUNDS, len(every)) and sum(costs[:k + 1]) <= budget:
            k += 1
        assert [(s, p) for s, p, _ in out] == every[:k]
        assert all(t == s.fill[p:p + 8] for s, p, t in out)
        assert spent == pytest.approx(sum(costs[:k]))


def _late_pair(short, long_, tokens: int):
    return (Sequence(short, SamplingOptions(max_tokens=tokens, temperature=0.0)),
            Sequence(long_, SamplingOptions(max_tokens=5, temperature=0.0)))


def _serve_a_late_prompt(e, model, short, long_, tokens: int, pair=None):
    """Starts ``e``, submits ``short`` (a greedy stream of ``tokens``) and, once it streams,
    ``long_`` (5 tokens), then stops ``e`` and checks both sequences' tokens against
    `generate`'s. ``pair``: the two sequences (`_late_pair`), the late one submitted by the
    caller (from a spy on the device thread), not here."""
    first, late = pair or _late_pair(short, long_, tokens)
    e.start(variants=[(True, False)])
    try:
        e.submit([first])
        while pair is None and not first.tokens:
            assert not first.finished.is_set()
            first.finished.wait(0.01)
        if pair is None:
            e.submit([late])
        assert first.finished.wait(600) and late.finished.wait(600)
    finally:
        e.stop()
    for p, s, n in ((short, first, tokens), (long_, late, 5)):
        assert s.tokens == list(jaxspec.generate(model, [p], max_new_tokens=n).tokens[0])


def test_streams_keep_a_chunk_of_tokens_while_a_prompt_fills():
    """A stream decodes while a long prompt fills in pieces: the mixed chunks go on with plain
    rounds after their pieces (the stream gets a chunk's tokens, not one per piece), and both
    sequences' tokens equal `generate`'s."""
    model = served_model(eos=False)
    rng = np.random.default_rng()
    short, long_ = (rng.integers(5, 60, size=int(n)).tolist() for n in (6, 70))
    e = ServingEngine(model, max_batch=2, max_len=320, rounds_per_chunk=8, page_size=8,
                      prefill_chunk=8, mixed_prefill=8, fill_first=0)
    e.chunk_seconds = 1e9
    seen = []
    real = e.decoder.call_chunk

    def spy(program, sp, state, max_rounds, pieces=None, end_after=0, num_pieces=0):
        st, outs = real(program, sp, state, max_rounds, pieces, end_after, num_pieces)
        seen.append((num_pieces, int(max_rounds), int(outs.steps)))
        return st, outs
    e.decoder.call_chunk = spy
    # (a long budget: the stream still decodes however late the other prompt comes in)
    _serve_a_late_prompt(e, model, short, long_, 200)
    mixed = [(k, m, steps) for k, m, steps in seen if k > 0]
    assert mixed, seen
    assert all(steps <= m and k <= m for k, m, steps in mixed)
    assert any(steps > k for k, m, steps in mixed), mixed  # plain rounds after the pieces


def test_piece_cost_is_learned_from_whole_mixed_chunks():
    """What pieces add beyond their rounds' predicted time is learned from mixed chunks that ran
    all their rounds (by the pieces' attended keys), not from a program's first run, a chunk
    over all the slots while its compact program compiled, or a chunk that ended early."""
    import concurrent.futures
    import types

    from jaxspec.decoding import ChunkOutputs, RoundStats

    e = ServingEngine(served_model(eos=False), max_batch=2, max_len=96, rounds_per_chunk=8,
                      page_size=8, mixed_prefill=8)
    rng = np.random.default_rng()
    t = float(rng.uniform(1e-3, 1e-2))
    e._round_seconds = lambda rd, ctx: t
    e.decoder.costs = types.SimpleNamespace(fits=True)
    rd = e._round(True)
    B = e.B

    def chunk(n, dt, first=False, full=False):
        outs = ChunkOutputs(out=np.zeros((B, 8), np.int32), from_draft=np.zeros((B, 8), bool),
                            n_out=np.zeros(B, np.int32), done=np.ones(B, bool),
                            lengths=np.zeros(B, np.int32), steps=np.int32(n),
                            stats=jax.tree.map(np.asarray, RoundStats.zeros(B)))
        f = concurrent.futures.Future()
        f.set_result((None, outs, 0.0, dt, None, None))
        f.first_run = first
        f.full_for_now = full  # (over all the slots while its compact program compiled)
        return f

    owners = [None] * B
    e._process(chunk(8, 100.0, first=True), owners, rd, None, 8, (4.0, 12.0))  # a first run
    e._process(chunk(8, 100.0, full=True), owners, rd, None, 8, (4.0, 12.0))  # full for now
    e._process(chunk(5, 100.0), owners, rd, None, 8, (4.0, 12.0))  # ended early: not learned
    e._process(chunk(8, 0.97 * 8 * t), owners, rd, None, 8, (4.0,))  # within the noise, but
    assert e._piece_cost.coef is None  # nothing learned yet: not a first zero
    fixed, per_key = rng.uniform(1e-3, 1e-2), rng.uniform(1e-7, 1e-5)
    for _ in range(8):
        keys = tuple(rng.uniform(0, 30000, size=int(rng.integers(1, 4))))
        e._process(chunk(8, 8 * t + len(keys) * fixed + per_key * sum(keys)), owners, rd, None,
                   8, keys)
    assert e._piece_cost.mean(2500.0) == pytest.approx(fixed + per_key * 2500, rel=1e-6)
    e._process(chunk(8, 0.5 * t), owners, rd, None, 8, (10.0,))  # faster than its rounds alone:
    assert e._piece_cost.mean(2500.0) == pytest.approx(fixed + per_key * 2500, rel=1e-6)
    before = e._piece_cost.mean(2500.0)
    e._process(chunk(8, 0.97 * 8 * t), owners, rd, None, 8, (2500.0,))  # within the noise: 0
    assert e._piece_cost.mean(2500.0) < before * (1 - 1e-6)


@pytest.mark.parametrize("stretch", ["default", "given", "capped"])
def test_a_costly_piece_gets_a_longer_chunk(stretch):
    """A mixed chunk whose one piece is predicted to add more than `PIECE_SHARE` of its rounds'
    time runs more plain rounds (beyond ``rounds_per_chunk``, up to ``mixed_stretch`` times it:
    `MIXED_STRETCH` by default), so that the piece's share of the chunk stays within it; a piece
    that would need more runs in a chunk of that many rounds; every stream's tokens still equal
    `generate`'s."""
    from jaxspec.serving import MIXED_STRETCH, PIECE_SHARE

    model = served_model(eos=False)
    rng = np.random.default_rng()
    short, long_ = (rng.integers(5, 60, size=int(n)).tolist() for n in (6, 70))
    # (other than the default; at most 6: the prompt's 9 pieces in chunks of up to 4 k rounds
    # fit in the stream's budget)
    k = MIXED_STRETCH if stretch == "default" else int(rng.choice(
        [x for x in range(2, 7) if x != MIXED_STRETCH]))
    e = ServingEngine(model, max_batch=2, max_len=320, rounds_per_chunk=4, page_size=8,
                      prefill_chunk=8, mixed_prefill=8, fill_first=0,
                      mixed_stretch=None if stretch == "default" else k)
    assert e.mixed_stretch == k and e.max_chunk_rounds == 4 * k
    # (seconds per piece, against rounds of one second: more than a chunk's share, and more
    # than rounds_per_chunk rounds would take; "capped": more than the longest chunk's share)
    fixed = float(rng.uniform(4 * PIECE_SHARE + 0.1, k * 4 * PIECE_SHARE - 0.1)
                  if stretch != "capped" else rng.uniform(k * 4 * PIECE_SHARE + 0.1,
                                                          3 * k * 4 * PIECE_SHARE))
    e._round_seconds = lambda rd, ctx: 1.0
    e.chunk_seconds = 2.0  # two rounds a chunk
    e._piece_cost.coef = np.array([fixed, 0.0])
    e._piece_cost.observe = lambda keys, seconds: None
    seen = []
    real = e.decoder.call_chunk

    keys, processed = [], []

    def spy(program, sp, state, max_rounds, pieces=None, end_after=0, num_pieces=0):
        seen.append((num_pieces, int(max_rounds)))
        if num_pieces:
            starts, ends = (np.asarray(x)[:num_pieces] for x in (pieces.starts, pieces.ends))
            keys.append(tuple(starts + (ends - starts) / 2))
        return real(program, sp, state, max_rounds, pieces, end_after, num_pieces)
    e.decoder.call_chunk = spy
    real_process = e._process

    def process(*args):  # (the pieces' attended keys each chunk reports to the piece cost)
        if len(args) > 5 and len(args[5]):
            processed.append(tuple(args[5]))
        return real_process(*args)
    e._process = process
    grows = []  # (the rounds asked of the pool, and the unstretched ones it may fall back to)
    real_grow = e._grow

    def grow(active, rounds, rd, unstretched=None):
        grows.append((rounds, unstretched))
        return real_grow(active, rounds, rd, unstretched)
    e._grow = grow
    _serve_a_late_prompt(e, model, short, long_, 300)
    mixed = [(k, m) for k, m in seen if k > 0]
    assert mixed, seen
    want = min(int(np.ceil(fixed / PIECE_SHARE)), 4 * k)
    assert all(n == 1 and m == want for n, m in mixed), (want, mixed)
    assert processed == [pytest.approx(k) for k in keys]
    assert (want, 2) in grows and all(u in (None, 2) for _, u in grows), grows


def test_a_stream_ends_in_a_chunk_without_pieces():
    """While a prompt fills in costly pieces (each stretching its chunk to more rounds), a stream
    whose token budget ends sooner ends in a plain chunk that runs up to its end: the piece goes
    in the chunk after it, and no mixed chunk is cut short by that end (its piece's time would
    fall on those few rounds' tokens). Both sequences' tokens equal `generate`'s."""
    from jaxspec.serving import PIECE_SHARE

    model = served_model(eos=False)
    rng = np.random.default_rng()
    short, long_ = (rng.integers(5, 60, size=int(n)).tolist() for n in (6, 70))
    e = ServingEngine(model, max_batch=2, max_len=320, rounds_per_chunk=4, page_size=8,
                      prefill_chunk=8, mixed_prefill=8, fill_first=0)
    want = int(rng.integers(4, 9))  # the rounds a mixed chunk stretches to for its one piece
    e._round_seconds = lambda rd, ctx: 1.0
    e.chunk_seconds = 2.0
    e._piece_cost.coef = np.array([PIECE_SHARE * want - 0.01, 0.0])
    e._piece_cost.observe = lambda keys, seconds: None
    chunks = []
    real = e.decoder.call_chunk
    # the stream's budget ends while the 9 pieces fill (each ~want rounds), at least a mixed
    # chunk after the other prompt comes in: it comes with the stream's first chunk (from
    # this device thread, so however slow the host, the stream has the same rounds left)
    tokens = int(rng.integers(want + 8, 9 * want))
    first, late = _late_pair(short, long_, tokens)
    submitted = []

    def spy(program, sp, state, max_rounds, pieces=None, end_after=0, num_pieces=0):
        before = np.asarray(state.done)
        if int(max_rounds) > 0 and np.any(~before) and not submitted:
            submitted.append(True)
            e.submit([late])
        st, outs = real(program, sp, state, max_rounds, pieces, end_after, num_pieces)
        done = np.asarray(outs.done)
        ended = np.flatnonzero(done & ~before[:len(done)])
        chunks.append((num_pieces, int(max_rounds), int(outs.steps), ended.tolist(),
                       bool(np.any(~before[:len(done)]))))
        return st, outs
    e.decoder.call_chunk = spy
    _serve_a_late_prompt(e, model, short, long_, tokens, pair=(first, late))
    # mixed chunks over a decoding row (not those dispatched after its end, before the host
    # saw it) carry one piece and run all their rounds: none is cut short by the stream's end
    mixed = [c for c in chunks if c[0] > 0 and c[4]]
    assert mixed and all(k == 1 and m == want and n == m for k, m, n, _, _ in mixed), chunks
    ends = [c for c in chunks if c[3]]
    assert ends and (ends[0][0] == 0 or ends[0][2] == want), chunks  # (the stream's end)
    assert e.metrics()["pieces_deferred"] >= (ends[0][0] == 0 and ends[0][2] < ends[0][1])


def test_warmup_runs_the_mixed_program_once():
    """Warm-up runs each mixed chunk program once, with no piece and no round (a program's first
    run loads its kernels on a GPU), and counts it as run (a later chunk's time is learned)."""
    e = ServingEngine(served_model(eos=False), max_batch=2, max_len=96, page_size=8,
                      mixed_prefill=8)
    calls = []
    real = e.decoder.call_chunk

    def spy(program, sp, state, max_rounds, pieces=None, *more):
        calls.append((program, pieces is not None, int(max_rounds)))
        return real(program, sp, state, max_rounds, pieces, *more)
    e.decoder.call_chunk = spy
    e.start(variants=[(True, False)])
    e.stop()
    mixed = [(p, r) for p, m, r in calls if m]
    assert mixed and all(r == 0 for _, r in mixed)
    assert all(id(p) in e._programs_run for p, _ in mixed)


@pytest.mark.parametrize("kind", ["plain", "self"])
def test_mixed_chunks_run_over_their_rows_alone(kind):
    """While few slots decode, a mixed chunk runs over the decoding rows and its pieces' rows
    alone (a compact batch, its pieces' rows renumbered): a stream keeps `generate`'s tokens and
    a prompt that fills in those chunks gets `generate`'s, with plain rounds and speculative
    ones; the compact mixed programs compile in the background (the full batch runs meanwhile)."""
    model = served_model(eos=False)
    spec = None if kind == "plain" else jaxspec.Speculation(draft="self", gamma=2, sink=2,
                                                            window=6, adaptive=False)
    rng = np.random.default_rng()
    e = ServingEngine(model, max_batch=8, max_len=320, rounds_per_chunk=4, page_size=8,
                      prefill_chunk=8, mixed_prefill=8, fill_first=0, compact_rows=True,
                      speculation=spec, share_min_tokens=None)
    e.chunk_seconds = 1e9
    seen = []  # (pieces, the chunk's rows, the pieces' rows in that batch)
    real = e.decoder.call_chunk

    def spy(program, sp, state, max_rounds, pieces=None, end_after=0, num_pieces=0):
        at = [] if pieces is None else np.asarray(pieces.rows)[:num_pieces].tolist()
        seen.append((num_pieces, int(state.last.shape[0]), at))
        return real(program, sp, state, max_rounds, pieces, end_after, num_pieces)
    e.decoder.call_chunk = spy
    e.start(variants=[(True, False)])
    try:
        for _ in range(2):  # the first time, the compact mixed programs compile meanwhile
            short, long_ = (rng.integers(5, 60, size=int(n)).tolist() for n in (6, 60))
            # (a long budget: the stream still decodes however late the prompt comes in)
            first = Sequence(short, SamplingOptions(max_tokens=200, temperature=0.0))
            late = Sequence(long_, SamplingOptions(max_tokens=5, temperature=0.0))
            # two one-token requests take the first slots and leave them: the stream decodes
            # in slot 2 and the prompt fills in slot 0, so a compact batch renumbers its rows
            once = [Sequence(short[:3], SamplingOptions(max_tokens=1, temperature=0.0))
                    for _ in range(2)]
            e.submit(once + [first])
            while not first.tokens or not all(s.finished.is_set() for s in once):
                assert not first.finished.wait(0.01)
            assert first.slot == 2
            e.submit([late])
            assert first.finished.wait(600) and late.finished.wait(600)
            for p, s, n in ((short, first, 200), (long_, late, 5)):
                assert s.error is None, s.error
                assert s.tokens == list(jaxspec.generate(model, [p], max_new_tokens=n,
                                                         speculation=spec).tokens[0])
            assert any(k > 0 for k, _, _ in seen), seen  # (mixed chunks ran)
            deadline = time.time() + 300
            while e.metrics()["programs_compiling"] and time.time() < deadline:
                time.sleep(0.05)
            assert not e.metrics()["programs_compiling"]
    finally:
        e.stop()
    mixed = [(k, b, at) for k, b, at in seen if k > 0]
    small = [(k, b, at) for k, b, at in mixed if b < e.B]
    assert small, mixed  # (2 rows: the stream's and the prompt's)
    assert all(b == 2 and set(at) == {1} for _, b, at in small), small  # (rows [2, 0])
