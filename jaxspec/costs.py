"""The cost model that decides when speculation pays, held by whoever decodes (`jaxspec.session`).

A decode forward of T new tokens per row over ``n`` running rows whose contexts add up to ``C``
keys reads the weights once and ``C`` keys' K/V, and does ``2 N n T`` FLOPs in its matrix products
plus ``4 T C H Dh L`` in attention. Its time is predicted from the roofline of measured device
rates (copy bandwidth and matmul rate, measured once per cost model with a short device benchmark):
``max(bytes / bandwidth, flops / rate)``. A self-speculation draft step reads only the sink +
window keys of each row; a separate draft model its own weights and cache.

Predictions are corrected online: every timed stretch of plain steps or speculative rounds
(`observe`) is kept per kind, and a kind's time per round is fitted as ``scale x roofline +
fixed`` to its recent stretches (`_Fit`). The fixed part is what a forward costs whatever it reads
(hundreds of small kernels, each with its own latency): it is what makes a round of a few rows
cost far more than its bytes, so a single ratio learned on full batches would price the last
rows of a batch wrongly. Until a kind has been timed at two different sizes, its fixed part is
taken from a kind that has (per forward), else it is zero. The model thereby converges on what
this device, model and batch actually cost, and keeps it across calls. The acceptance of drafts
(per token, for the gamma choice) is learned the same way; within a call each row's own running
acceptance is used (`expected_row_tokens`).

Decisions (lossless whichever way they go: every round commits tokens with exactly the target's
distribution, and a decision depends only on the past):

- `choose_gamma`: MagicDec's cost model, speedup(g) = E[tokens](alpha, g) t_plain /
  (g t_draft + t_verify(g + 1)); 0 (plain decoding) unless some g is predicted `AUTO_MARGIN`
  faster, and the previous choice is kept unless another is `HYSTERESIS` better (each gamma is
  its own compiled loop).
- `speculation_pays`: for the rows still running, whether a round commits tokens faster than plain
  steps would.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.cache import kv_bytes_per_token

PRIOR_ACCEPTANCE = 0.6  # per-token acceptance assumed before any speculative round was observed
AUTO_MARGIN = 1.05  # speculate only where a speedup of at least this is predicted
HYSTERESIS = 1.05  # keep the previous gamma unless another is predicted this much faster
# A speculative round's time over its roofline prediction, relative to a plain step's, until a
# round has been timed (a draft step runs further from its floor than a plain step: more, smaller
# kernels per byte; measured 1.3-1.4x on H100s at batch 64).
PRIOR_ROUND_FACTOR = 1.35
FIT_DECAY = 0.85  # weight of a timed stretch per newer one of its kind (older costs fade)
FIT_KEEP = 32  # timed stretches kept per kind
FIT_SPREAD = 1.3  # roofline ratio between a kind's stretches that lets its fixed cost be fitted
# A forward's bytes take at least this x their roofline (which is priced at the measured copy
# bandwidth: a read-only forward measured down to ~0.94x it on H100s): a fixed part borrowed from
# another kind never brings a kind's scale below it.
FIT_MIN_SCALE = 0.9
PRIOR_WEIGHT = 2.0  # rounds of evidence the prior acceptance weighs in a row's estimate
# Before any draft was ever accepted or rejected, speculation is tried for a short stretch where it
# would pay at this acceptance (a typical one of a good draft): the prior alone would never try
# it at moderate sizes, and so never learn the acceptance that decides.
EXPLORE_ACCEPTANCE = 0.8


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens committed per round of a chain of ``gamma`` drafts (i.i.d. acceptance)."""
    return float(sum(alpha ** i for i in range(gamma + 1)))


