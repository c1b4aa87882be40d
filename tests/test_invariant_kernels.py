"""The batch-invariant Pallas kernels' two ways of running the same arithmetic, in the
interpreter: the matmul's K parts folded in one program or split over programs and added
afterwards, and the attention's key parts (fixed absolute positions) folded in one program (one
or several tiles per program) or split over programs and merged. Each pair must give the same
bits, and the results must still not depend on the batch, T, chunking or cache capacity with
several parts in play (the model-level tests in ``test_batch_invariant.py`` run the default
blocks, whose parts are longer than their contexts)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import invariant
from jaxspec.tree import TokenTree
from pallas_kernels.invariant_attention import InvariantAttentionBlocks
from pallas_kernels.invariant_matmul import InvariantMatmulBlocks, invariant_matmul, k_parts

BF16 = jnp.bfloat16
MM_BLOCKS = InvariantMatmulBlocks(block_m=16, block_n=32, block_k=16, split_programs=16,
                                  min_part=2)
ATT_BLOCKS = InvariantAttentionBlocks(block_rows=16, block_k=16, chunk=32, fold_tiles=3,
                                      split_tiles=2)


def test_k_parts_depend_on_k_and_n_only():
    assert k_parts(8960, 1536) == (128, 64, 16, 9)  # Qwen2.5-1.5B's down projection
    assert k_parts(1536, 151936)[2] == 1  # an LM head: enough column tiles, one part
    bn, bk, parts, per = k_parts(192, 160, MM_BLOCKS)
    assert (bn, bk) == (32, 16) and parts > 1 and per >= MM_BLOCKS.min_part
    assert (parts - 1) * per < 192 // bk <= parts * per


@pytest.mark.parametrize("K,N,nk", [(192, 160, False), (200, 96, False), (192, 160, True)])
def test_matmul_split_equals_fold_and_rows_are_invariant(K, N, nk):
    rng = np.random.default_rng(K + N)
    w = jnp.asarray(rng.normal(size=(N, K) if nk else (K, N)) / np.sqrt(K), BF16)
    row = jnp.asarray(rng.normal(size=(1, K)), BF16)

    def mm(x, mode):
        return np.asarray(invariant_matmul(x, w, out_dtype=jnp.float32, interpret=True,
                                           block_sizes=MM_BLOCKS, mode=mode, transpose_w=nk))
    ref = mm(row, "fold")[0]
    w64 = np.asarray(w, np.float64)
    np.testing.assert_allclose(ref, np.asarray(row, np.float64)[0] @ (w64.T if nk else w64),
                               rtol=1e-5, atol=1e-5)
    for M in (5, 16, 40):
        X = jnp.asarray(rng.normal(size=(M, K)), BF16)
        for pos in (0, M - 1):
            Xp = X.at[pos].set(row[0])
            for mode in ("fold", "split", "auto"):
                assert np.array_equal(mm(Xp, mode)[pos], ref), (M, pos, mode)


def _tiles(q, k, v, L, *, T, mode, mask=None, window=None, blocks=ATT_BLOCKS):
    return np.asarray(invariant._attention_tiles(
        q, k, v, 0, L, mask, num_new=T, sm_scale=None, sliding_window=window, interpret=True,
        blocks=blocks, mode=mode), np.float32)


def _inputs(seed, B=3, T=12, H=8, K=2, D=32, S=200):
    rng = np.random.default_rng(seed)
    L = jnp.asarray([9, 70, S - T - 3][:B], jnp.int32)
    q = jnp.asarray(rng.normal(size=(B, T, H, D)), BF16)
    k = jnp.asarray(rng.normal(size=(1, B, K, S, D)), BF16)
    v = jnp.asarray(rng.normal(size=(1, B, K, S, D)), BF16)
    return q, k, v, L


@pytest.mark.parametrize("base2", [False, True], ids=["exp", "exp2"])
@pytest.mark.parametrize("window", [None, 37])
def test_attention_parts_split_fold_steps_chunks(window, base2):
    """Several 32-key parts: split (2 tiles per program) == fold (3 tiles per program) ==
    one-token steps == a prefill in chunks of 4, and close to the `jnp` form; with exponentials
    in base e and in base 2 (``fast_exp``)."""
    T = 12
    q, k, v, L = _inputs(int(np.random.default_rng().integers(2**31)), T=T)
    blocks = dataclasses.replace(ATT_BLOCKS, fast_exp=base2)
    fold = _tiles(q, k, v, L, T=T, mode="fold", window=window, blocks=blocks)
    assert np.array_equal(fold, _tiles(q, k, v, L, T=T, mode="split", window=window,
                                       blocks=blocks))
    one = dataclasses.replace(blocks, fold_tiles=1, split_tiles=1)
    for mode in ("fold", "split"):  # a tile per program
        assert np.array_equal(fold, _tiles(q, k, v, L, T=T, mode=mode, window=window,
                                           blocks=one)), mode
    steps = np.stack([_tiles(q[:, t:t + 1], k, v, L + t, T=1, mode="auto", window=window,
                             blocks=blocks)[:, 0] for t in range(T)], 1)
    assert np.array_equal(fold, steps)
    chunks = np.concatenate([_tiles(q[:, j:j + 4], k, v, L + j, T=4, mode="fold", window=window,
                                    blocks=blocks) for j in range(0, T, 4)], 1)
    assert np.array_equal(fold, chunks)
    ref = np.asarray(invariant.attention(q, k, v, 0, L, None, num_new=T, sliding_window=window,
                                         impl="invariant"), np.float32)
    np.testing.assert_allclose(fold, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("window", [None, 37])
def test_unmasked_interior_blocks_are_the_blocks_every_row_sees(window, monkeypatch):
    """The key blocks run without masks are those every real row of a program sees whole: in
    float32 in the interpreter (made to run them), the results are those of every block masked
    up to XLA:CPU's rounding of ``exp`` (an unmasked key a row must not see, or a skipped
    block, would be far off). Decode, a verification of 5 in 2 tiles, a chunk of 12 in a group
    of tiles, a tree; both modes."""
    from pallas_kernels import invariant_attention as ia
    monkeypatch.setattr(ia, "INTERPRET_INTERIOR", True)
    rng = np.random.default_rng()
    B, T, S, D = 3, 12, 200, 32
    L = jnp.asarray([int(rng.integers(0, 20)), int(rng.integers(40, 120)), S - T - 3],
                    jnp.int32)
    q, k, v = (jnp.asarray(rng.normal(size=sh), jnp.float32)
               for sh in ((B, T, 8, D), (1, B, 2, S, D), (1, B, 2, S, D)))
    k = k.at[:, :, :, S - 2:].set(1e4)  # past every row's keys: far off if ever seen
    inner = dataclasses.replace(ATT_BLOCKS, unmasked_interior=True)
    tree = jnp.asarray(TokenTree.from_parents([-1, 0, 0, 1, 2, 4]).ancestor_mask)
    for n, mask in ((1, None), (5, None), (T, None), (6, tree)):
        for mode in ("fold", "split"):
            got, want = (_tiles(q[:, :n], k, v, L, T=n, mode=mode, window=window, mask=mask,
                                blocks=b) for b in (inner, ATT_BLOCKS))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{n} {mode}")


def test_attention_parts_row_alone_and_tree():
    """A row alone in a cache of its own capacity, and a tree node vs its path compacted, with
    several parts; both modes."""
    T = 6
    q, k, v, L = _inputs(1, T=T)
    full = _tiles(q, k, v, L, T=T, mode="split")
    b = 1
    S2 = int(L[b]) + T + 2
    for mode in ("fold", "split"):
        alone = _tiles(q[b:b + 1], k[:, b:b + 1, :, :S2], v[:, b:b + 1, :, :S2], L[b:b + 1], T=T,
                       mode=mode)[0]
        assert np.array_equal(alone, full[b]), mode
    tree = TokenTree.from_parents([-1, 0, 0, 1, 2, 4])
    path = [0, 2, 4, 5]
    B = q.shape[0]
    Ln = np.asarray(L)
    b_idx = np.arange(B)[:, None]
    kc = k.at[0, b_idx, :, Ln[:, None] + np.arange(4)[None]].set(
        k[0, b_idx, :, Ln[:, None] + np.asarray(path)[None]])
    vc = v.at[0, b_idx, :, Ln[:, None] + np.arange(4)[None]].set(
        v[0, b_idx, :, Ln[:, None] + np.asarray(path)[None]])
    step = _tiles(q[:, 5:6], kc, vc, L + 3, T=1, mode="split")[:, 0]
    for mode in ("fold", "split"):
        tv = _tiles(q, k, v, L, T=T, mode=mode, mask=jnp.asarray(tree.ancestor_mask))[:, 5]
        assert np.array_equal(tv, step), mode


def test_attention_kernels_lower_for_cuda_in_both_modes():
    B, T, H, K, D, S = 4, 5, 12, 2, 128, 4200
    q = jax.ShapeDtypeStruct((B, T, H, D), BF16)
    kv = jax.ShapeDtypeStruct((2, B, K, S, D), BF16)
    ln = jax.ShapeDtypeStruct((B,), jnp.int32)
    one = InvariantAttentionBlocks(split_tiles=1)  # a verification's tiles one per program
    base_e = InvariantAttentionBlocks(fast_exp=False, unmasked_interior=False)  # (expf)
    for mode, blocks in (("fold", None), ("split", None), ("split", one), ("fold", base_e),
                         ("split", base_e)):
        f = jax.jit(lambda q, k, v, ln, mode=mode, blocks=blocks: invariant._attention_tiles(
            q, k, v, 1, ln, None, num_new=T, sm_scale=None, sliding_window=None,
            interpret=False, mode=mode, blocks=blocks))
        txt = f.trace(q, kv, kv, ln).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in txt
        # a cache of whole 64-key blocks: causal tiles load contiguous blocks
        kv64 = jax.ShapeDtypeStruct((2, B, K, 4224, D), BF16)
        assert "__gpu$xla.gpu.triton" in f.trace(q, kv64, kv64, ln).lower(
            lowering_platforms=("cuda",)).as_text()
        assert ("invariant_attention_merge" in txt) == (mode == "split")
    # 3 tiles of 16 rows (a verification of 6 tokens at G = 6) and tiles per program that are
    # no power of two: the programs take a power of two of them (Triton's block sizes)
    q6 = jax.ShapeDtypeStruct((B, 6, H, D), BF16)
    for mode, blocks in (("fold", None), ("split", InvariantAttentionBlocks(split_tiles=3)),
                         ("fold", InvariantAttentionBlocks(fold_tiles=3))):
        f = jax.jit(lambda q, k, v, ln, mode=mode, blocks=blocks: invariant._attention_tiles(
            q, k, v, 1, ln, None, num_new=6, sm_scale=None, sliding_window=None,
            interpret=False, mode=mode, blocks=blocks))
        assert "__gpu$xla.gpu.triton" in f.trace(q6, kv, kv, ln).lower(
            lowering_platforms=("cuda",)).as_text(), (mode, blocks)



def _contiguous_vs_gathered(interpret, B, D, S, T2=24, blocks=None):
    """Causal tiles in a cache of whole 64-key blocks load contiguous blocks; in a cache of
    another capacity every key is gathered by its slot. The same rows: the same bits, and the
    same as one-token steps."""
    rng = np.random.default_rng()
    S_odd = S - 40  # not a multiple of the 64-key block: the gathering loads
    L = jnp.asarray(rng.integers(S_odd // 2, S_odd - T2 - 8, size=B), jnp.int32)
    q = jnp.asarray(rng.normal(size=(B, T2, 12, D)), BF16)
    k = jnp.asarray(rng.normal(size=(1, B, 2, S, D)), BF16)
    v = jnp.asarray(rng.normal(size=(1, B, 2, S, D)), BF16)

    def run(q, L, T, S_=S, mode="auto"):
        return np.asarray(invariant._attention_tiles(
            q, k[:, :, :, :S_], v[:, :, :, :S_], 0, L, None, num_new=T, sm_scale=None,
            sliding_window=None, interpret=interpret, mode=mode, blocks=blocks), np.float32)
    whole = run(q, L, T2)
    assert np.array_equal(whole, run(q, L, T2, S_odd))
    steps = np.stack([run(q[:, t:t + 1], L + t, 1, mode="split")[:, 0] for t in range(T2)], 1)
    assert np.array_equal(whole, steps)
    for mode in ("fold", "split"):
        assert np.array_equal(run(q[:, :5], L, 5, S_odd, mode), steps[:, :5]), mode


def test_contiguous_and_gathered_key_loads_give_the_same_bits():
    _contiguous_vs_gathered(True, B=2, D=32, S=256)


@pytest.mark.gpu
def test_contiguous_and_gathered_key_loads_give_the_same_bits_on_the_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    _contiguous_vs_gathered(False, B=6, D=128, S=5120)


def _pool_vs_dense(interpret, *, B, D, S, page_sizes, blocks=None, T=6, H=12, K=2):
    """The kernel reading a block pool through its table (blocks shuffled, unmapped ones and
    entries past the rows' blocks holding NaN) gives the bits of a dense cache holding the same
    slots: decode steps, a verification in both modes, a tree and a sliding window."""
    rng = np.random.default_rng()
    L = jnp.asarray(rng.integers(S // 3, S - T - 1, size=B), jnp.int32)
    q = jnp.asarray(rng.normal(size=(B, T, H, D)), BF16)
    tree = jnp.asarray(TokenTree.from_parents([-1, 0, 0, 1, 2, 4][:T]).ancestor_mask)
    for BS in page_sizes:
        MB = -(-S // BS)
        NB = B * MB + 3
        kp = jnp.asarray(rng.normal(size=(2, NB, K, BS, D)), BF16)
        vp = jnp.asarray(rng.normal(size=(2, NB, K, BS, D)), BF16)
        tab = rng.permutation(NB)[:B * MB].reshape(B, MB)
        used = np.zeros(NB, bool)
        for b in range(B):  # the blocks a row reads: the others hold NaN, and so do its own
            n = -(-(int(L[b]) + T) // BS)  # past its keys (their slots are masked)
            used[tab[b, :n]] = True
            tab[b, n + 1:] = rng.choice([-1, NB + 5, 0], size=max(0, MB - n - 1))
        kp = jnp.where(jnp.asarray(used)[None, :, None, None, None], kp, jnp.nan)
        vp = jnp.where(jnp.asarray(used)[None, :, None, None, None], vp, jnp.nan)
        tab = jnp.asarray(tab, jnp.int32)
        idx = jnp.clip(tab, 0, NB - 1)
        kd = kp[:, idx].transpose(0, 1, 3, 2, 4, 5).reshape(2, B, K, MB * BS, D)
        vd = vp[:, idx].transpose(0, 1, 3, 2, 4, 5).reshape(2, B, K, MB * BS, D)

        def run(pool, q_, T_, mask=None, window=None, mode="auto"):
            k_, v_, t_ = (kp, vp, tab) if pool else (kd, vd, None)
            return np.asarray(invariant._attention_tiles(
                q_, k_, v_, 1, L, mask, num_new=T_, sm_scale=None, sliding_window=window,
                interpret=interpret, mode=mode, blocks=blocks, block_table=t_), np.float32)

        for args in ((q[:, :1], 1), (q, T, None, None, "fold"), (q, T, None, None, "split"),
                     (q, T, tree), (q, T, None, 37)):
            got, want = run(True, *args), run(False, *args)
            assert np.isfinite(got).all(), (BS, args[1:])
            assert np.array_equal(got, want), (BS, args[1:])


def test_a_block_pool_read_through_its_table_gives_the_dense_bits():
    # key blocks of 16: pages of 4 (whole pages per key block) and 32 (parts of one page)
    _pool_vs_dense(True, B=2, D=32, S=120, page_sizes=(4, 32), blocks=ATT_BLOCKS)


@pytest.mark.parametrize("paged,blk", [(False, 8), (True, 32)])
def test_the_kernel_writes_block_scores_as_it_reads_the_keys(paged, blk):
    # key blocks of 16: score blocks of 8 (two per key block) and of 32 (two key blocks each)
    _scores_as_read(True, paged, B=3, T=5, H=8, K=2, D=32, S=150, blk=blk, BS=8,
                    blocks=ATT_BLOCKS)


@pytest.mark.gpu
def test_the_kernel_writes_block_scores_as_it_reads_the_keys_on_the_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    for paged in (False, True):
        _scores_as_read(False, paged, B=6, T=5, H=12, K=2, D=128, S=5000, blk=64, BS=16,
                        blocks=None)


def _scores_as_read(interpret, paged, *, B, T, H, K, D, S, blk, BS, blocks):
    """A verification's block scores from the invariant kernel (its own pass over the keys):
    the output bits of the kernel without scores, and the scores of the reference
    (`block_max_reference`: the largest logit of any query over each block's context slots,
    -inf for a block without any), for a chain in both modes, a tree and a decode step, over a
    dense cache and a block pool."""
    from pallas_kernels.reference import block_max_reference
    rng = np.random.default_rng()
    L = jnp.asarray(rng.integers(1, S - T - 1, size=B).tolist()[:B - 1] + [0], jnp.int32)
    q = jnp.asarray(rng.normal(size=(B, T, H, D)), BF16)
    k = jnp.asarray(rng.normal(size=(2, B, K, S, D)), BF16)
    v = jnp.asarray(rng.normal(size=(2, B, K, S, D)), BF16)
    q = q.at[0].set(jnp.abs(q[0]))  # row 0: every logit negative (a padding row's 0 is not one)
    k = k.at[:, 0].set(-jnp.abs(k[:, 0]))
    tree = jnp.asarray(TokenTree.from_parents([-1, 0, 0, 1, 2]).ancestor_mask)
    if paged:  # the same slots in a shuffled pool of 8-slot pages
        MB = -(-S // BS)
        NB = B * MB + 2
        perm = rng.permutation(NB)[:B * MB].reshape(B, MB)
        kpad = jnp.pad(k, ((0, 0), (0, 0), (0, 0), (0, MB * BS - S), (0, 0)))
        vpad = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, MB * BS - S), (0, 0)))
        pool_k = jnp.full((2, NB, K, BS, D), jnp.nan, BF16)
        pool_v = jnp.full((2, NB, K, BS, D), jnp.nan, BF16)
        for b in range(B):
            pk = kpad[:, b].reshape(2, K, MB, BS, D).transpose(0, 2, 1, 3, 4)
            pv = vpad[:, b].reshape(2, K, MB, BS, D).transpose(0, 2, 1, 3, 4)
            pool_k = pool_k.at[:, perm[b]].set(pk)
            pool_v = pool_v.at[:, perm[b]].set(pv)
        kv, tab = (pool_k, pool_v), jnp.asarray(perm, jnp.int32)
        k = jnp.where(jnp.isnan(k), 0, k)
    else:
        kv, tab = (k, v), None
    for q_, T_, mask, mode in ((q, T, None, "split"), (q, T, None, "fold"), (q, T, tree, "auto"),
                               (q[:, -1:], T, None, "auto")):
        kw = dict(num_new=T_, sm_scale=None, sliding_window=None, interpret=interpret,
                  blocks=blocks, mode=mode, block_table=tab)
        plain = invariant._attention_tiles(q_, *kv, 1, L, mask, **kw)
        out, sc = invariant._attention_tiles(q_, *kv, 1, L, mask, score_block=blk, **kw)
        assert np.array_equal(np.asarray(out, np.float32), np.asarray(plain, np.float32)), mode
        want = np.asarray(block_max_reference(q_, k[1], L, block=blk))
        got = np.asarray(sc)[:, :, :want.shape[-1]]
        assert np.array_equal(np.isinf(got), np.isinf(want)), mode
        assert np.all(np.isneginf(np.asarray(sc)[:, :, want.shape[-1]:]))
        fin = np.isfinite(want)
        np.testing.assert_allclose(got[fin], want[fin], rtol=2e-5, atol=2e-5)


def test_page_sizes_the_kernel_reads_through_the_table():
    from pallas_kernels import invariant_attention as ia
    bk = ia.blocks_for(128, BF16).block_k
    assert all(ia.reads_pages(bs, 128, BF16) for bs in (1, 8, 16, bk, 2 * bk, 3 * bk))
    assert not ia.reads_pages(48, 128, BF16) and not ia.reads_pages(bk + 16, 128, BF16)
    q = jnp.zeros((1, 1, 2, 128), BF16)
    pool = jnp.zeros((1, 4, 1, 48, 128), BF16)
    with pytest.raises(ValueError, match="page size 48"):
        invariant._attention_tiles(q, pool, pool, 0, jnp.asarray([3]), None, num_new=1,
                                   sm_scale=None, sliding_window=None, interpret=True,
                                   block_table=jnp.zeros((1, 2), jnp.int32))


def test_the_kernel_reading_a_block_pool_lowers_for_cuda():
    """Pages of 16, 128 and 256 slots (whole pages per key block, one each, parts of one), a
    chain and a tree, in both modes, with and without block scores: Triton kernels, lowered
    for CUDA here."""
    B, T, H, K, D = 4, 5, 12, 2, 128
    q = jax.ShapeDtypeStruct((B, T, H, D), BF16)
    ln = jax.ShapeDtypeStruct((B,), jnp.int32)
    tree = jnp.asarray(TokenTree.from_parents([-1, 0, 0, 1, 2]).ancestor_mask)
    for BS in (16, 128, 256):
        MB = 4096 // BS
        pool = jax.ShapeDtypeStruct((2, B * MB, K, BS, D), BF16)
        tab = jax.ShapeDtypeStruct((B, MB), jnp.int32)
        for mode, mask, sb in (("fold", None, None), ("split", None, None), ("split", tree, None),
                               ("split", None, 64), ("fold", tree, 64)):
            f = jax.jit(lambda q, k, v, ln, t, mode=mode, mask=mask, sb=sb:
                        invariant._attention_tiles(
                            q, k, v, 1, ln, mask, num_new=T, sm_scale=None, sliding_window=None,
                            interpret=False, mode=mode, block_table=t, score_block=sb))
            txt = f.trace(q, pool, pool, ln, tab).lower(lowering_platforms=("cuda",)).as_text()
            assert "__gpu$xla.gpu.triton" in txt, (BS, mode)
            if BS == 16:  # and over a dense cache
                dense = jax.ShapeDtypeStruct((2, B, K, 4096, D), BF16)
                txt = f.trace(q, dense, dense, ln, None).lower(
                    lowering_platforms=("cuda",)).as_text()
                assert "__gpu$xla.gpu.triton" in txt, mode


@pytest.mark.gpu
def test_a_block_pool_read_through_its_table_gives_the_dense_bits_on_the_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    _pool_vs_dense(False, B=4, D=128, S=5000, page_sizes=(16, 128, 256))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["default", "base_e", "split_tiles4"])
def test_unmasked_interior_blocks_give_the_masked_bits_on_the_gpu(variant):
    """On a GPU the key blocks every real row sees run without the masks: the same bits as every
    block masked (decode, a verification of 5 with 2 tiles per program, a prefill chunk, a
    sliding window, a tree), and one-token steps still equal the other shapes."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    base = {"default": InvariantAttentionBlocks(),
            "base_e": InvariantAttentionBlocks(fast_exp=False),
            "split_tiles4": InvariantAttentionBlocks(split_tiles=4)}[variant]
    assert base.unmasked_interior
    _contiguous_vs_gathered(False, B=6, D=128, S=5120, blocks=base)
    masked = dataclasses.replace(base, unmasked_interior=False)
    rng = np.random.default_rng()
    B, S, D = 5, 6144, 128
    L = jnp.asarray(rng.integers(100, S - 80, size=B), jnp.int32)
    q = jnp.asarray(rng.normal(size=(B, 40, 12, D)), BF16)
    k = jnp.asarray(rng.normal(size=(1, B, 2, S, D)), BF16)
    v = jnp.asarray(rng.normal(size=(1, B, 2, S, D)), BF16)
    tree = jnp.asarray(TokenTree.from_parents([-1, 0, 0, 1, 2, 4]).ancestor_mask)
    for T, window, mask in ((1, None, None), (5, None, None), (40, None, None),
                            (5, 777, None), (6, None, tree)):
        for mode in ("fold", "split"):
            got = [np.asarray(invariant._attention_tiles(
                q[:, :T], k, v, 0, L, mask, num_new=T, sm_scale=None, sliding_window=window,
                interpret=False, mode=mode, blocks=b), np.float32) for b in (base, masked)]
            assert np.array_equal(*got), (T, window, mode)


