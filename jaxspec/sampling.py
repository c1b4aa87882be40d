"""Per-row sampling settings, the filtered next-token distribution, and categorical draws.

Everything here is a pure, jit-able function of arrays with static shapes. Settings are
per row (``[B]`` arrays), so one compiled decode loop serves requests with different
temperatures / top-k / top-p. Three static switches: ``SamplingParams.filtering``: when it is
``False`` no row uses top-k or top-p and no sort over the vocabulary is traced;
``SamplingParams.stochastic``: when it is ``False`` every row is greedy and a step takes one
argmax over the vocabulary (no softmax, no draw); and ``SamplingParams.invariant``: every sum
over the vocabulary in a fixed order (`jaxspec.invariant`), for batch-invariant decoding.

Conventions (relied on by :mod:`jaxspec.verify`):

* ``temperature <= 0`` means greedy. Such rows get the *one-hot of argmax* (first index on
  ties, exactly ``jnp.argmax``), so greedy is literally the temperature-0 limit and
  speculative *sampling* with one-hot ``p`` and ``q`` reduces to greedy verification.
* top-k keeps exactly ``k`` tokens; top-p (nucleus) keeps the smallest set of
  highest-probability tokens whose mass is ``>= top_p``, measured on the distribution left
  by top-k (top-k first, then top-p, as Hugging Face does). Ties in the ranking are broken
  deterministically: equal logits are ranked by increasing token index.
  ``top_k <= 0`` or ``top_k >= V`` and ``top_p >= 1`` mean "off".
"""

from __future__ import annotations

import contextlib
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import invariant as _inv

Array = jax.Array

__all__ = [
    "SamplingParams",
    "probs_from_logits",
    "sample",
    "categorical",
    "sample_children",
    "draft_children",
]


@flax.struct.dataclass
class SamplingParams:
    """Per-row sampling settings (a pytree of ``[B]`` arrays + one static flag).

    Attributes:
      temperature: ``[B] float32``; ``<= 0`` is greedy.
      top_k: ``[B] int32``; ``0`` (or ``>= V``) is off.
      top_p: ``[B] float32``; ``1.0`` is off.
      filtering: static (part of the tree structure, so a change recompiles). ``False``
        promises that no row uses top-k / top-p: the vocabulary sort is skipped and
        ``top_k`` / ``top_p`` are ignored.
      stochastic: static. ``False`` promises that every row is greedy (``temperature`` is
        then ignored): tokens are one argmax of the logits, and the softmax over the
        vocabulary and the draw are not traced (at batch 64 and a 152k vocabulary they cost
        about 2% of a 1.5B model's decode step).
      invariant: static. ``True``: every sum over the vocabulary (the softmax's and
        log-softmax's normalisation, top-p's cumulative mass, the inverse CDF of a draw) is a
        fixed tree or scan of elementwise adds (`jaxspec.invariant.fixed_sum`,
        `jaxspec.invariant.fixed_cumsum`), so a row's distribution and draw are bitwise the
        same whatever the other rows and the batch size are (batch-invariant decoding sets
        it). ``False``: XLA's own reductions (faster).
    """

    temperature: Array
    top_k: Array
    top_p: Array
    filtering: bool = flax.struct.field(pytree_node=False, default=True)
    stochastic: bool = flax.struct.field(pytree_node=False, default=True)
    invariant: bool = flax.struct.field(pytree_node=False, default=False)

    @classmethod
    def make(
        cls,
        batch_size: int,
        temperature: Any = 1.0,
        top_k: Any = 0,
        top_p: Any = 1.0,
        filtering: bool | None = None,
        stochastic: bool | None = None,
        invariant: bool = False,
    ) -> "SamplingParams":
        """Broadcasts scalars or ``[B]`` values to ``[B]`` arrays.

        ``filtering=None`` decides from the values when they are concrete (any
        ``top_k > 0`` or ``top_p < 1``) and is ``True`` for traced values. Passing
        ``filtering=False`` with concrete values that do ask for filtering is an error.
        ``stochastic`` likewise: ``None`` is ``False`` for concrete temperatures that are all
        ``<= 0`` (every row greedy), else ``True``; ``False`` with a concrete temperature
        ``> 0`` is an error.
        """
        t = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (batch_size,))
        k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (batch_size,))
        p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (batch_size,))
        wants = _concrete_wants_filtering(top_k, top_p)
        if filtering is None:
            filtering = True if wants is None else wants
        elif not filtering and wants:
            raise ValueError(
                "filtering=False but some row asks for top-k / top-p "
                f"(top_k={top_k!r}, top_p={top_p!r})"
            )
        samples = _concrete_samples(temperature)
        if stochastic is None:
            stochastic = True if samples is None else samples
        elif not stochastic and samples:
            raise ValueError(f"stochastic=False but some row samples (temperature={temperature!r})")
        return cls(temperature=t, top_k=k, top_p=p, filtering=bool(filtering),
                   stochastic=bool(stochastic), invariant=bool(invariant))

    @classmethod
    def greedy(cls, batch_size: int) -> "SamplingParams":
        return cls.make(batch_size, temperature=0.0, filtering=False, stochastic=False)

    @property
    def is_greedy(self) -> Array:
        """``[B] bool``: rows that decode greedily."""
        return self.temperature <= 0


