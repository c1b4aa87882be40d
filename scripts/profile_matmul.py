"""Micro-benchmark (GPU): the weight-streaming part of a decode step (M = batch rows), scanned over
stacked layer weights vs unrolled over per-layer arrays, against bytes / copy bandwidth."""
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp


def timeit(f, *a, n=10):
    for _ in range(3):
        jax.block_until_ready(f(*a))
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f(*a))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main():
    L, D, F, B = 32, 4096, 14336, int(sys.argv[1]) if len(sys.argv) > 1 else 32
    k = jax.random.PRNGKey(0)
    wg = jax.random.normal(k, (L, D, F), jnp.bfloat16) * 0.01
    wd = jax.random.normal(k, (L, F, D), jnp.bfloat16) * 0.01
    x = jax.random.normal(k, (B, D), jnp.bfloat16)
    nbytes = 2 * wg.size * 2
    bw = 2 * 4e9 / (timeit(jax.jit(lambda a: a * 1.0001), jnp.ones((1 << 30,), jnp.float32)) / 1e3)

    @jax.jit
    def scanned(x, wg, wd):
        def body(h, w):
            g, d = w
            return h + (jax.nn.silu(h @ g) @ d), None
        return jax.lax.scan(body, x, (wg, wd))[0]

    @jax.jit
    def scanned_idx(x, wg, wd):
        def body(i, h):
            return h + (jax.nn.silu(h @ wg[i]) @ wd[i])
        return jax.lax.fori_loop(0, L, body, x)

    wgs = [wg[i] for i in range(L)]
    wds = [wd[i] for i in range(L)]

    @jax.jit
    def unrolled(x, wgs, wds):
        for g, d in zip(wgs, wds):
            x = x + (jax.nn.silu(x @ g) @ d)
        return x

    floor = nbytes / bw * 1e3
    print(f"B={B} weights {nbytes/1e9:.1f} GB, copy bw {bw/1e12:.2f} TB/s, floor {floor:.2f} ms")
    for name, f, args in (("scan(xs)", scanned, (x, wg, wd)), ("fori(index)", scanned_idx, (x, wg, wd)),
                          ("unrolled", unrolled, (x, wgs, wds))):
        t = timeit(f, *args)
        print(f"  {name:12s} {t:.2f} ms  x floor {t/floor:.2f}")
    lm = jax.random.normal(k, (D, 128256), jnp.bfloat16)
    f32 = jax.jit(lambda x, w: jnp.einsum("bd,dv->bv", x, w, preferred_element_type=jnp.float32))
    b16 = jax.jit(lambda x, w: (x @ w).astype(jnp.float32))
    fl = lm.size * 2 / bw * 1e3
    print(f"  lm_head f32-acc {timeit(f32, x, lm):.3f} ms, bf16-out {timeit(b16, x, lm):.3f} ms, floor {fl:.3f}")


if __name__ == "__main__":
    main()