# ----------------------------------------------------------------------------- the RMS norm kernel
@pytest.mark.parametrize("H,dtype", [(1536, BF16), (96, jnp.float32), (576, BF16)])
def test_invariant_norm_is_correct_and_row_invariant(H, dtype):
    """`pallas_kernels.invariant_norm` (in the interpreter) against `jaxspec.model.rms_norm`, and
    each row bitwise the same alone, at its place in batches of other sizes, and in a 3-d input."""
    from jaxspec.model import rms_norm
    from pallas_kernels.invariant_norm import invariant_rms_norm
    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=(37, H)) * 3, dtype)
    w = jnp.asarray(rng.normal(size=(H,)), dtype)
    got = invariant_rms_norm(x, w, eps=1e-6, interpret=True)
    want = rms_norm(x, w, 1e-6)
    assert got.dtype == want.dtype
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=tol, atol=tol)
    ref = np.asarray(got, np.float32)
    for lo, hi in ((5, 6), (0, 9), (30, 37), (3, 20)):
        part = np.asarray(invariant_rms_norm(x[lo:hi], w, eps=1e-6, interpret=True), np.float32)
        assert np.array_equal(part, ref[lo:hi]), (lo, hi)
    three = invariant_rms_norm(x[:36].reshape(4, 9, H), w, eps=1e-6, interpret=True)
    assert np.array_equal(np.asarray(three, np.float32).reshape(36, H), ref[:36])