def per_token_acceptance(accepted_per_round: float, gamma: int) -> float:
    """Solves ``sum_{i=1..gamma} a^i = accepted_per_round`` for the per-token acceptance a."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(1, gamma + 1)) < accepted_per_round:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


_MEASURED: dict = {}  # (backend, dtype) -> DeviceRates


@dataclasses.dataclass(frozen=True)
class DeviceRates:
    bandwidth: float  # bytes / s (device copy, bytes read + written)
    matmul: float  # FLOP / s (large matrix product in the model's dtype)
    overhead: float  # s per forward not explained by either (launches, host)

    @classmethod
    def measure(cls, dtype=jnp.bfloat16) -> "DeviceRates":
        """A short device benchmark: a copy of a large buffer and a large matrix product, the
        median of a few timed calls each after a warm-up. Measured once per process, backend
        and dtype (these are facts of the hardware)."""
        key = (jax.default_backend(), str(jnp.dtype(dtype)))
        hit = _MEASURED.get(key)
        if hit is None:
            hit = _MEASURED[key] = cls._measure(dtype)
        return hit

    @classmethod
    def _measure(cls, dtype) -> "DeviceRates":
        on_cpu = jax.default_backend() == "cpu"
        n_copy = (1 << 22) if on_cpu else (1 << 30)  # elements
        m = 512 if on_cpu else 8192
        reps = 2 if on_cpu else 8  # passes inside one call: the dispatch is amortized
        dt = jnp.float32 if on_cpu else dtype

        @functools.partial(jax.jit, donate_argnums=0)
        def copies(x):  # each pass reads and writes the whole buffer
            return jax.lax.fori_loop(0, reps, lambda i, y: y * 1.0001 + i, x)

        @jax.jit
        def matmuls(a):
            return jax.lax.fori_loop(0, reps, lambda i, b: (b @ a).astype(a.dtype), a)

        def timed(f, arg, donate):
            arg = f(arg) if donate else (f(arg), arg)[1]
            jax.block_until_ready(arg)
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                out = f(arg)
                jax.block_until_ready(out)
                ts.append(time.perf_counter() - t)
                if donate:
                    arg = out
            return float(np.median(ts))

        t_copy = timed(copies, jnp.ones((n_copy,), dt), True)
        t_mm = timed(matmuls, jnp.full((m, m), 1.0 / m, dt), False)
        bw = reps * 2 * n_copy * jnp.dtype(dt).itemsize / t_copy
        rate = reps * 2.0 * m ** 3 / t_mm
        return cls(bandwidth=bw, matmul=rate, overhead=0.0)


def _param_bytes(params) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params)))


def _param_count(params) -> int:
    return int(sum(x.size for x in jax.tree_util.tree_leaves(params)))


@dataclasses.dataclass
class _Forward:
    """Roofline terms of one model's decode forward."""

    weight_bytes: float
    kv_bytes: float  # per context key read
    params: float  # parameter count (2 FLOPs each per token)
    attn_flops: float  # per (token, context key): 4 H Dh L

    @classmethod
    def of(cls, model) -> "_Forward":
        c = model.config
        return cls(weight_bytes=_param_bytes(model.params),
                   kv_bytes=kv_bytes_per_token(c, model.dtype),
                   params=_param_count(model.params),
                   attn_flops=4.0 * c.num_heads * c.head_dim * c.num_layers)

    def time(self, rates: DeviceRates, rows: float, keys: float, T: float) -> float:
        """One forward of T tokens per row for ``rows`` rows reading ``keys`` context keys in
        all."""
        b = self.weight_bytes + self.kv_bytes * keys
        f = 2.0 * self.params * rows * T + self.attn_flops * T * keys
        return max(b / rates.bandwidth, f / rates.matmul) + rates.overhead


class _Fit:
    """Seconds per round of one kind against its roofline: ``scale x roofline + fixed``, fitted by
    weighted least squares to the kept stretches (newer ones weigh more)."""

    def __init__(self):
        self.obs: list[tuple[float, float, float]] = []  # (roofline, seconds, rounds) per round

    def add(self, roofline: float, seconds: float, rounds: float):
        self.obs.append((roofline, seconds, rounds))
        del self.obs[:-FIT_KEEP]

    def _weighted(self):
        n = len(self.obs)
        x = np.array([o[0] for o in self.obs])
        y = np.array([o[1] for o in self.obs])
        w = np.array([np.sqrt(o[2]) for o in self.obs]) * FIT_DECAY ** np.arange(n - 1, -1, -1)
        return x, y, w

    def affine(self) -> tuple[float, float] | None:
        """(scale, fixed) where the stretches span rooflines enough to tell them apart, else
        None."""
        x, y, w = self._weighted()
        if len(x) < 2 or x.max() < FIT_SPREAD * x.min():
            return None
        W = w.sum()
        mx, my = (w * x).sum() / W, (w * y).sum() / W
        vx = (w * (x - mx) ** 2).sum()
        scale = (w * (x - mx) * (y - my)).sum() / vx
        fixed = my - scale * mx
        if scale <= 0 or fixed < 0:  # noise or no fixed part: a ratio fits as well
            return None
        return float(scale), float(fixed)

    def predict(self, roofline: float, fixed: float = 0.0) -> float:
        """Seconds of a round whose roofline is ``roofline``; ``fixed``: the fixed part to assume
        where this kind's own stretches cannot tell it (another kind's, per forward): never so
        much that the rest would read faster than `FIT_MIN_SCALE` x the roofline."""
        fit = self.affine()
        if fit is None:
            x, y, w = self._weighted()
            f = np.clip(y - FIT_MIN_SCALE * x, 0.0, fixed)
            scale = float((w * (y - f) / x).sum() / w.sum())
            return scale * roofline + float((w * f).sum() / w.sum())
        scale, c = fit
        return scale * roofline + c

    def scale(self) -> float:
        """Measured / roofline at the latest stretches' size."""
        x, y, w = self._weighted()
        return float((w * y / x).sum() / w.sum())