def key_from_seed(seed) -> Array:
    """``jax.random.PRNGKey(seed)`` for any Python int. Without x64, JAX keeps only the low 32
    bits of a seed (seed ``2**32 + 5`` gave the samples of seed 5) and raises OverflowError from
    ``2**63`` on. Seeds in ``[-2**31, 2**32)`` keep their usual key; for others the higher 32-bit
    words (and the sign) are folded into the key of the low word."""
    seed = int(seed)
    lo = seed & 0xFFFFFFFF
    key = jax.random.PRNGKey(lo)
    if -(2 ** 31) <= seed < 2 ** 32:
        return key
    rest = seed >> 32
    while rest not in (0, -1):
        key = jax.random.fold_in(key, rest & 0xFFFFFFFF)
        rest >>= 32
    return jax.random.fold_in(key, 1 if seed < 0 else 0)


def _concrete(*settings: Any) -> list[np.ndarray] | None:
    """The settings as numpy arrays when all are concrete; None when any is traced."""
    try:
        arrays = [np.asarray(x) for x in settings]
    except Exception:  # tracers
        return None
    return None if any(a.dtype == object for a in arrays) else arrays


def _concrete_wants_filtering(top_k: Any, top_p: Any) -> bool | None:
    kp = _concrete(top_k, top_p)
    return None if kp is None else bool(np.any(kp[0] > 0) or np.any(kp[1] < 1.0))


def _concrete_samples(temperature: Any) -> bool | None:
    """Whether some row samples (a concrete temperature > 0); None for traced values."""
    t = _concrete(temperature)
    return None if t is None else bool(np.any(t[0] > 0))


def _per_row(a: Array, ndim: int) -> Array:
    """Reshapes a ``[B]`` (or scalar) setting to broadcast against ``[B, ..., V]``."""
    a = jnp.asarray(a)
    return a.reshape(a.shape + (1,) * (ndim - a.ndim))


def row_sum(x: Array, axis: int = -1, keepdims: bool = False, invariant: bool = False) -> Array:
    """``sum(x, axis)``: `jaxspec.invariant.fixed_sum` when ``invariant`` (batch-invariant
    decoding), else XLA's reduction."""
    if invariant:
        return _inv.fixed_sum(x, axis, keepdims=keepdims)
    return jnp.sum(x, axis=axis, keepdims=keepdims)


def _cumsum(x: Array, axis: int = -1, inv: bool = False) -> Array:
    """``cumsum(x, axis)``: `jaxspec.invariant.fixed_cumsum` when ``inv``, else XLA's."""
    return _inv.fixed_cumsum(x, axis) if inv else jnp.cumsum(x, axis=axis)


