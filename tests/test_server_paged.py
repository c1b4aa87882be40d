"""The serving engine's paged mode (`ServingEngine(page_size=...)`): block tables over one pool,
automatic prefix caching, chunked prefill between decode chunks and preemption when blocks run
out. Every greedy completion must equal `jaxspec.generate` of the same prompt (float32), whatever
was shared, preempted or recomputed, and every block must be back in the pool afterwards."""

import random
import time
from types import SimpleNamespace

import numpy as np
import pytest

import jaxspec
from jaxspec.blocks import BlockManager
from jaxspec.serving import SamplingOptions, Sequence, ServingEngine
from serverkit import served_model
from tiny import tiny_model


def _wait(seqs, timeout=600):
    for s in seqs:
        assert s.finished.wait(timeout), "a sequence did not finish"
        assert s.error is None, s.error


def _serve_together(e, seqs, before_chunk) -> dict:
    """Starts ``e`` with ``before_chunk`` as its step hook, submits ``seqs`` together, waits for
    all of them to end (failed or not) and stops it; returns its metrics."""
    e.step_fault_hook = before_chunk
    e.start(variants=[(True, False)])
    try:
        e.pause_admission()
        e.submit(seqs)
        e.resume_admission()
        assert all(s.finished.wait(600) for s in seqs)
        return e.metrics()
    finally:
        e.stop()


@pytest.fixture(scope="module")
def model():
    return served_model(eos=False)


@pytest.mark.parametrize("spec,mixed", [(None, 0), ("self", 0), (None, 8), ("self", 16),
                                        ("ring", 8)])
def test_paged_engine_equals_generate(model, spec, mixed):
    rng = np.random.default_rng(random.randrange(1 << 30))
    shared = rng.integers(5, 60, size=27).tolist()  # three full blocks of 8 and a bit
    prompts = [shared + rng.integers(5, 60, size=int(n)).tolist() for n in (3, 11)]
    prompts += [rng.integers(5, 60, size=int(n)).tolist() for n in (9, 20)]
    new = 40  # three sequences of up to ~70 tokens need 27 blocks; the pool has 16
    ref = jaxspec.generate(model, prompts, max_new_tokens=new).tokens
    speculation = None if spec is None else jaxspec.Speculation(
        draft="self", gamma=3, sink=2, window=6, adaptive=False)
    if spec == "ring":  # a draft model with a ring-buffer cache, prefilled once a prompt is in
        speculation = jaxspec.Speculation(draft=tiny_model(seed=7, scale=3.0), gamma=3, window=16,
                                          adaptive=False)
    # (with mixed pieces, prompts admitted together start as they are in, so that the later
    # ones fill inside the first ones' rounds; without, they fill first: `fill_first`)
    kw = dict(max_batch=3, max_len=96, rounds_per_chunk=2, prefill_chunk=16, page_size=8,
              speculation=speculation, prefill_budget=16, mixed_prefill=mixed,
              fill_first=0.0 if mixed else None)
    one = ServingEngine(model, **kw).max_blocks  # the blocks one sequence of max_len needs
    # a pool short of three full sequences: admissions wait for blocks and running ones are
    # preempted, then resumed from their prompt and tokens (admission reserving room for the
    # next two chunks only: with the budgets' growth reserved, nothing would be preempted)
    e = ServingEngine(model, kv_blocks=one + 3, growth_reserve=0, **kw).start(
        variants=[(True, False)])  # greedy requests only: the greedy chunks compiled
    try:
        opts = SamplingOptions(max_tokens=new, temperature=0)
        seqs = [Sequence(p, opts) for p in prompts]
        e.submit(seqs)
        _wait(seqs)
        for s, r in zip(seqs, ref):
            assert s.tokens == r, (s.prompt_ids[:5], s.preemptions)
        m = e.metrics()
        assert m["preemptions"] > 0, "the small pool should have forced a preemption"
        # with mixed_prefill, prompts filled inside decode rounds (else never)
        assert (m["mixed_prefill_tokens"] > 0) == (mixed > 0)
        assert m["prompt_tokens"] == sum(map(len, prompts))
        # one after the other on the idle engine: the second finds at least the first's three
        # full blocks of the shared prefix in the cache (whole blocks only; its own fourth one
        # may still be cached from before) and prefills the rest
        for i in (0, 1):
            s = Sequence(prompts[i], opts)
            e.submit([s])
            _wait([s])
            assert s.tokens == ref[i]
        assert s.usage()["prompt_tokens_details"]["cached_tokens"] in (24, 32)
        # admitted together: the later one waits for the earlier one's prefill (oldest first,
        # 16 tokens per step) and then takes its three full blocks of the shared prefix
        e.pause_admission()
        fresh = [int(t) for t in rng.integers(5, 60, size=27)]  # nothing of it cached
        pair = [Sequence(fresh + [7, 8], opts), Sequence(fresh + [9, 10, 11, 12, 13, 14], opts)]
        e.submit(pair)
        e.resume_admission()
        _wait(pair)
        want = jaxspec.generate(model, [x.prompt_ids for x in pair], max_new_tokens=new).tokens
        assert [x.tokens for x in pair] == want
        assert [x.usage()["prompt_tokens_details"]["cached_tokens"] for x in pair] == [0, 24]
        m = e.metrics()
        assert m["kv_blocks_used"] == 0 and m["kv_blocks_free"] == m["kv_blocks_total"]
        assert all(x is None for x in e.slots)
        assert m["prefix_cache_hit_rate"] > 0
    finally:
        e.stop()


def test_admission_reserves_the_budgets_growth(model):
    """The workload of the test above (a pool short of three full sequences), with admission
    keeping room for each admitted sequence's whole budget (the default `growth_reserve`,
    more than these budgets): later requests wait for blocks instead, nothing is preempted, and
    the tokens are `generate`'s."""
    rng = np.random.default_rng(random.randrange(1 << 30))
    prompts = [rng.integers(5, 60, size=int(n)).tolist() for n in (30, 38, 9, 20)]
    new = 40
    ref = jaxspec.generate(model, prompts, max_new_tokens=new).tokens
    kw = dict(max_batch=3, max_len=96, rounds_per_chunk=2, prefill_chunk=16, page_size=8,
              prefill_budget=16)
    one = ServingEngine(model, **kw).max_blocks
    e = ServingEngine(model, kv_blocks=one + 3, **kw)
    assert e.growth_reserve >= new
    e.start(variants=[(True, False)])
    try:
        seqs = [Sequence(p, SamplingOptions(max_tokens=new, temperature=0)) for p in prompts]
        e.submit(seqs)
        _wait(seqs)
        assert [s.tokens for s in seqs] == ref
        m = e.metrics()
        assert m["preemptions"] == 0, m
        assert e.running_peak < e.B, e.running_peak  # (some waited for blocks, slots free)
        assert m["kv_blocks_used"] == 0, m
    finally:
        e.stop()