class CostModel:
    """Predicted and measured costs of plain steps and speculative rounds for one target model
    and drafter (see the module docstring). ``rates``: device rates (measured on first use when
    None)."""

    def __init__(self, model, draft_model=None, *, span: int | None = None,
                 rates: DeviceRates | None = None):
        self._target = _Forward.of(model)
        self._draft = _Forward.of(draft_model) if draft_model is not None else self._target
        self.self_draft = draft_model is None
        self.span = span  # context keys a draft step reads per row (None: all)
        self.dtype = model.dtype
        self._rates = rates
        self.fits: dict = {}  # kind ("plain" or ("round", levels, nodes)) -> _Fit
        self.alpha: float | None = None  # learned per-token acceptance
        self.gamma: int | None = None  # last choice of choose_gamma
        # seconds a decode loop took to compile (the largest seen), and per gamma not compiled
        # the seconds it was predicted to save over the compiled choice, summed over calls
        self.compile_seconds: float | None = None
        self.regret: dict = {}

    @property
    def rates(self) -> DeviceRates:
        if self._rates is None:
            self._rates = DeviceRates.measure(self.dtype)
        return self._rates

    # ------------------------------------------------------------------ predictions
    def _draft_keys(self, ctx: np.ndarray) -> float:
        if self.span is None:
            return float(ctx.sum())
        if self.self_draft:
            return float(np.minimum(ctx, self.span).sum())
        return float(self.span * len(ctx))

    def plain_roofline(self, ctx: np.ndarray) -> float:
        """The roofline time of a plain step over running rows with contexts ``ctx``."""
        ctx = np.asarray(ctx, np.float64)
        return self._target.time(self.rates, len(ctx), ctx.sum(), 1)

    def round_roofline(self, ctx: np.ndarray, levels: tuple[int, ...], nodes: int) -> float:
        """The roofline time of a speculative round: one draft forward per entry of ``levels``
        (its new tokens per row; a chain of gamma: gamma ones) and a verify forward of ``nodes``
        tokens."""
        ctx = np.asarray(ctx, np.float64)
        n = len(ctx)
        dk = self._draft_keys(ctx)
        t = sum(self._draft.time(self.rates, n, dk + n * i, w) for i, w in enumerate(levels))
        return t + self._target.time(self.rates, n, ctx.sum(), nodes)

    @staticmethod
    def _forwards(kind) -> int:
        return 1 if kind == "plain" else len(kind[1]) + 1

    def fixed_per_forward(self) -> float | None:
        """What a forward costs whatever it reads, from the kinds timed at different sizes (the
        plain step's first); None before any."""
        kinds = sorted(self.fits, key=lambda k: k != "plain")
        for kind in kinds:
            fit = self.fits[kind].affine()
            if fit is not None:
                return fit[1] / self._forwards(kind)
        return None

    def plain_time(self, ctx: np.ndarray) -> float:
        """Predicted time of a plain step (fitted to the plain steps timed; before any, the
        rounds' measured / roofline ratio / `PRIOR_ROUND_FACTOR` x the roofline)."""
        roof = self.plain_roofline(ctx)
        fit = self.fits.get("plain")
        pf = self.fixed_per_forward()
        if fit is not None:
            return fit.predict(roof, pf or 0.0)
        rounds = [f.scale() for k, f in self.fits.items()]
        return roof * (float(np.mean(rounds)) / PRIOR_ROUND_FACTOR if rounds else 1.0)

    def round_time(self, ctx: np.ndarray, levels: tuple[int, ...], nodes: int) -> float:
        """Predicted time of a speculative round (fitted to such rounds timed; before any, from
        the plain steps' fit: their scale x the roofline + their fixed cost per forward, or
        without a fixed cost known, x `PRIOR_ROUND_FACTOR`)."""
        kind = ("round", tuple(levels), nodes)
        roof = self.round_roofline(ctx, levels, nodes)
        pf = self.fixed_per_forward()
        fit = self.fits.get(kind)
        if fit is not None:
            return fit.predict(roof, (pf or 0.0) * self._forwards(kind))
        plain = self.fits.get("plain")
        if plain is None:
            return roof * PRIOR_ROUND_FACTOR
        aff = plain.affine()
        if aff is not None:
            return aff[0] * roof + aff[1] * self._forwards(kind)
        return roof * plain.scale() * PRIOR_ROUND_FACTOR

    # ------------------------------------------------------------------ learning
    def observe(self, kind, seconds: float, predicted: float, rounds: int = 1):
        """A timed stretch of ``rounds`` rounds (plain steps) of ``kind`` ("plain" or
        ``("round", levels, nodes)``) that took ``seconds`` where their roofline predicted
        ``predicted``."""
        if predicted <= 0 or seconds <= 0 or rounds <= 0:
            return
        self.fits.setdefault(kind, _Fit()).add(predicted / rounds, seconds / rounds, rounds)

    def observe_acceptance(self, accepted: float, spec_rounds: float, gamma: int):
        """Drafts accepted in ``spec_rounds`` row-rounds of a chain of ``gamma``."""
        if spec_rounds <= 0 or gamma <= 0:
            return
        a = per_token_acceptance(accepted / spec_rounds, gamma)
        self.alpha = a if self.alpha is None else 0.5 * self.alpha + 0.5 * a

    # ------------------------------------------------------------------ decisions
    def observe_compile(self, seconds: float):
        """A decode loop compiled in ``seconds`` (what switching to an uncompiled gamma costs)."""
        self.compile_seconds = max(seconds, self.compile_seconds or 0.0)

    def choose_gamma(self, ctx: np.ndarray, candidates, *, alpha: float | None = None,
                     remember: bool = True, compiled=None,
                     steps: int | None = None) -> tuple[int, float]:
        """(gamma, predicted speedup) for running rows of contexts ``ctx``; 0 = plain.
        ``alpha``: the per-token acceptance to assume (default: the learned one, else the prior);
        ``remember=False`` leaves the remembered choice (hysteresis) alone. ``compiled``: the
        gammas (0: plain) whose loops are compiled for these shapes, and ``steps`` the plain steps
        the call would take: a gamma not compiled is chosen over the best compiled one only once
        the time it was predicted to save, summed over the calls that passed it by, reaches a
        loop's compile time (`observe_compile`): a small predicted gain never costs a call a
        compilation many times larger, and a lasting one pays for its compilation."""
        if alpha is None:
            alpha = PRIOR_ACCEPTANCE if self.alpha is None else self.alpha
        t_plain = self.plain_time(ctx)

        def speedup(g):
            if g == 0:
                return 1.0
            return expected_tokens(alpha, g) * t_plain / self.round_time(ctx, (1,) * g, g + 1)

        s = {g: speedup(g) for g in candidates}
        best = max(s, key=s.get)
        best_s = s[best]
        if best_s < AUTO_MARGIN:
            best, best_s = 0, 1.0
        prev = self.gamma if remember else None
        if prev is not None and prev != best and (prev == 0 or prev in s):
            ps = 1.0 if prev == 0 else s[prev]
            if (prev == 0 or ps >= AUTO_MARGIN) and ps * HYSTERESIS >= best_s:
                best, best_s = prev, ps
        ready = {g: (1.0 if g == 0 else s[g]) for g in (compiled or ()) if g == 0 or g in s}
        if ready and best not in ready and steps and self.compile_seconds:
            alt = max(ready, key=ready.get)
            saved = steps * t_plain * (1.0 / ready[alt] - 1.0 / best_s)
            self.regret[best] = self.regret.get(best, 0.0) + saved
            if self.regret[best] < self.compile_seconds:
                best, best_s = alt, ready[alt]
            else:
                del self.regret[best]  # it compiles now
        if remember:
            self.gamma = best
        return best, best_s

    @property
    def explored(self) -> bool:
        """Whether any acceptance was observed (`observe_acceptance`)."""
        return self.alpha is not None

    def worth_exploring(self, ctx: np.ndarray, levels, nodes) -> bool:
        """Whether speculation would pay for these rows at `EXPLORE_ACCEPTANCE` while nothing is
        known of the acceptance (then a short speculative stretch measures it)."""
        if self.explored or len(ctx) == 0:
            return False
        tokens = np.full(len(ctx), expected_tokens(EXPLORE_ACCEPTANCE, len(levels)))
        return self.speculation_pays(ctx, tokens, levels, nodes)

    def prior_tokens(self, depth: int) -> float:
        alpha = PRIOR_ACCEPTANCE if self.alpha is None else self.alpha
        return expected_tokens(alpha, depth)

    def expected_row_tokens(self, committed: np.ndarray, rounds: np.ndarray, depth: int):
        """Each row's expected tokens per round: its own mean, shrunk toward the prior."""
        prior = self.prior_tokens(depth)
        return (committed + PRIOR_WEIGHT * prior) / (rounds + PRIOR_WEIGHT)

    def speculation_pays(self, ctx: np.ndarray, tokens: np.ndarray, levels, nodes) -> bool:
        """Whether a round (expected ``tokens[b]`` per running row b) beats plain steps."""
        if len(ctx) == 0:
            return False
        return float(np.sum(tokens)) * self.plain_time(ctx) >= \
            len(ctx) * self.round_time(ctx, levels, nodes)