def _filter_mask(x: Array, top_k: Array, top_p: Array, inv: bool = False,
                 rank_by: Array | None = None) -> Array:
    """Tokens kept by top-k then top-p, for scaled logits ``x[..., V]`` (f32).

    One stable sort by (-r, index), ``r = rank_by`` (the unscaled logits: dividing by a
    large temperature can round distinct logits to one value, or flush them to zero, and the
    ranking must not change with the temperature) or ``x``. The kept set is a prefix of that
    order, so it is described by its last element (value v*, index i*): token j is kept iff
    ``r_j > v*`` or (``r_j == v*`` and ``j <= i*``); no scatter back is needed.
    """
    V = x.shape[-1]
    r = x if rank_by is None else rank_by
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    neg_r, perm, xs = jax.lax.sort((-r, iota, x), dimension=x.ndim - 1, is_stable=True,
                                   num_keys=1)
    rs = -neg_r  # non-increasing, and so is xs (x is a non-decreasing function of r)
    if inv:
        lse = _inv.fixed_logsumexp(x, -1, keepdims=True)
    else:
        lse = jax.nn.logsumexp(x, axis=-1, keepdims=True)
    ps = jnp.exp(xs - lse)  # sorted probabilities, non-increasing
    cum = _cumsum(ps, -1, inv)
    k = jnp.where((top_k > 0) & (top_k < V), top_k, V)  # [..., 1]
    mass_k = jnp.take_along_axis(cum, k - 1, axis=-1)  # mass kept by top-k
    rank = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    excl = cum - ps  # mass strictly before each rank
    keep_p = (top_p >= 1.0) | (excl < top_p * mass_k)
    keep_rank = (rank < k) & keep_p  # a prefix of the ranking
    n_keep = jnp.maximum(jnp.sum(keep_rank, axis=-1, keepdims=True), 1)
    v_last = jnp.take_along_axis(rs, n_keep - 1, axis=-1)
    i_last = jnp.take_along_axis(perm, n_keep - 1, axis=-1)
    return (r > v_last) | ((r == v_last) & (iota <= i_last))


def probs_from_logits(logits: Array, params: SamplingParams) -> Array:
    """The next-token distribution ``[..., V] float32`` after temperature / top-k / top-p.

    ``logits`` is ``[B, V]`` or ``[B, T, V]`` (any leading dims after B); the ``[B]``
    settings broadcast over the leading axis. Greedy rows (temperature <= 0) get the
    one-hot of ``argmax(logits)``.
    """
    if not params.stochastic:  # every row greedy
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    x = logits.astype(jnp.float32)
    nd = x.ndim
    temp = _per_row(params.temperature, nd).astype(jnp.float32)
    greedy = temp <= 0
    # the row maximum subtracted before the temperature divides: the largest scaled logit is
    # then exactly 0 however XLA rounds the division where it recomputes it (a tiny temperature
    # scales logits past 1e9, where two roundings of ``x / temp`` differ by more than exp can
    # take: exp(+ulp) = inf and the softmax NaN)
    xr = x - jnp.max(x, axis=-1, keepdims=True)
    x = xr / jnp.where(greedy, 1.0, temp)
    if params.filtering:
        keep = _filter_mask(
            x, _per_row(params.top_k, nd).astype(jnp.int32), _per_row(params.top_p, nd).astype(jnp.float32),
            params.invariant, rank_by=xr,
        )
        x = jnp.where(keep, x, -jnp.inf)
    probs = _inv.fixed_softmax(x, -1) if params.invariant else jax.nn.softmax(x, axis=-1)
    onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), x.shape[-1], dtype=jnp.float32)
    return jnp.where(greedy, onehot, probs)


# --------------------------------------------------------------------------- draws

_BLOCK = 1024  # two-level inverse CDF above this vocabulary size (keeps cumsum error small)