def test_invariant_norm_lowers_for_cuda():
    from pallas_kernels.invariant_norm import invariant_rms_norm
    f = jax.jit(lambda x, w: invariant_rms_norm(x, w, eps=1e-6))
    txt = f.trace(jax.ShapeDtypeStruct((40, 1536), BF16), jax.ShapeDtypeStruct((1536,), BF16)
                  ).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in txt and "invariant_rms_norm" in txt


@pytest.mark.gpu
def test_invariant_norm_rows_on_the_gpu():
    """Compiled on a GPU: a row alone, in a decode step's batch, a verification's and a prefill
    chunk's rows gives the same bits, close to `jaxspec.model.rms_norm`."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    from jaxspec.model import rms_norm
    from pallas_kernels.invariant_norm import invariant_rms_norm
    rng = np.random.default_rng()
    for H in (1536, 128, 896):
        x = jnp.asarray(rng.normal(size=(4096, H)) * 3, BF16)
        w = jnp.asarray(rng.normal(size=(H,)), BF16)
        ref = np.asarray(invariant_rms_norm(x, w, eps=1e-6), np.float32)
        np.testing.assert_allclose(ref, np.asarray(rms_norm(x, w, 1e-6), np.float32),
                                   rtol=2e-2, atol=2e-2)
        for lo, hi in ((7, 8), (0, 64), (100, 420), (1000, 4096)):
            part = np.asarray(invariant_rms_norm(x[lo:hi], w, eps=1e-6), np.float32)
            assert np.array_equal(part, ref[lo:hi]), (H, lo, hi)


# ----------------------------------------------------------------------------- prompt rows' product
def test_prompt_matmul_kernel_in_the_interpreter():
    """`pallas_kernels.prompt_matmul` (Mosaic GPU, in its interpreter): the product, for M not a
    multiple of its 128-row tiles and each tiling of N (256 / 128 / 64 columns per program), a
    row the same alone and inside more rows, and the blocks and stages it plans."""
    from pallas_kernels import hopper
    from pallas_kernels import prompt_matmul as pm
    if not hopper.has_mosaic_gpu():
        pytest.skip("jax without Mosaic GPU")
    assert [pm.block_n_of(n) for n in (2048, 17920, 1536, 896, 192)] == [256, 256, 256, 128, 64]
    assert pm.stages_for(256) == 3 and pm.stages_for(128) == 4
    assert pm.supports(BF16, 1536, 8960) and not pm.supports(BF16, 100, 128)
    assert not pm.supports(jnp.float32, 128, 128)
    rng = np.random.default_rng()
    for M, K, N in ((130, 192, 256), (9, 64, 192)):
        x = jnp.asarray(rng.normal(size=(M, K)), BF16)
        w = jnp.asarray(rng.normal(size=(K, N)) / np.sqrt(K), BF16)
        ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        got = pm.prompt_matmul(x, w, out_dtype=jnp.float32, interpret=True,
                               block_sizes=pm.PromptMatmulBlocks(stages=2))
        assert got.shape == (M, N) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)
        one = pm.prompt_matmul(x[M - 1:], w, out_dtype=jnp.float32, interpret=True,
                               block_sizes=pm.PromptMatmulBlocks(stages=2))
        assert np.array_equal(np.asarray(one)[0], np.asarray(got)[M - 1])
        # two programs taking every other tile (the ring runs on across tiles): the same bits
        two = pm.prompt_matmul(x, w, out_dtype=jnp.float32, interpret=True,
                               block_sizes=pm.PromptMatmulBlocks(stages=2, programs=2,
                                                                 block_n=64))
        assert np.array_equal(np.asarray(two), np.asarray(got))
    with pytest.raises(ValueError, match="multiples of 64"):
        pm.prompt_matmul(jnp.zeros((8, 100), BF16), jnp.zeros((100, 64), BF16), interpret=True)
    with pytest.raises(ValueError, match="block_n"):
        pm.PromptMatmulBlocks(block_n=96)


@pytest.mark.gpu
def test_prompt_matmul_rows_on_the_gpu():
    """Compiled on a Hopper GPU: every row of the prompt rows' product gives the same bits alone,
    in 7, 100, 1000 rows and in 4096 (at the start, middle and end), close to XLA's product;
    and `jaxspec.invariant.prompt_matmul` takes it there."""
    from pallas_kernels import prompt_matmul as pm
    if not pm.available():
        pytest.skip("needs an NVIDIA Hopper GPU")
    assert invariant.prompt_product("invariant", BF16, 1536, 2048) == "hopper"
    rng = np.random.default_rng()
    f = jax.jit(lambda x, w: pm.prompt_matmul(x, w))
    for K, N in ((1536, 2048), (8960, 1536), (896, 4864)):
        x = jnp.asarray(rng.normal(size=(4096, K)), BF16)
        w = jnp.asarray(rng.normal(size=(K, N)) / np.sqrt(K), BF16)
        ref = np.asarray(f(x, w), np.float32)
        np.testing.assert_allclose(ref, np.asarray(jnp.dot(x, w), np.float32), rtol=2e-2,
                                   atol=2e-2)
        for m in (1, 7, 100, 1000):
            for lo in sorted({0, (4096 - m) // 2 + 3, 4096 - m}):
                part = np.asarray(f(x[lo:lo + m], w), np.float32)
                assert np.array_equal(part, ref[lo:lo + m]), (K, N, m, lo)


def test_the_attention_blocks_fit_shared_memory_and_depend_on_the_model_only():
    """`blocks_for`: the largest block of keys (at most the default's) whose K/V pipeline
    stages and query tile fit the Triton kernels' shared memory, from head dim and dtype only."""
    from pallas_kernels.common import TRITON_SMEM_BYTES
    from pallas_kernels.invariant_attention import DEFAULT_BLOCKS, blocks_for
    for D in (16, 64, 128, 256, 512):
        for dtype in (BF16, jnp.float32):
            bs = blocks_for(D, dtype)
            size = lambda bk: ((2 * bk * bs.num_stages + bs.block_rows) * D  # noqa: E731
                               * jnp.dtype(dtype).itemsize)
            assert bs.chunk % bs.block_k == 0 and bs.block_k >= 16
            assert size(bs.block_k) <= TRITON_SMEM_BYTES or bs.block_k == 16, (D, dtype)
            if bs.block_k < DEFAULT_BLOCKS.block_k:
                assert size(2 * bs.block_k) > TRITON_SMEM_BYTES, (D, dtype)
            assert dataclasses.replace(bs, block_k=DEFAULT_BLOCKS.block_k) == DEFAULT_BLOCKS
    assert blocks_for(128, BF16).block_k == 128 and blocks_for(256, BF16).block_k == 64