def test_a_slot_taken_over_does_not_write_into_the_new_tables(model):
    """A request ended on the host by a stop string while its row still decodes on the device
    hands its slot to a waiting request whose prompt is all cached, while another prompt fills
    in pieces inside a third request's rounds (so the new one starts only after the next chunk
    is dispatched): the ended row must stay stopped until the new one starts, or that chunk
    decodes it at its old length through the new block table, writing K/V into the cached blocks
    the prompt shares (the new request and a later one with the same prompt then differ from
    `generate`)."""
    rng = np.random.default_rng(random.randrange(1 << 30))
    tok = model.tokenizer
    cached = rng.integers(5, 60, size=41).tolist()  # its cache: five full blocks of 8
    other = rng.integers(5, 60, size=6).tolist()
    filler = rng.integers(5, 60, size=100).tolist()
    new = 16
    ref = jaxspec.generate(model, [cached], max_new_tokens=new).tokens[0]
    for _ in range(50):  # a prompt whose greedy text has a word first at token 3-6: the stop
        short = rng.integers(5, 60, size=4).tolist()
        out = jaxspec.generate(model, [short], max_new_tokens=8).tokens[0]
        words = [tok.decode([t], skip_special_tokens=True) for t in out]  # (as the engine)

        def text(ids):
            return tok.decode(ids, skip_special_tokens=True)
        at = [i for i in range(3, 7) if words[i].strip() and
              words[i] not in text(out[:i]) and words[i] not in text(out[i + 1:])]
        if at:
            stop = words[at[0]]
            break
    else:
        pytest.skip("no prompt with a usable stop word")
    e = ServingEngine(model, max_batch=3, max_len=120, rounds_per_chunk=8, prefill_chunk=16,
                      page_size=8, prefill_budget=16, mixed_prefill=4, fill_first=0.0,
                      growth_reserve=0, compact_rows=False)
    e.start(variants=[(True, False)])
    try:
        first = Sequence(cached, SamplingOptions(max_tokens=1, temperature=0))
        e.submit([first])
        _wait([first])  # its blocks are cached now
        ids = e.blocks.lookup(cached[:-1], e.blocks.keys(cached[:-1]))
        assert len(ids) == 5

        def kv():  # (read while the engine idles)
            c = e.state.cache
            return np.asarray(c.k[:, ids]), np.asarray(c.v[:, ids])
        before = kv()
        keeps = Sequence(other, SamplingOptions(max_tokens=100, temperature=0))
        gone = Sequence(short, SamplingOptions(max_tokens=100, temperature=0, stop=(stop,)))
        fills = Sequence(filler, SamplingOptions(max_tokens=4, temperature=0))
        taker = Sequence(cached, SamplingOptions(max_tokens=new, temperature=0))
        e.pause_admission()
        e.submit([keeps, gone, fills, taker])  # the taker waits for the slot the stop frees
        e.resume_admission()
        _wait([gone, taker, fills])
        assert gone.finish_reason == "stop" and taker.cached_tokens == 40
        e.cancel(keeps)
        _wait([keeps])
        for a, b in zip(before, kv()):  # nothing wrote into the cached blocks
            np.testing.assert_array_equal(a, b)
        assert fills.tokens == jaxspec.generate(model, [filler], max_new_tokens=4).tokens[0]
        assert taker.tokens == ref
        again = Sequence(cached, SamplingOptions(max_tokens=new, temperature=0))
        e.submit([again])
        _wait([again])
        assert again.tokens == ref
    finally:
        e.stop()