def _first_above(cdf: Array, probs: Array, t: Array) -> Array:
    """Smallest index j with ``cdf_j > t`` and ``probs_j > 0`` (zero-probability tokens are
    never returned); if rounding leaves none, the last index with positive probability.

    ``cdf``/``probs``: ``[..., V]``; ``t``: ``[..., S]`` -> ``[..., S] int32``.
    """
    V = cdf.shape[-1]
    pos = probs > 0
    hit = (cdf[..., None, :] > t[..., :, None]) & pos[..., None, :]
    first = jnp.argmax(hit, axis=-1).astype(jnp.int32)
    last_pos = (V - 1 - jnp.argmax(pos[..., ::-1], axis=-1)).astype(jnp.int32)
    return jnp.where(jnp.any(hit, axis=-1), first, last_pos[..., None])


def categorical(rng: Array, probs: Array, num: int | None = None, *,
                invariant: bool = False) -> Array:
    """Draws from (unnormalized, non-negative) ``probs[..., V]`` by inverse CDF.

    Returns ``[...]`` int32, or ``[..., num]`` independent draws (with replacement) when
    ``num`` is given. Exact for one-hot rows (the single positive token is always returned);
    tokens of probability 0 are never returned. For large V the CDF is two-level (blocks of
    1024, so the float32 cumsum error stays ~1e-7), with one uniform for the block and another
    for the token inside it; up to 1024 tokens, one uniform per draw. ``invariant``:
    the sums and cumulative sums are fixed trees / scans of adds (`SamplingParams.invariant`).
    """
    probs = probs.astype(jnp.float32)
    V = probs.shape[-1]
    lead = probs.shape[:-1]
    S = 1 if num is None else num
    if V <= _BLOCK:
        u = jax.random.uniform(rng, lead + (S,), jnp.float32)
        cdf = _cumsum(probs, -1, invariant)
        out = _first_above(cdf, probs, u * cdf[..., -1:])
    else:
        # one uniform picks the block, a second one (independent) the token inside it: a
        # float32 uniform has only 2^23 values, so reusing the first one inside a block left
        # every token below ~2^-23 of the total mass quantized (a third of a 152k
        # vocabulary could never be drawn at T=1: TV ~3e-3 per token)
        k_blk, k_in = jax.random.split(rng)
        u = jax.random.uniform(k_blk, lead + (S,), jnp.float32)
        nb = -(-V // _BLOCK)
        pb = jnp.pad(probs, [(0, 0)] * len(lead) + [(0, nb * _BLOCK - V)]).reshape(lead + (nb, _BLOCK))
        bsum = row_sum(pb, -1, invariant=invariant)  # [..., nb]
        bcdf = _cumsum(bsum, -1, invariant)
        t = u * bcdf[..., -1:]  # [..., S]
        blk = _first_above(bcdf, bsum, t)  # [..., S]
        inner = jnp.take_along_axis(pb, blk[..., None], axis=-2)  # [..., S, BLOCK]
        icdf = _cumsum(inner, -1, invariant)
        u_in = jax.random.uniform(k_in, lead + (S,), jnp.float32)
        j = _first_above(icdf, inner, (u_in * icdf[..., -1])[..., None])[..., 0]
        out = blk * _BLOCK + j
    return out[..., 0] if num is None else out


def sample(rng: Array, logits: Array, params: SamplingParams) -> Array:
    """One token per row (``[B]`` or ``[B, T]``): exact argmax for greedy rows, a draw from
    :func:`probs_from_logits` otherwise."""
    if not params.stochastic:  # every row greedy: one argmax, no softmax and no draw
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    probs = probs_from_logits(logits, params)
    drawn = categorical(rng, probs, invariant=params.invariant)
    greedy = _per_row(params.temperature, logits.ndim - 1) <= 0
    return jnp.where(greedy, jnp.argmax(logits, axis=-1).astype(jnp.int32), drawn)


def sample_children(rng: Array, probs: Array, k: int, *, replacement: bool,
                    invariant: bool = False) -> Array:
    """``k`` child tokens per row of ``probs[..., V]`` for tree drafting -> ``[..., k]``.

    * ``replacement=True``: ``k`` independent draws (verify with ``mode="iid"``).
    * ``replacement=False``: a sequential draw *without replacement* in draw order (child
      r is drawn from ``probs`` with children 0..r-1 removed, renormalized), by the
      Gumbel-top-k trick: the order of ``log q + Gumbel`` keys is exactly that sequential
      process. If a row has fewer than ``k`` positive-probability tokens, the surplus
      children are zero-probability fillers, which the verifier (``mode=
      "without_replacement"``) then treats as deterministic proposals; that is still exact.
    """
    if replacement:
        return categorical(rng, probs, num=k, invariant=invariant)
    logq = jnp.log(probs.astype(jnp.float32))
    g = jax.random.gumbel(rng, probs.shape, jnp.float32)
    _, idx = jax.lax.top_k(logq + g, k)
    return idx.astype(jnp.int32)


def draft_children(
    rng: Array, draft_logits: Array, params: SamplingParams, k: int, mode: str
) -> tuple[Array, Array]:
    """Children of tree nodes for one draft level, and the q to pass to ``verify_tree``.

    ``draft_logits``: ``[B, ..., V]`` draft outputs at the nodes of one level. Returns
    ``(children[B, ..., k] int32, q[B, ..., V] float32)`` with
    ``q = probs_from_logits(draft_logits, params)``; put ``q`` in row i of ``draft_probs``
    for node i and the children, in order, at ranks 0..k-1 below it.

    * ``mode="iid"``: k independent draws from q.
    * ``mode="without_replacement"``: Gumbel-top-k of q (a draw without replacement, in order).
    * ``mode="deterministic"``: the k highest draft logits (= the top of q, in q's order,
      while q has that many positive tokens; lowest index on ties).

    Greedy rows (temperature 0) always get the top-k of the raw draft logits, whatever the
    mode: their target p is one-hot, so any proposals verify exactly (a child is accepted
    iff it is the target argmax), and the draft's k best guesses accept most often.
    """
    q = probs_from_logits(draft_logits, params)
    best = jax.lax.top_k(draft_logits.astype(jnp.float32), k)[1].astype(jnp.int32)
    if mode == "iid":
        kids = sample_children(rng, q, k, replacement=True, invariant=params.invariant)
    elif mode == "without_replacement":
        kids = sample_children(rng, q, k, replacement=False)
    elif mode == "deterministic":
        return best, q
    else:
        raise ValueError(f"unknown mode {mode!r}")
    greedy = _per_row(params.temperature, kids.ndim) <= 0
    return jnp.where(greedy, best, kids), q


# --------------------------------------------------------------------------- per-row keys
# Every row of a batch draws with its own key (``keys[B, 2]``), so a row's samples depend on its
# own seed and position only, never on which other rows share the batch.


def row_keys(seed, rows: int, first: int = 0) -> Array:
    """``[rows, 2]`` keys: row i gets ``fold_in(key_from_seed(seed), first + i)``."""
    base = key_from_seed(seed)
    idx = jnp.arange(first, first + rows, dtype=jnp.uint32)
    return jax.vmap(lambda i: jax.random.fold_in(base, i))(idx)


@jax.jit
def _folded_keys(lo, first, then, refold):
    def one(seed, i, j, again):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), i)
        return jnp.where(again, jax.random.fold_in(key, j), key)
    return jax.vmap(one)(lo, first, then, refold)