@pytest.mark.parametrize("reserve", [0, 16, 512])
def test_the_growth_reserve_covers_what_chunks_map(model, reserve):
    """What admission keeps for a sequence (`_growth_blocks`) covers what the engine maps for it
    later (`_grow`: the chunk in flight and the next, each round a token tree's nodes, past its
    length), at any point of its budget: a token tree writes more slots per round than the
    tokens it commits."""
    spec = jaxspec.Speculation(draft="self", tree=(2, 2, 1), sink=2, window=6, adaptive=False)
    e = ServingEngine(model, max_batch=2, max_len=96, rounds_per_chunk=4, page_size=8,
                      speculation=spec, growth_reserve=reserve)
    nodes = e.tree.num_nodes
    assert nodes > e.tree.max_depth + 1
    s = Sequence(list(range(5, 25)), SamplingOptions(max_tokens=30))
    s.budget = 30
    have = -(-(19 + 1) // 8)  # its prompt's blocks
    reserved = have + e._growth_blocks(s, 19, have)
    for made in range(0, 31, 3):  # the sequence advances within its budget
        s.tokens = [7] * made
        length = 19 + made
        want = min(-(-(length + 2 * e.rounds * nodes + e.extra + 1) // 8), e.max_blocks)
        assert want <= reserved or made > reserve, (made, want, reserved)


def test_a_growing_row_takes_its_reserve_at_once(model):
    """A decoding row that needs blocks takes at once what admission keeps for its growth
    (`growth_reserve` tokens and two chunks), so its block table is written about once per that
    many tokens instead of once per block (each write waits for the running chunk); the tokens
    are `generate`'s and every block comes back."""
    rng = np.random.default_rng(random.randrange(1 << 30))
    reserve, new = int(rng.integers(16, 33)), 120
    prompt = rng.integers(5, 60, size=int(rng.integers(6, 14))).tolist()
    e = ServingEngine(model, max_batch=2, max_len=160, rounds_per_chunk=2, prefill_chunk=16,
                      page_size=4, growth_reserve=reserve, mixed_prefill=0)
    writes = []
    real = e._tables

    def tables(rows):
        writes.append({b: len(v) for b, v in rows.items()})
        return real(rows)
    e._tables = tables
    e.start(variants=[(True, False)])
    try:
        writes.clear()  # (warm-up's)
        seq = Sequence(prompt, SamplingOptions(max_tokens=new, temperature=0))
        e.submit([seq])
        _wait([seq])
        assert seq.tokens == list(jaxspec.generate(model, [prompt], max_new_tokens=new)
                                  .tokens[0])
        grows = [w for w in writes if any(n > 0 for n in w.values())]
        # (admission's write, then one per reserve's worth of tokens; once per block of 4 would
        # be about 30)
        assert len(grows) <= 2 + -(-new // reserve), writes
        assert e.metrics()["kv_blocks_used"] == 0
    finally:
        e.stop()


def _two_running_rows(model, **kw):
    """An engine (not started) with two decoding rows: row 0 at 23 tokens whose next block is
    due, row 1 at 28, each holding its cache's blocks."""
    e = ServingEngine(model, max_batch=2, max_len=200, rounds_per_chunk=2, page_size=4,
                      growth_reserve=16, **kw)
    seqs = []
    for b, L in ((0, 23), (1, 28)):
        s = Sequence(list(range(5, 5 + L)), SamplingOptions(max_tokens=100))
        s.budget, s.slot, s.t_submit = 100, b, float(b)
        s.blocks = e.blocks.allocate(-(-(L + 1) // 4))
        e.slots[b], e.lengths[b], e.done[b] = s, L, False
        e._started.add(b)
        seqs.append(s)
    return e, seqs


def test_a_growing_row_leaves_the_other_rows_room(model):
    """A growing row takes its growth room at once only while the pool holds every slot's
    (`_growth_reserve`); short of that, only the blocks the next chunk needs."""
    e, (s0, s1) = _two_running_rows(model, mixed_prefill=0)
    rd = e._round(True)
    reserve = e._growth_reserve()
    hog = e.blocks.allocate(e.blocks.free - (reserve - 1))  # one block short of every room
    assert e._grow([0, 1], 2, rd) == 2
    assert len(s0.blocks) == 7 and e.m["preemptions"] == 0  # (the next chunk's: one block)
    e.blocks.release(hog)
    e.lengths[0] = 27  # its next block due again, and the pool holds every room now
    room = e._growth_blocks(s0, 27, len(s0.blocks))
    assert room > 1
    assert e._grow([0, 1], 2, rd) == 2
    assert len(s0.blocks) == 7 + room


def test_a_stretched_chunk_the_pool_cannot_map_runs_unstretched(model):
    """A mixed chunk stretched for a costly piece (`MIXED_STRETCH`) that the free blocks cannot
    map runs its unstretched rounds instead of preempting a sequence."""
    e, (s0, s1) = _two_running_rows(model, mixed_prefill=4)
    assert e.max_chunk_rounds > e.rounds
    rd = e._round(True)
    e.blocks.allocate(e.blocks.free - 1)  # one free block: the 2 rounds' need, not the 8's
    assert e._grow([0, 1], 8, rd, 2) == 2
    assert e.m["preemptions"] == 0 and e.slots[1] is s1
    assert e._grow([0, 1], 8, rd) == 0  # (without the fallback: the latest one preempted)
    assert e.m["preemptions"] == 1 and e.slots[1] is None


def test_growth_maps_what_the_chunk_in_flight_may_write(model):
    """A plain chunk dispatched while a speculative one is in flight (adaptive chunks switch
    kinds): the row's table must cover what the speculative chunk may advance (its rounds x
    gamma + 1) and then the plain rounds, or the K/V of the positions past the mapped blocks is
    dropped and later read from blocks that are not the row's."""
    spec = jaxspec.Speculation(draft="self", gamma=3, sink=2, window=6, adaptive=False)
    e = ServingEngine(model, max_batch=2, max_len=400, rounds_per_chunk=16, page_size=16,
                      speculation=spec)
    spec_rd = e._round(True)
    assert spec_rd.speculative and spec_rd.tree.num_nodes == 4
    s = Sequence(list(range(5, 105)), SamplingOptions(max_tokens=200))
    s.budget, L, flight = 200, 180, 10
    s.blocks, s.slot = e.blocks.allocate(-(-(L + 1) // 16)), 0
    e.slots[0], e.lengths[0] = s, L
    e._inflight.append((None, None, spec_rd, None, flight, False))  # (chunk, owners, rd, ...)
    try:
        rounds = e._grow([0], 16, spec_rd.plain())
    finally:
        e._inflight.clear()
    assert rounds >= 1
    assert len(s.blocks) * 16 >= L + flight * 4 + rounds + e.extra + 1, (len(s.blocks), rounds)


@pytest.mark.parametrize("page_size", [None, 8])
def test_an_engine_starts_again_after_stop(model, page_size):
    """`stop` lets the slots' device state go; a second `start` serves from empty slots, the
    same tokens as before."""
    e = ServingEngine(model, max_batch=2, max_len=64, rounds_per_chunk=2, prefill_chunk=16,
                      page_size=page_size)
    opts = SamplingOptions(max_tokens=5, temperature=0)
    e.start(variants=[(True, False)])
    try:
        first = e.generate([5, 6, 7] * 4, opts, timeout=60).tokens
    finally:
        e.stop()
    e.start(variants=[(True, False)])
    try:
        assert e.generate([5, 6, 7] * 4, opts, timeout=60).tokens == first
        assert e.generate([3, 4] * 5, opts, timeout=60).tokens == list(jaxspec.generate(
            model, [[3, 4] * 5], max_new_tokens=5).tokens[0])
    finally:
        e.stop()


def test_paged_engine_rejects_bad_sizes(model):
    with pytest.raises(ValueError, match="page_size"):
        ServingEngine(model, max_batch=2, max_len=64, page_size=0)
    with pytest.raises(ValueError, match="page_size"):
        ServingEngine(model, max_batch=2, max_len=64, page_size=7.5)
    for blocks in (0, -3):  # (0 is not "the default pool")
        with pytest.raises(ValueError, match="kv_blocks"):
            ServingEngine(model, max_batch=2, max_len=64, page_size=8, kv_blocks=blocks)
    for budget in (0, -16):  # a budget that prefills nothing would leave prompts waiting
        with pytest.raises(ValueError, match="prefill_budget"):
            ServingEngine(model, max_batch=2, max_len=64, page_size=8, prefill_budget=budget)
    for max_len in (0, 1, -5, 8.5, True):
        with pytest.raises(ValueError, match="max_len"):
            ServingEngine(model, max_batch=2, max_len=max_len, page_size=8)
    with pytest.raises(ValueError, match="kv_blocks"):
        ServingEngine(model, max_batch=2, max_len=64, page_size=8, kv_blocks=2)
    with pytest.raises(ValueError, match="mixed_prefill"):
        ServingEngine(model, max_batch=2, max_len=64, page_size=8, mixed_prefill=-1)
    with pytest.raises(ValueError, match="growth_reserve"):
        ServingEngine(model, max_batch=2, max_len=64, page_size=8, growth_reserve=-1)
    for stretch in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="mixed_stretch"):
            ServingEngine(model, max_batch=2, max_len=64, page_size=8, mixed_stretch=stretch)
    with pytest.raises(ValueError, match="more than max_len"):
        ServingEngine(model, max_batch=2, max_len=64, page_size=8, mixed_prefill=128)
    with pytest.raises(ValueError, match="block pool"):
        ServingEngine(model, max_batch=2, max_len=64, mixed_prefill=16)
    assert ServingEngine(model, max_batch=2, max_len=64, page_size=8,
                         prefill_budget=16).mixed_prefill == 0  # a fixed budget between chunks
    assert ServingEngine(model, max_batch=2, max_len=64, page_size=8,
                         prefill_chunk=16).mixed_prefill == 16  # the default: one prefill chunk
    assert ServingEngine(model, max_batch=2, max_len=64, page_size=8,
                         prefill_chunk=128).mixed_prefill == 64  # ... at most max_len


def _burst(model, new, fill_first, slow_prefill=None, late=False):
    """A short and a long prompt submitted together to an idle paged engine (16 prompt tokens
    per prefill step, no pieces); ``slow_prefill``: seconds each prefill call sleeps first;
    ``late``: the long one is submitted only once the short one is admitted (a burst whose
    requests arrive over a while: it is queued, not yet in a slot, when the short one's prompt
    is in). Checks the tokens against `generate` and returns (how many prompts were still filling
    or queued at each decode chunk, the engine's metrics)."""
    rng = np.random.default_rng(random.randrange(1 << 30))
    prompts = [rng.integers(5, 60, size=9).tolist(), rng.integers(5, 60, size=70).tolist()]
    e = ServingEngine(model, max_batch=2, max_len=120, rounds_per_chunk=2, prefill_chunk=16,
                      page_size=8, prefill_budget=16, fill_first=fill_first)
    filling_at_chunks, m, _ = _serve_burst(model, e, prompts, new, slow_prefill, late)
    return filling_at_chunks, m


def _serve_burst(model, e, prompts, new, slow_prefill=None, late=False):
    """``prompts`` submitted together to the idle paged engine ``e`` (not started; whole
    prefill steps between decode chunks), as `_burst` says; returns (how many prompts were still
    filling or queued at each decode chunk, the engine's metrics, the sequences)."""
    ref = jaxspec.generate(model, prompts, max_new_tokens=new).tokens
    assert e.mixed_prefill == 0  # (a fixed budget: whole prefill steps between chunks)
    if slow_prefill:
        real = e.decoder.prefill_paged_row

        def slow(*a, **kw):
            time.sleep(slow_prefill)
            return real(*a, **kw)
        e.decoder.prefill_paged_row = slow
    filling_at_chunks = []
    e.step_fault_hook = lambda active: filling_at_chunks.append(  # (queued ones too)
        sum(s.filled < len(s.fill) for s in e.slots if s is not None) + len(e.waiting))
    e.start(variants=[(True, False)])
    try:
        e.pause_admission()
        seqs = [Sequence(p, SamplingOptions(max_tokens=new, temperature=0)) for p in prompts]
        if late:
            e.fault_hook = lambda s: e.submit(seqs[1:]) if s is seqs[0] else None
        e.submit(seqs[:1] if late else seqs)
        e.resume_admission()
        _wait(seqs)
        assert [s.tokens for s in seqs] == ref
        return filling_at_chunks, e.metrics(), seqs
    finally:
        e.stop()


@pytest.mark.parametrize("late", [False, True], ids=["together", "late"])
@pytest.mark.parametrize("fill_first", [0.0, 600.0])
def test_a_burst_fills_before_any_stream_starts(model, fill_first, late):
    """Prompts submitted together into an idle paged engine (``late``: the long one queued only
    after the short one's admission, as a burst's requests reach a server): with ``fill_first``
    the short one, whose prompt is in after the first prefill step, waits for the long one's
    (16 tokens per step) and no decode chunk runs while a prompt still fills; without it the
    short one decodes while the long one fills (the check can fail). Both ways the tokens are
    `generate`'s."""
    filling_at_chunks, m = _burst(model, 12, fill_first, late=late)
    if fill_first:
        assert filling_at_chunks and not any(filling_at_chunks), filling_at_chunks
        assert m["held_sequences"] == 1, m
    else:
        assert filling_at_chunks[0] == 1, filling_at_chunks
        assert m["held_sequences"] == 0, m


@pytest.mark.parametrize("rate", ["measured", "unknown"])
def test_a_burst_that_cannot_fill_in_time_is_not_held(model, monkeypatch, rate):
    """Prefill made slow (0.1 s per call, so at most 160 tokens/s): the long prompt's 62 tokens
    left cannot fill within ``fill_first`` = 0.25 s. With the prefill rate measured, the short
    one is not held at all; with no rate known, it is held until the deadline and then starts
    while the long one still fills. Both ways the tokens are `generate`'s."""
    if rate == "unknown":
        monkeypatch.setattr(ServingEngine, "_prefill_rate", property(
            lambda self: None, lambda self, v: None), raising=False)
    filling_at_chunks, m = _burst(model, 8, 0.25, slow_prefill=0.1)
    assert filling_at_chunks[0] == 1, filling_at_chunks  # the long one still filled
    assert m["held_sequences"] == (1 if rate == "unknown" else 0)


@pytest.mark.parametrize("late", [False, True], ids=["together", "late"])
def test_a_burst_that_shares_a_document_counts_it_once_when_it_holds(model, late):
    """Four prompts, one 128-token document and a 40-token question each, into an idle paged
    engine whose prefill is slow (0.1 s per 16-token call, ~150 tokens/s) with ``fill_first`` 2 s
    (``late``: the other three queued only once the first is admitted). When the first prompt is
    in, the document is cached: the three others have a question each left (~0.8 s at the
    measured rate), not three documents and questions (~3.4 s, past the 2 s), so the first waits
    for them and no stream runs while a prompt fills (counting each prompt whole, the first
    started at once and the others filled under its stream). The tokens are `generate`'s."""
    rng = np.random.default_rng(random.randrange(1 << 30))
    doc = rng.integers(5, 60, size=128).tolist()
    prompts = [doc + rng.integers(5, 60, size=40).tolist() for _ in range(4)]
    e = ServingEngine(model, max_batch=4, max_len=184, rounds_per_chunk=2, prefill_chunk=16,
                      page_size=8, prefill_budget=16, fill_first=2.0)
    filling_at_chunks, m, seqs = _serve_burst(model, e, prompts, 6, slow_prefill=0.1, late=late)
    assert filling_at_chunks and not any(filling_at_chunks), filling_at_chunks
    assert m["held_sequences"] >= 1, m
    assert [s.cached_tokens for s in seqs[1:]] == [128] * 3  # the document, from the cache


def test_the_tokens_left_to_fill_count_a_shared_block_once(model):
    """`_fill_work` (fill-first's estimate) against a count by hand: a sequence 5 tokens into
    its 29-token fill (blocks of 8) has 24 left (its half-filled block counts the 3 tokens it
    lacks); a queued one that shares its first 16 tokens adds only what it does not share;
    blocks the prefix cache holds count nothing."""
    e = ServingEngine(model, max_batch=2, max_len=64, page_size=8)
    rng = np.random.default_rng(random.randrange(1 << 30))
    a = Sequence(rng.integers(5, 60, size=30).tolist(), SamplingOptions())
    b = Sequence(a.prompt_ids[:16] + rng.integers(5, 60, size=20).tolist(), SamplingOptions())
    e._fill_of(a)
    a.blocks, a.filled = [0, 1, 2, 3], 5  # (in a slot, part of its first block in)
    assert e._fill_work([a], []) == 24
    assert e._fill_work([a], [b]) == 24 + (35 - 16)
    assert b.fill == b.prompt_ids[:-1] and len(b.fill_keys) == 4  # kept for its admission
    e.blocks.register(b.fill[:24], [5, 6, 7], b.fill_keys)  # its first 3 blocks cached
    assert e._fill_work([], [b]) == 35 - 24
    # a's first 2 blocks are b's, cached now (its half-filled one too): a's own third block and
    # its 5-token tail are left, and b's fourth block and 3-token tail
    assert e._fill_work([a], [b]) == (29 - 16) + (35 - 24)


def _byte_level_model():
    """A tiny model over a byte-level tokenizer of 256 byte tokens (+ EOS): its tokens can end
    in the middle of a UTF-8 character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    vocab["<eos>"] = len(vocab)
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    m = tiny_model(seed=1, scale=3.0, vocab=260, eos_token_ids=(256,))
    m.tokenizer = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>")
    return m


@pytest.mark.parametrize("page_size", [None, 8])
def test_the_text_of_a_last_unfinished_character_is_kept(page_size):
    """A sequence whose last tokens are the first bytes of a character: its text ends as the
    tokenizer decodes its tokens (with the replacement character), not without them (the
    streaming detokenizer holds such bytes back for the next token, and at the end there was
    none: the text lost them while the usage counted them)."""
    m = _byte_level_model()
    rng = np.random.default_rng(random.randrange(1 << 30))
    prompts = [rng.integers(0, 256, size=int(rng.integers(2, 8))).tolist() for _ in range(24)]
    e = ServingEngine(m, max_batch=4, max_len=64, rounds_per_chunk=3, prefill_chunk=16,
                      page_size=page_size).start(variants=[(True, False)])  # greedy only
    try:
        seqs = [Sequence(p, SamplingOptions(max_tokens=int(rng.integers(1, 9)), temperature=0))
                for p in prompts]
        e.submit(seqs)
        _wait(seqs)
    finally:
        e.stop()
    texts = [m.tokenizer.decode([t for t in s.tokens if t != 256]) for s in seqs]
    assert any(t.endswith("\ufffd") for t in texts)  # (the case is there)
    assert [s.text for s in seqs] == texts


BAD_SEQUENCES = [
    ([], {}, "empty"), ([5, 999], {}, "outside the vocabulary"), ([5, -1], {}, "outside"),
    ([5, 6], dict(top_k=None), "top_k"), ([5, 6], dict(top_k=2 ** 40), "top_k"),
    ([5, 6], dict(temperature=float("nan")), "temperature"), ([5, 6], dict(top_p=0.0), "top_p"),
    ([5, 6], dict(temperature="1"), "temperature"), ([5, 6], dict(max_tokens=2.5), "max_tokens"),
    ([5, 6], dict(max_tokens=-1), "max_tokens"), ([5, 6], dict(seed="x"), "seed"),
    ([5, 6], dict(stop="ab"), "stop"), ([5, 6], dict(stop=("",)), "stop"),
]


@pytest.mark.parametrize("spec", [None, "self"])
def test_a_preempted_seeded_sequence_samples_what_it_would_have_alone(model, spec):
    """A seeded, sampled sequence preempted by the greedy ones beside it (a pool of one
    sequence's blocks and three more) resumes with its row's key, so its tokens are those it
    samples alone (it resumed with a key of its length folded in: other tokens after the
    preemption)."""
    rng = np.random.default_rng(random.randrange(1 << 30))
    speculation = None if spec is None else jaxspec.Speculation(draft="self", gamma=2, sink=0,
                                                                window=8, adaptive=False)
    kw = dict(max_batch=3, max_len=96, rounds_per_chunk=2, prefill_chunk=16, page_size=8,
              prefill_budget=16, growth_reserve=0, compact_rows=False, fill_first=0,
              speculation=speculation)
    one = ServingEngine(model, **kw).max_blocks
    e = ServingEngine(model, kv_blocks=one + 3, **kw).start(
        variants=[(True, False), (False, False)])
    preempted = 0
    try:
        for _ in range(6):  # (which sequence the pool preempts depends on timing)
            others = [rng.integers(5, 60, size=int(n)).tolist() for n in (30, 38)]
            mine = rng.integers(5, 60, size=20).tolist()
            o = SamplingOptions(max_tokens=40, temperature=1.0, seed=int(rng.integers(1 << 30)))
            crowd = [Sequence(p, SamplingOptions(max_tokens=40, temperature=0)) for p in others]
            s = Sequence(mine, o)
            e.pause_admission()
            e.submit(crowd + [s])
            e.resume_admission()
            _wait(crowd + [s])
            alone = Sequence(mine, o)
            e.submit([alone])
            _wait([alone])
            assert alone.preemptions == 0
            assert s.tokens == alone.tokens, s.preemptions
            preempted += s.preemptions > 0
            if preempted >= 2:
                break
    finally:
        e.stop()
    assert preempted >= 1


def test_a_sequence_preempted_again_before_it_restarts_keeps_its_key(model):
    """Driven by hand (no engine thread): a seeded, sampled sequence is preempted after a few
    tokens, readmitted, and preempted again while its prompt refills (its row not restarted,
    the row's key not its own: the second preemption must keep the first one's key); it then
    samples what it samples alone."""
    kw = dict(max_batch=3, max_len=96, rounds_per_chunk=2, prefill_chunk=16, page_size=8,
              prefill_budget=16, growth_reserve=0, compact_rows=False, fill_first=0)
    rng = np.random.default_rng(random.randrange(1 << 30))
    mine = rng.integers(5, 60, size=20).tolist()
    o = SamplingOptions(max_tokens=30, temperature=1.0, seed=int(rng.integers(1 << 30)))

    def engine():
        e = ServingEngine(model, **kw)
        e._running = True
        return e

    def run(e, until):
        for _ in range(500):
            if until():
                return
            e._tick()
        raise AssertionError("the engine did not get there")

    e = engine()
    alone = Sequence(mine, o)
    e.submit([alone])
    run(e, lambda: alone.finished_flag)
    e.stop()
    e = engine()
    crowd = Sequence(rng.integers(5, 60, size=30).tolist(),
                     SamplingOptions(max_tokens=60, temperature=0))
    s = Sequence(mine, o)
    e.submit([crowd, s])
    run(e, lambda: len(s.tokens) >= 6)
    e._preempt(s)
    e.pause_admission()
    run(e, lambda: len(crowd.tokens) >= 20)  # the crowd decodes: every row's key moves on
    e.resume_admission()
    with e._cv:
        e.waiting.remove(s)
    b = e.slots.index(None)
    e._admit_paged([(b, s)])  # readmitted, its prompt and tokens refilling
    assert s.slot == b and b not in e._started
    e._preempt(s)  # short of blocks again before it restarts
    run(e, lambda: s.finished_flag and crowd.finished_flag)
    e.stop()
    assert s.preemptions == 2
    assert s.tokens == alone.tokens


def test_a_stop_string_in_the_last_unfinished_character_ends_with_stop():
    """The held-back text of the last token (a space and the first byte of a character, one
    token) holds the stop string " ": the text ends before it and the finish is "stop", not the
    budget's "length"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    vocab["<eos>"] = 256
    vocab["\u0120\u00e2"] = 257  # (byte-level: " " and the first byte of a 3-byte character)
    t = Tokenizer(models.BPE(vocab=vocab, merges=[("\u0120", "\u00e2")]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    m = tiny_model(seed=1, vocab=260, eos_token_ids=(256,))
    m.tokenizer = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>")
    e = ServingEngine(m, max_batch=1, max_len=64)
    s = Sequence(m.tokenizer("hi")["input_ids"],
                 SamplingOptions(max_tokens=4, temperature=0, stop=(" ",)))
    events = []
    s._emit = events.append
    new = m.tokenizer("end")["input_ids"] + [257]
    assert m.tokenizer.decode(new) == "end \ufffd"
    e._deliver(s, new, [False] * len(new), True)  # the budget ends it on the device
    assert (s.text, s.finish_reason) == ("end", "stop")
    assert "".join(ev["text"] for ev in events if ev["type"] == "delta") == "end"


@pytest.mark.parametrize("page_size", [None, 8])
def test_a_sequence_the_engine_cannot_run_is_refused_at_submit(model, page_size):
    """Each of these, once queued, raised on the engine thread and failed the rows decoding
    beside it (dense: and was lost, never finished). Refused at `submit`, with the option named;
    the engine goes on serving, and nothing is queued of a refused batch."""
    ref = jaxspec.generate(model, [[7, 8, 9]], max_new_tokens=6).tokens[0]
    e = ServingEngine(model, max_batch=2, max_len=64, rounds_per_chunk=2, prefill_chunk=16,
                      page_size=page_size).start(variants=[(True, False)])  # runs greedy only
    try:
        good = Sequence([7, 8, 9], SamplingOptions(max_tokens=6, temperature=0))
        for prompt, kw, msg in BAD_SEQUENCES:
            bad = Sequence(prompt, SamplingOptions(**{"max_tokens": 4, **kw}))
            with pytest.raises(ValueError, match=msg):
                e.submit([good, bad])
            assert not e.waiting
        e.submit([good])
        _wait([good])
        assert good.tokens == ref
    finally:
        e.stop()


@pytest.mark.parametrize("kw", [dict(max_batch=0), dict(rounds_per_chunk=0), dict(max_queue=0)])
def test_engine_sizes_are_checked(model, kw):
    with pytest.raises(ValueError, match="must be >= 1"):
        ServingEngine(model, **{"max_batch": 2, "max_len": 64, **kw})


def test_fill_first_is_checked(model):
    with pytest.raises(ValueError, match="fill_first"):
        ServingEngine(model, max_batch=2, max_len=64, page_size=8, fill_first=-1)
    with pytest.raises(ValueError, match="block pool"):
        ServingEngine(model, max_batch=2, max_len=64, fill_first=5)
    assert ServingEngine(model, max_batch=2, max_len=64).fill_first == 0  # dense: none
    assert ServingEngine(model, max_batch=2, max_len=64, page_size=8).fill_first > 0


def test_prefill_budget_follows_the_measured_rate(model):
    """Without a fixed ``prefill_budget``, the prompt tokens prefilled between two decode chunks
    take `PREFILL_IDLE_SECONDS` at the measured prefill rate while fewer sequences decode than
    wait for their prefill (the batch fills first), and `PREFILL_SHARE` of the last chunk's time
    once as many decode (their inter-token latency grows by about that share); whole prefill
    chunks, at least `PREFILL_MIN_TOKENS` (and one chunk). Once the engine has prefilled, the
    rate it measured is positive and sizes the next steps."""
    from jaxspec.serving import PREFILL_IDLE_SECONDS, PREFILL_MIN_TOKENS, PREFILL_SHARE
    e = ServingEngine(model, max_batch=2, max_len=96, page_size=8, prefill_chunk=16)
    floor = -(-PREFILL_MIN_TOKENS // 16) * 16
    big = ServingEngine(model, max_batch=2, max_len=96, page_size=8,
                        prefill_chunk=2 * PREFILL_MIN_TOKENS)
    assert big._prefill_tokens() == 2 * PREFILL_MIN_TOKENS  # one chunk larger than the floor
    assert e._prefill_tokens() == floor  # before any rate is measured
    rng = np.random.default_rng(random.randrange(1 << 30))
    rate, chunk = float(rng.uniform(1e4, 1e6)), float(rng.uniform(0.01, 0.2))
    rate = max(rate, 4 * floor / min(chunk * PREFILL_SHARE, PREFILL_IDLE_SECONDS))  # above it
    e._prefill_rate, e._chunk_s = rate, chunk
    idle = max(floor, int(rate * PREFILL_IDLE_SECONDS) // 16 * 16)
    share = max(floor, int(rate * PREFILL_SHARE * chunk) // 16 * 16)
    e.slots[0] = SimpleNamespace(fill=[1] * 40, filled=40)  # a sequence that decodes
    e._started.add(0)
    assert e._prefill_tokens() == share and share % 16 == 0
    e.slots[1] = SimpleNamespace(fill=[1] * 40, filled=16)  # one that waits: as many as decode
    assert e._prefill_tokens() == share
    e.slots[0] = None  # none decodes, one waits: the batch fills first
    e._started.clear()
    assert e._prefill_tokens() == idle
    e._prefill_rate = 1.0  # too slow for a chunk in the share: the floor
    assert e._prefill_tokens() == floor
    assert ServingEngine(model, max_batch=2, max_len=96, page_size=8,
                         prefill_budget=40)._prefill_tokens() == 40
    e2 = ServingEngine(model, max_batch=2, max_len=96, page_size=8, prefill_chunk=16).start(
        variants=[(True, False)])
    try:
        e2.generate(list(range(5, 60)), SamplingOptions(max_tokens=4, temperature=0), timeout=300)
        assert e2._prefill_rate is not None and e2._prefill_rate > 0
    finally:
        e2.stop()


def test_a_released_prefix_is_evicted_from_its_end():
    """Blocks of a released sequence are evicted last block first: what stays cached is always a
    reachable prefix (a lookup stops at the first missing block, so keeping a later block while
    its predecessor goes would keep it for nothing and make the next request prefill it again)."""
    bs = 4
    bm = BlockManager(6, bs)
    doc = list(range(16))  # four full blocks
    blocks = bm.allocate(4)
    bm.register(doc, blocks)
    bm.release(blocks)
    for n in (1, 2, 3):  # others take the room of n cached blocks
        bm = BlockManager(6, bs)
        blocks = bm.allocate(4)
        bm.register(doc, blocks)
        bm.release(blocks)
        assert bm.allocate(2 + n) is not None  # the 2 empty blocks, then n cached ones
        assert bm.lookup(doc) == blocks[:4 - n]


def test_block_manager_against_a_model():
    """Random acquire / allocate / release / register sequences against plain bookkeeping:
    reference counts, free counts, cache hits of exactly the registered prefixes, LRU eviction
    of unreferenced cached blocks only."""
    rng = random.Random(random.randrange(1 << 30))
    bs, nb = 4, 24
    bm = BlockManager(nb, bs)
    held = []  # (tokens, blocks) of live sequences
    registered = {}  # tuple(tokens of whole-block prefix) -> block
    for _ in range(400):
        op = rng.random()
        if op < 0.5:
            vocab = rng.choice([2, 3])  # tiny vocabularies: many shared prefixes
            toks = [rng.randrange(vocab) for _ in range(rng.randrange(1, 5 * bs))]
            hit = bm.lookup(toks)
            # the hit is exactly the longest prefix whose blocks are registered and still cached
            j = 0
            while (j + 1) * bs <= len(toks) and tuple(toks[:(j + 1) * bs]) in registered:
                assert hit[j] == registered[tuple(toks[:(j + 1) * bs])]
                j += 1
            assert len(hit) == j
            bm.acquire(hit)
            need = -(-len(toks) // bs) - len(hit)
            free0 = bm.free
            new = bm.allocate(need)
            if new is None:
                assert need > free0
                bm.release(hit)
                continue
            assert len(set(new)) == need and not set(new) & set(hit)
            assert all(bm.ref[b] == 1 for b in new)
            # allocation may evict unreferenced cached blocks: forget those
            for key, b in list(registered.items()):
                if b in new:
                    del registered[key]
            blocks = hit + new
            bm.register(toks, blocks)
            for i in range(len(toks) // bs):
                registered.setdefault(tuple(toks[:(i + 1) * bs]), blocks[i])
            held.append((toks, blocks))
        elif held:
            toks, blocks = held.pop(rng.randrange(len(held)))
            bm.release(blocks)
        refs = [0] * nb
        for _, blocks in held:
            for b in blocks:
                refs[b] += 1
        assert bm.ref == refs
        assert bm.free == sum(r == 0 for r in refs)
        assert bm.cached == len(set(registered.values()))
    for _, blocks in held:
        bm.release(blocks)
    assert bm.free == nb
    with pytest.raises(RuntimeError):
        bm.release([0])


@pytest.mark.parametrize("spec,mixed", [(None, 0), ("self", 0), ("self", 8), ("retrieve", 0)])
def test_shared_context_rows_equal_generate(model, spec, mixed):
    """Requests about one document, running together on the paged engine with the shared
    context on (`share_min_tokens=0`): their common cached blocks are attended to once for all
    of them, and every greedy completion still equals `jaxspec.generate` (float32); a request
    about something else runs beside them. The shared context was built once (its blocks stay
    the same while its rows finish one by one) and the chunks ran with it. ``mixed``: the
    prompts fill in pieces inside the running rows' rounds, so rows join the shared context
    while others still fill."""
    rng = np.random.default_rng(random.randrange(1 << 30))
    doc = rng.integers(5, 60, size=35).tolist()  # four full blocks of 8 and a bit
    prompts = [doc + rng.integers(5, 60, size=int(n)).tolist() for n in (2, 5, 9)]
    prompts.append(rng.integers(5, 60, size=13).tolist())
    news = [12, 20, 28, 16]  # they finish at different times
    ref = [r[:n] for r, n in zip(jaxspec.generate(model, prompts, max_new_tokens=max(news)).tokens,
                                 news)]  # (no EOS: each a prefix of the longer greedy text)
    speculation = None if spec is None else jaxspec.Speculation(
        draft="self", gamma=3, sink=2, window=6, adaptive=False,
        retrieve=64 if spec == "retrieve" else 0)
    e = ServingEngine(model, max_batch=4, max_len=96, rounds_per_chunk=2, prefill_chunk=16,
                      page_size=8, speculation=speculation,
                      prefill_budget=None if mixed else 64, mixed_prefill=mixed,
                      share_min_tokens=0).start(variants=[(True, False)])
    try:
        e.pause_admission()
        seqs = [Sequence(p, SamplingOptions(max_tokens=n, temperature=0))
                for p, n in zip(prompts, news)]
        if mixed:  # the others come as the longest one starts decoding: they fill in its rounds
            later = [seqs[:2] + seqs[3:]]

            def submit_later(_active):  # (the engine thread, before its first decode chunk)
                if later:
                    e.submit(later.pop())
            e.step_fault_hook = submit_later
            e.submit([seqs[2]])
            e.resume_admission()
        else:
            e.submit(seqs)
            e.resume_admission()
        _wait(seqs)
        for s, r in zip(seqs, ref):
            assert s.tokens == r, s.prompt_ids[:5]
        m = e.metrics()
        # (rows that start later may share fewer blocks with the first: a new copy)
        assert (m["shared_context_copies"] == 1 if not mixed else
                m["shared_context_copies"] >= 1), m
        assert m["shared_context_row_chunks"] >= 4, m
        assert (m["mixed_prefill_tokens"] > 0) == (mixed > 0), m
        assert m["kv_blocks_used"] == 0, m
        t0 = time.time()  # the engine lets go of the context after its last chunk
        while e.metrics()["shared_context_rows"] and time.time() - t0 < 30:
            time.sleep(0.01)
        assert e.metrics()["shared_context_rows"] == 0 and e._shared_ctx is None
    finally:
        e.stop()


@pytest.mark.parametrize("spec", [None, "self"])
def test_a_request_cancelled_while_its_prompt_fills(model, spec):
    """A request cancelled while its prompt is prefilled in pieces inside another request's
    decode rounds (mixed chunks) ends "cancelled" and gives its blocks back; the running request
    still completes as `jaxspec.generate` does (float32). The same prompt sent again finds the
    full blocks the cancelled fill wrote in the prefix cache, and completes as `generate` does:
    the cached blocks hold exactly its K/V."""
    rng = np.random.default_rng(random.randrange(1 << 30))
    short = rng.integers(5, 60, size=9).tolist()
    long = rng.integers(5, 60, size=70).tolist()
    new, first_new = 24, 100  # the first one decodes all the while the long prompt fills
    ref = jaxspec.generate(model, [short, long], max_new_tokens=first_new).tokens
    ref = [ref[0], ref[1][:new]]  # (no EOS: a shorter budget is a prefix)
    speculation = None if spec is None else jaxspec.Speculation(
        draft="self", gamma=3, sink=2, window=6, adaptive=False)
    e = ServingEngine(model, max_batch=2, max_len=120, rounds_per_chunk=2, prefill_chunk=16,
                      page_size=8, speculation=speculation, mixed_prefill=8)
    opts = SamplingOptions(max_tokens=new, temperature=0)
    first = Sequence(short, SamplingOptions(max_tokens=first_new, temperature=0))
    second = Sequence(long, opts)
    caught = []

    def cancel_mid_fill(_active):  # (the engine thread, before each decode chunk)
        if not caught and second.slot is not None and 8 <= second.filled <= len(long) - 16:
            caught.append(second.filled)
            e.cancel(second)
    e.step_fault_hook = cancel_mid_fill
    e.start(variants=[(True, False)])
    try:
        e.submit([first])
        t0 = time.time()
        while not first.tokens and time.time() - t0 < 120:  # decoding before the long one comes
            time.sleep(0.005)
        e.submit([second])
        _wait([first])
        assert second.finished.wait(60) and second.finish_reason == "cancelled", caught
        assert caught and first.tokens == ref[0]
        m = e.metrics()
        assert m["finished_cancelled"] == 1 and m["mixed_prefill_tokens"] > 0, m
        assert m["kv_blocks_used"] == 0 and m["kv_blocks_cached"] > 0, m
        again = Sequence(long, opts)
        e.submit([again])
        _wait([again])
        assert again.tokens == ref[1]
        assert again.usage()["prompt_tokens_details"]["cached_tokens"] >= 8
    finally:
        e.stop()


def test_a_paged_server_prefills_larger_chunks_on_an_accelerator(monkeypatch):
    """A block pool on a GPU or TPU prefills in chunks of `SERVE_PREFILL_CHUNK` (one prompt per
    forward: 512-token GEMMs are too small there); dense slots and CPUs keep the library's."""
    import jax

    from jaxspec import serving
    from jaxspec.prefill import DEFAULT_PREFILL_CHUNK
    assert serving.default_prefill_chunk(True) == serving.default_prefill_chunk(False) \
        == DEFAULT_PREFILL_CHUNK
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert serving.default_prefill_chunk(True) == serving.SERVE_PREFILL_CHUNK > DEFAULT_PREFILL_CHUNK
    assert serving.default_prefill_chunk(False) == DEFAULT_PREFILL_CHUNK


@pytest.mark.parametrize("page_size", [None, 8], ids=["dense", "paged"])
def test_a_failed_chunk_fails_its_sequences_not_the_next_admitted(model, page_size):
    """A decode chunk that fails on the device thread surfaces where the engine next takes the
    slots' state: here, admitting a request queued while the chunk ran. The failure goes to the
    sequence that was in the chunk; the request being admitted waits, is admitted on the fresh
    state, and completes with `generate`'s tokens (before, it failed with the chunk's error)."""
    rng = np.random.default_rng(random.randrange(1 << 30))
    prompts = [rng.integers(5, 60, size=int(n)).tolist() for n in rng.integers(6, 30, size=2)]
    ref = jaxspec.generate(model, prompts[1:], max_new_tokens=10).tokens
    e = ServingEngine(model, max_batch=2, max_len=96, rounds_per_chunk=2, page_size=page_size)
    opts = [SamplingOptions(max_tokens=n, temperature=0) for n in (40, 10)]
    first, late = (Sequence(p, o) for p, o in zip(prompts, opts))
    armed, chunks = [], []
    real = e.decoder.call_chunk

    def faulty(*a, **kw):  # (on the device thread)
        if armed:  # (the engine thread's next admission waits for this chunk's result)
            armed.clear()
            raise RuntimeError("injected device fault")
        return real(*a, **kw)
    e.decoder.call_chunk = faulty

    def before_chunk(active):  # (on the engine thread, before it dispatches a chunk)
        chunks.append(len(active))
        if len(chunks) == 3:
            e.submit([late])  # queued while the failing chunk runs
            armed.append(True)
    e.step_fault_hook = before_chunk
    e.start(variants=[(True, False)])
    try:
        e.submit([first])
        assert first.finished.wait(600) and late.finished.wait(600)
    finally:
        e.stop()
    assert first.error is not None and "injected device fault" in first.error, first.error
    assert late.error is None, late.error
    assert late.tokens == ref[0]


@pytest.mark.parametrize("page_size", [None, 8], ids=["dense", "paged"])
def test_a_failed_chunk_lets_go_of_the_old_pool_first(model, page_size):
    """After a chunk fails (here before its program took the state), the engine recovers on a
    fresh state; while it makes that one, no array of the old pool is alive (on a device whose
    pool is sized to its memory, two would not fit). The check can fail: the failure's
    traceback passes through frames that hold the state."""
    import jax
    rng = np.random.default_rng(random.randrange(1 << 30))
    e = ServingEngine(model, max_batch=2, max_len=96, rounds_per_chunk=2, page_size=page_size)
    seq = Sequence(rng.integers(5, 60, size=12).tolist(),
                   SamplingOptions(max_tokens=40, temperature=0))
    armed, chunks, shape, alive = [], [], [], []
    real_call, real_fresh = e.decoder.call_chunk, e._fresh_state

    def faulty(*a, **kw):  # (its frame holds the state)
        if armed:
            armed.clear()
            raise RuntimeError("injected device fault")
        return real_call(*a, **kw)

    def before_chunk(active):
        chunks.append(1)
        if len(chunks) == 3:
            shape.append(e._state.cache.k.shape)
            armed.append(True)

    def fresh():
        alive.append(sum(a.shape == shape[0] for a in jax.live_arrays()))
        return real_fresh()
    e.decoder.call_chunk, e.step_fault_hook, e._fresh_state = faulty, before_chunk, fresh
    e.start(variants=[(True, False)])
    try:
        e.submit([seq])
        assert seq.finished.wait(600)
    finally:
        e.stop()
    assert seq.error is not None and "injected device fault" in seq.error, seq.error
    assert alive == [0], alive


def test_a_failed_chunk_starts_over_the_sequences_that_streamed_nothing(model):
    """A chunk fails while one sequence streams and another's prompt still fills (whole prefill
    steps of 16 tokens between chunks): the streaming one fails; the filling one, which has
    shown nothing, starts over on the fresh state and completes with `generate`'s tokens. A
    second failure, once it decodes, fails it. Before, both failed."""
    rng = np.random.default_rng(random.randrange(1 << 30))
    prompts = [rng.integers(5, 60, size=9).tolist(), rng.integers(5, 60, size=70).tolist()]
    ref = jaxspec.generate(model, prompts[1:], max_new_tokens=8).tokens
    for faults in (1, 2):
        e = ServingEngine(model, max_batch=2, max_len=120, rounds_per_chunk=2,
                          prefill_chunk=16, page_size=8, prefill_budget=16, fill_first=0)
        seqs = [Sequence(p, SamplingOptions(max_tokens=n, temperature=0))
                for p, n in zip(prompts, (40, 8))]
        seen = []

        def before_chunk(active, seqs=seqs, seen=seen, faults=faults):
            seen.append((bool(seqs[0].tokens), seqs[1].filled < len(seqs[1].fill)))
            if len(seen) == 3 or faults == 2 and seqs[1].retried and seqs[1] in active:
                raise FloatingPointError("injected decode fault")
        _serve_together(e, seqs, before_chunk)
        assert seen[2] == (True, True), seen  # the fault: one streams, one fills
        assert "injected decode fault" in (seqs[0].error or ""), seqs[0].error
        assert seqs[1].retried
        if faults == 1:
            assert seqs[1].error is None and seqs[1].tokens == ref[0], seqs[1].error
        else:
            assert "injected decode fault" in (seqs[1].error or ""), seqs[1].error


def test_a_sequence_that_starts_over_reports_the_fresh_pools_cached_tokens(model):
    """Two prompts share a 48-token prefix; the second finds the first's blocks once they are
    cached (late hits, 48 tokens) and fills its own 40 tokens in steps of 16. A chunk fails
    while the first decodes (it fails) and the second still fills: the second starts over on a
    fresh pool, where nothing is cached. The reused tokens it reports are the fresh pool's, 0
    (the old pool's 48, before), the prefix metrics count its lookup once, and its tokens are
    `generate`'s."""
    rng = np.random.default_rng(random.randrange(1 << 30))
    shared = rng.integers(5, 60, size=48).tolist()
    prompts = [rng.integers(5, 60, size=9).tolist(), shared + rng.integers(5, 60, size=4).tolist(),
               shared + rng.integers(5, 60, size=40).tolist()]
    ref = jaxspec.generate(model, prompts[2:], max_new_tokens=6).tokens
    e = ServingEngine(model, max_batch=3, max_len=120, rounds_per_chunk=2, prefill_chunk=16,
                      page_size=8, prefill_budget=16, fill_first=0)
    a, b, c = seqs = [Sequence(p, SamplingOptions(max_tokens=n, temperature=0))
                      for p, n in zip(prompts, (40, 6, 6))]
    fired = []

    def before_chunk(active):
        if not fired and c.cached_tokens > 0 and c.slot is not None and \
                c.slot not in e._started:
            fired.append((c.cached_tokens, b.slot in e._started))
            raise FloatingPointError("injected decode fault")
    m = _serve_together(e, seqs, before_chunk)
    assert fired == [(48, True)], fired  # the first decoding, the second filling after its hits
    assert "injected decode fault" in (b.error or ""), b.error
    assert c.retried and c.error is None and c.tokens == ref[0], c.error
    assert c.cached_tokens == 0, c.cached_tokens
    assert m["prefix_hit_tokens"] == 48, m
    assert m["prefix_query_tokens"] == sum(len(p) - 1 for p in prompts), m