def _host_device():
    """The CPU device where this jax has one beside the accelerator (None: the default device)."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:  # e.g. JAX_PLATFORMS=cuda
        return None


def start_keys(seeds, firsts, refolds=None, size: int | None = None) -> np.ndarray:
    """``[n, 2]`` uint32 keys on the host, one per sequence a server starts: row i's is
    ``row_keys(seeds[i], 1, first=firsts[i])[0]``, folded once more with ``refolds[i]`` where
    that is not None. One compiled call for all of them (eager key arithmetic costs about a
    millisecond per key on a GPU, while the device waits for the rows to start), on the CPU
    where there is one (it does not queue behind the accelerator's work), over ``size`` rows
    (at least n; one compiled shape for any number of sequences)."""
    n = len(seeds)
    refolds = [None] * n if refolds is None else list(refolds)
    if not n:
        return np.zeros((0, 2), np.uint32)
    size = max(n, int(size or n))
    pad = [0] * (size - n)
    plain = [-(2 ** 31) <= int(s) < 2 ** 32 for s in seeds]  # (key_from_seed: PRNGKey(lo))
    args = (np.asarray([int(s) & 0xFFFFFFFF for s in seeds] + pad, np.uint32),
            np.asarray(list(firsts) + pad, np.uint32),
            np.asarray([r or 0 for r in refolds] + pad, np.uint32),
            np.asarray([r is not None for r in refolds] + [False] * len(pad)))
    device = _host_device()
    with contextlib.nullcontext() if device is None else jax.default_device(device):
        out = np.array(_folded_keys(*args), np.uint32)[:n]
    for i in (i for i in range(n) if not plain[i]):  # seeds past 32 bits: the slow path
        key = row_keys(seeds[i], 1, first=int(firsts[i]))[0]
        if refolds[i] is not None:
            key = jax.random.fold_in(key, int(refolds[i]))
        out[i] = np.asarray(key, np.uint32)
    return out


def split_rows(keys: Array, num: int = 2) -> tuple[Array, ...]:
    """Splits every row's key: ``num`` arrays of ``[B, 2]`` keys."""
    out = jax.vmap(lambda k: jax.random.split(k, num))(keys)  # [B, num, 2]
    return tuple(out[:, i] for i in range(num))


def rowwise(fn, keys: Array, *args):
    """``fn(key, *row_args)`` for every row, each row seeing a batch of one (``args`` are pytrees of
    ``[B, ...]`` arrays, e.g. `SamplingParams`); outputs are stacked back to ``[B, ...]``."""
    def one(k, *a):
        a = jax.tree_util.tree_map(lambda x: x[None], a)
        return jax.tree_util.tree_map(lambda x: x[0], fn(k, *a))
    return jax.vmap(one)(keys, *args)


def sample_rows(keys: Array, logits: Array, params: SamplingParams) -> Array:
    """`sample` with one key per row."""
    if not params.stochastic:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return rowwise(sample, keys, logits, params)


def categorical_rows(keys: Array, probs: Array, *, invariant: bool = False) -> Array:
    """`categorical` with one key per row: ``probs[B, ..., V] -> [B, ...]``."""
    return rowwise(lambda k, p: categorical(k, p, invariant=invariant), keys, probs)


def seeded_row_keys(seeds, rows_per_seed: int = 1) -> Array:
    """``[len(seeds) * rows_per_seed, 2]`` keys, seed-major: row ``i * rows_per_seed + j`` gets
    ``fold_in(key_from_seed(seeds[i]), j)``. A request's keys depend on its own seed only (not on
    its row): ``seeded_row_keys([s], n)`` is ``row_keys(s, n)``, the keys of one prompt's ``n``
    samples with ``seed=s``."""
    return jnp.concatenate([row_keys(s, rows_per_seed) for s in seeds], axis=0)


def position_keys(keys: Array, positions: Array) -> Array:
    """``[B, 2]``: ``fold_in(keys[b], positions[b])`` per row: the key of a row's draws at one
    position, a function of the row's key and the position alone (batch-invariant decoding
    draws with these instead of splitting the row's key every round)."""
    return jax.vmap(jax.random.fold_in)(keys, positions.astype(jnp.uint32))
