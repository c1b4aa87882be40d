"""Diagnostic (internal entry points, labelled so): where the serving engine's retrieval selection
diverges from generate's, on the same random prompts, with random weights.

Both paths run the same `Speculation(draft="self", window=W, retrieve=N, gamma=G, adaptive=False)`
greedy on a random model of the Qwen2.5-1.5B attention shape with few layers:

* generate (INTERNAL entry point): `jaxspec.engine.decoder_for` (the Decoder `jaxspec.generate`
  uses) -> `Decoder.prepare` -> `Decoder.run(rd, sp, state, 1)` round by round (the program
  `generate`'s decode loop runs, `run_rounds`, one round per call), then the public
  `jaxspec.generate` on the same Decoder (its tokens and acceptance, as a cross-check);
* server: `jaxspec.serving.ServingEngine` (dense slots, max_batch=B, rounds_per_chunk=1 unless
  --chunk-rounds), all prompts submitted while admission is paused (they start together; or in
  --stagger groups), `Decoder.call_chunk` wrapped (INTERNAL hook) to read the state after each
  chunk.

What the script patches in THIS process only (no library file is edited):

* `jaxspec.attention._attend_scored`: the verification's block scores come back as
  ``concat([kernel scores, plain-jnp scores], -1)``: the plain-jnp scores are computed here from
  the same queries and the layer's cache K (`plain_scores`), an independent check of the kernel;
* `SelfDrafter.after_round`: splits them, selects with the kernel's half exactly as the library
  does (`select_blocks`), and also keeps (in a subclass of `RetrievalState`, `ProbeState`): the
  kernel scores, the plain-jnp scores and their selection, the verified length and a per-row
  round counter;
* `Decoder._state`: the initial draft state is that subclass.

jaxspec's own executables store is kept off (its key would not see the patches); jax's persistent
cache is used in $JAXSPEC_CACHE/xla-probe (keyed by the lowered program).

--pristine: no patches (the library's programs as they are), selected blocks and lengths only;
--no-plain-scores: the kernel's scores kept, no plain-jnp pass in the verification.

CPU:  JAXSPEC_CACHE=/tmp/jxc-retr python scripts/probe_retrieval_server.py --batch 4 --prompt 1024 \
      --layers 2 --new 16 --window 240 --retrieve 256 --vocab 4096 [--attn-impl interpret]
GPU:  PYTHONPATH=$PWD JAXSPEC_CACHE=/tmp/jxc-retr python scripts/probe_retrieval_server.py   (B=64, P=16384,
      2 layers, window 496 + 512 retrieved, 32 new; server slots of 17408; stdout and
      $OUT/retr_probe.json)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time

T0 = time.perf_counter()


def log(msg: str):
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=16384, help="prompt tokens per row")
    p.add_argument("--ragged", type=int, default=0,
                   help="rows shorter by a random 0..RAGGED tokens (0: all of --prompt)")
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--sink", type=int, default=16)
    p.add_argument("--window", type=int, default=496)
    p.add_argument("--retrieve", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--attn-impl", default="auto", help="auto | xla | pallas | interpret")
    p.add_argument("--max-len", type=int, default=None,
                   help="server max_len (default: longest prompt + 512; 16384 -> slots of 17408)")
    p.add_argument("--gen-max-len", default="auto",
                   help="generate's cache slots: auto (its own sizing), server (the server's "
                        "slot count S) or an int")
    p.add_argument("--chunk-rounds", type=int, default=1, help="server rounds_per_chunk")
    p.add_argument("--stagger", type=int, default=1,
                   help="server: admit the prompts in this many groups (1: all together)")
    p.add_argument("--stagger-chunks", type=int, default=2,
                   help="server: chunks between two groups' admissions")
    p.add_argument("--qk-scale", type=float, default=1.0,
                   help="multiply wq/bq/wk/bk by this (sharper attention: fewer near-ties)")
    p.add_argument("--tie", action="store_true",
                   help="tie the LM head to the embeddings (a random tied model copies its input "
                        "token: every draft accepted, few rounds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--detail-rounds", type=int, default=3,
                   help="rounds per row whose scores are kept for the tie analysis")
    p.add_argument("--show", type=int, default=6, help="differing heads printed per round")
    p.add_argument("--print-rounds", type=int, default=4, help="rounds printed in detail")
    p.add_argument("--pristine", action="store_true",
                   help="no patches at all: the library's programs exactly as they are; only the "
                        "selected blocks and lengths are read (no scores, no plain-jnp check)")
    p.add_argument("--no-plain-scores", action="store_true",
                   help="keep the kernel's scores but compute no plain-jnp scores in the "
                        "verification (closer to the library's program)")
    p.add_argument("--no-public-generate", action="store_true")
    p.add_argument("--no-server", action="store_true")
    p.add_argument("--no-generate", action="store_true")
    p.add_argument("--no-jax-cache", action="store_true")
    p.add_argument("--timeout", type=float, default=900.0, help="server wait, seconds")
    p.add_argument("--json", default=None, help="JSON path (default: $OUT/retr_probe.json)")
    return p.parse_args()


# ----------------------------------------------------------------------------- patches
def install_patches(plain: bool = True):
    """The in-process patches described in the module docstring (``plain``: with the plain-jnp
    scores); returns ProbeState."""
    import jax
    import jax.numpy as jnp
    from flax import struct

    import jaxspec.attention as A
    import jaxspec.drafter as Dr
    import jaxspec.session as Se
    from jaxspec.retrieval import layer_view

    @struct.dataclass
    class ProbeState(Dr.RetrievalState):
        scores: jax.Array      # [B, L, K, n] f32: the kernel's block scores of the row's last verification
        ref_scores: jax.Array  # [B, L, K, n] f32: the same from plain jnp (`plain_scores`)
        ref_blocks: jax.Array  # [B, L, K, R] i32: select_blocks on ref_scores
        verified: jax.Array    # [B] i32: the context length that verification saw (before it)
        rounds: jax.Array      # [B] i32: speculative rounds of the row's sequence

        def start_rows(self, rows, last):
            del last
            return self.replace(blocks=self.blocks.at[rows].set(-1, mode="drop"),
                                rounds=self.rounds.at[rows].set(0, mode="drop"))

    def plain_scores(q_BTHD, k_LBKSD, layer, plan, *, block, sm_scale):
        """[B, K, n] f32: per row, KV head and block of ``block`` slots, the largest
        ``q . k * scale`` over the T queries and G heads of the group, slots < length only."""
        B, T, H, D = q_BTHD.shape
        k = layer_view(k_LBKSD, jnp.asarray(layer, jnp.int32), plan.block_table)  # [B, K, S, D]
        K, S = k.shape[1], k.shape[2]
        G = H // K
        scale = (1.0 / math.sqrt(D)) if sm_scale is None else float(sm_scale)
        lengths = plan.lengths if plan.active is None else jnp.where(plan.active, plan.lengths, 0)
        qf = q_BTHD.astype(k.dtype).astype(jnp.float32).reshape(B, T, K, G, D)
        s = jnp.einsum("btkgd,bksd->bktgs", qf, k.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST) * scale
        s = jnp.max(s, axis=(2, 3))  # [B, K, S]
        slot = jnp.arange(S, dtype=jnp.int32)
        s = jnp.where(slot[None, None] < lengths.astype(jnp.int32)[:, None, None], s, -jnp.inf)
        n = -(-S // block)
        if n * block != S:
            s = jnp.pad(s, ((0, 0), (0, 0), (0, n * block - S)), constant_values=-jnp.inf)
        return jnp.max(s.reshape(B, K, n, block), axis=-1)

    orig_scored = A._attend_scored

    def attend_scored(q_BTHD, k_LBKSD, v_LBKSD, layer, plan, *, sm_scale=None):
        out, sc = orig_scored(q_BTHD, k_LBKSD, v_LBKSD, layer, plan, sm_scale=sm_scale)
        if not plain:
            return out, sc
        ref = plain_scores(q_BTHD, k_LBKSD, layer, plan, block=int(plan.score_block),
                           sm_scale=sm_scale)
        return out, jnp.concatenate([sc.astype(jnp.float32), ref], axis=-1)

    A._attend_scored = attend_scored

    def after_round(self, rd, dparams, state, new_state, ctx, path, n_acc, acc_nodes):
        if not self.retrieving:
            return state.draft
        d = state.draft
        sc = ctx["scores"].astype(jnp.float32)  # [L, B, K, 2n] (patched) or [L, B, K, n]
        kw = dict(sink=self.sink, window=self.window, block=self.retrieve_block,
                  count=d.blocks.shape[-1])
        if not isinstance(d, ProbeState):
            return d.replace(blocks=Dr.select_blocks(sc, state.cache.lengths,
                                                     new_state.cache.lengths, **kw))
        n = d.scores.shape[-1]
        kern, ref = (sc[..., :n], sc[..., n:]) if sc.shape[-1] == 2 * n else (sc, sc)
        blocks = Dr.select_blocks(kern, state.cache.lengths, new_state.cache.lengths, **kw)
        rblocks = Dr.select_blocks(ref, state.cache.lengths, new_state.cache.lengths, **kw)
        active = (~state.done).astype(jnp.int32)
        return d.replace(blocks=blocks, scores=jnp.transpose(kern, (1, 0, 2, 3)),
                         ref_scores=jnp.transpose(ref, (1, 0, 2, 3)), ref_blocks=rblocks,
                         verified=state.cache.lengths.astype(jnp.int32),
                         rounds=d.rounds + active)

    Dr.SelfDrafter.after_round = after_round

    orig_state = Se.Decoder._state

    def _state(self, cache, last, budget, width, keys):
        st = orig_state(self, cache, last, budget, width, keys)
        d = st.draft
        if isinstance(d, Dr.RetrievalState) and not isinstance(d, ProbeState) and \
                hasattr(cache, "max_len") and getattr(cache, "block_table", None) is None:
            B, L, K, R = d.blocks.shape
            n = -(-int(cache.max_len) // int(self.drafter.retrieve_block))
            st = st.replace(draft=ProbeState(
                blocks=d.blocks, scores=jnp.full((B, L, K, n), -jnp.inf, jnp.float32),
                ref_scores=jnp.full((B, L, K, n), -jnp.inf, jnp.float32),
                ref_blocks=jnp.full((B, L, K, R), -1, jnp.int32),
                verified=jnp.zeros((B,), jnp.int32), rounds=jnp.zeros((B,), jnp.int32)))
        return st

    Se.Decoder._state = _state
    return ProbeState


# ----------------------------------------------------------------------------- recording
class Recorder:
    """Per prompt and per round of its row: what the draft will read next (and why)."""

    def __init__(self, name, detail_rounds):
        self.name = name
        self.detail = detail_rounds
        self.rows = {}  # (prompt i, round r) -> dict
        self.snapshots = 0
        self.kernel_vs_ref = []  # per snapshot: (max |diff| on finite, finite mismatches, sel. diff heads)
        self.host_rounds = {}  # row -> rounds counted on the host (the pristine mode's)
        self.counter_mismatch = 0  # device counters / verified lengths vs the host's

    def add(self, host, row_to_prompt, pre):
        """``host``: numpy arrays of one state after a round (a chunk of one round); ``pre``:
        ``(done, lengths)`` of the state before it (host copies)."""
        import numpy as np
        self.snapshots += 1
        pre_done, pre_len = pre
        for b in row_to_prompt:  # rows that took part in this round (one round per call)
            if not pre_done[b]:
                self.host_rounds[b] = self.host_rounds.get(b, 0) + 1
        blocks = host["blocks"]
        rblocks = host.get("ref_blocks", blocks)
        sc, rsc = host.get("scores"), host.get("ref_scores")
        if sc is not None:
            fin_s, fin_r = np.isfinite(sc), np.isfinite(rsc)
            both = fin_s & fin_r
            dmax = float(np.max(np.abs(sc[both] - rsc[both]))) if both.any() else 0.0
            mism = int(np.sum(fin_s != fin_r))
            seldiff = int(np.sum(np.any(np.sort(blocks, -1) != np.sort(rblocks, -1), axis=-1)))
            self.kernel_vs_ref.append((dmax, mism, seldiff))
        for b, i in row_to_prompt.items():
            hr = self.host_rounds.get(b, 0)
            if "rounds" in host:  # the device's counter and verified length (ProbeState)
                r, ver = int(host["rounds"][b]), int(host["verified"][b])
                if not pre_done[b] and (r != hr or ver != int(pre_len[b])):
                    self.counter_mismatch += 1
            else:
                r, ver = hr, int(pre_len[b])
            if r == 0 or (i, r) in self.rows:
                continue
            e = {"blocks": blocks[b].copy(), "ref_blocks": rblocks[b].copy(),
                 "verified": ver, "length": int(host["lengths"][b]),
                 "snapshot": self.snapshots}
            if sc is not None and r <= self.detail:
                e["scores"] = sc[b].copy()
                e["ref_scores"] = rsc[b].copy()
            self.rows[(i, r)] = e


def host_view(state):
    import jax
    import numpy as np
    d = state.draft
    keys = ("blocks", "ref_blocks", "scores", "ref_scores", "verified", "rounds")
    h = jax.device_get({"lengths": state.cache.lengths, "done": state.done,
                        **{k: getattr(d, k) for k in keys if hasattr(d, k)}})
    return {k: np.asarray(v) for k, v in h.items()}


def host_pre(state):
    """``(done, lengths)`` before a round (host copies; read before the state is donated)."""
    import jax
    import numpy as np
    return tuple(np.asarray(x) for x in jax.device_get((state.done, state.cache.lengths)))


# ----------------------------------------------------------------------------- analysis
def eligible_hi(verified, length, window, block):
    """Blocks j < this reach into [sink, min(verified, length - window)) (select_blocks)."""
    hi = max(min(verified, length - window), 0)
    return -(-hi // block)


def range_violations(rec, sink, window, block, limit=5):
    """Selections outside [sink // block, eligible_hi) or past the verified context, or
    repeated, per recorded (prompt, round)."""
    import numpy as np
    bad, n = [], 0
    lo = sink // block
    for (i, r), e in sorted(rec.rows.items()):
        hi = eligible_hi(e["verified"], e["length"], window, block)
        for key in ("blocks", "ref_blocks"):
            B = e[key]  # [L, K, R]
            for l in range(B.shape[0]):
                for h in range(B.shape[1]):
                    sel = B[l, h][B[l, h] >= 0]
                    why = []
                    if np.any(sel < lo) or np.any(sel >= hi):
                        why.append(f"outside [{lo},{hi})")
                    if np.any(sel * block >= e["verified"]):
                        why.append(f"starts past verified {e['verified']}")
                    if len(np.unique(sel)) != len(sel):
                        why.append("repeated")
                    if why:
                        n += 1
                        if len(bad) < limit:
                            bad.append({"prompt": i, "round": r, "which": key, "layer": l,
                                        "head": h, "sel": sel.tolist(), "why": why,
                                        "verified": e["verified"], "length": e["length"]})
    return n, bad


def compare(gen, srv, args, block):
    """Per round index: selection equality server vs generate for each (prompt, layer, head)."""
    import numpy as np
    rounds = sorted({r for (_, r) in gen.rows} & {r for (_, r) in srv.rows})
    out = []
    for r in rounds:
        prompts = sorted(i for (i, rr) in gen.rows if rr == r and (i, r) in srv.rows)
        eq_rows, eq_heads, heads, len_eq, ver_eq, diffs = 0, 0, 0, 0, 0, []
        kinds = {}
        sdiff_max = None  # (no scores kept: --pristine, or past --detail-rounds)
        for i in prompts:
            g, s = gen.rows[(i, r)], srv.rows[(i, r)]
            len_eq += g["length"] == s["length"]
            ver_eq += g["verified"] == s["verified"]
            gs, ss = np.sort(g["blocks"], -1), np.sort(s["blocks"], -1)
            same = np.all(gs == ss, axis=-1)  # [L, K]
            heads += same.size
            eq_heads += int(same.sum())
            eq_rows += bool(same.all())
            if "scores" in g and "scores" in s:
                hi = eligible_hi(min(g["verified"], s["verified"]),
                                 min(g["length"], s["length"]), args.window, block)
                a, b = g["scores"][..., :hi], s["scores"][..., :hi]
                fin = np.isfinite(a) & np.isfinite(b)
                if fin.any():
                    sdiff_max = max(sdiff_max or 0.0, float(np.max(np.abs(a[fin] - b[fin]))))
            for l, h in zip(*np.nonzero(~same)):
                gset = set(int(x) for x in g["blocks"][l, h] if x >= 0)
                sset = set(int(x) for x in s["blocks"][l, h] if x >= 0)
                kind = "no-scores"
                info = {}
                if "scores" in g and "scores" in s:
                    hi = eligible_hi(min(g["verified"], s["verified"]),
                                     min(g["length"], s["length"]), args.window, block)
                    gsc, ssc = g["scores"][l, h], s["scores"][l, h]
                    only = sorted(gset ^ sset)
                    # the cut of each side: its weakest selected block's score
                    gcut = min((float(gsc[j]) for j in gset), default=float("nan"))
                    scut = min((float(ssc[j]) for j in sset), default=float("nan"))
                    fin = np.isfinite(gsc[:hi]) & np.isfinite(ssc[:hi])
                    noise = float(np.max(np.abs(gsc[:hi][fin] - ssc[:hi][fin]))) \
                        if fin.any() else 0.0
                    if (g["length"], g["verified"]) != (s["length"], s["verified"]):
                        kind = "lengths-differ"  # the rows' tokens parted before: expected
                    elif np.any(np.isfinite(gsc[:hi]) != np.isfinite(ssc[:hi])):
                        kind = "finite-mismatch"
                    elif noise <= 1e-6 * (1 + abs(gcut)):
                        kind = "select-differs"  # same scores, other blocks: not numerics
                    else:
                        # typical rounding difference of this head's scores (the median: a
                        # kernel error in a few blocks stands out of it)
                        tol = 4 * float(np.median(np.abs(gsc[:hi][fin] - ssc[:hi][fin]))) + 1e-6
                        agree = all(abs(float(gsc[j]) - float(ssc[j])) <= tol for j in only)
                        if agree and all(abs(float(gsc[j]) - gcut) <= 2 * tol and
                                         abs(float(ssc[j]) - scut) <= 2 * tol for j in only):
                            kind = "near-tie"  # within rounding of both cuts
                        elif agree:  # scores agree, yet a block far from the cut differs
                            kind = "select-differs"
                        else:
                            kind = "scores-differ"
                    info = {"only": only, "gen_scores": [round(float(gsc[j]), 4) for j in only],
                            "srv_scores": [round(float(ssc[j]), 4) for j in only],
                            "gen_cut": round(gcut, 4), "srv_cut": round(scut, 4),
                            "head_score_diff": round(noise, 5)}
                kinds[kind] = kinds.get(kind, 0) + 1
                if len(diffs) < 50:
                    diffs.append({"prompt": i, "layer": int(l), "head": int(h), "kind": kind,
                                  "gen": sorted(gset), "srv": sorted(sset),
                                  "gen_len": g["length"], "srv_len": s["length"],
                                  "gen_verified": g["verified"], "srv_verified": s["verified"],
                                  **info})
        out.append({"round": r, "prompts": len(prompts), "rows_equal": eq_rows,
                    "heads_equal": eq_heads, "heads": heads, "lengths_equal": len_eq,
                    "verified_equal": ver_eq, "kinds": kinds, "score_diff_max": sdiff_max,
                    "diffs": diffs})
    return out


def acceptance_by_round(rec, gamma, max_round=12):
    """Mean accepted drafts / gamma per round index of the rows (length - verified - 1: the
    tokens a round committed, less the target's own; a round cut by the budget counts less)."""
    import numpy as np
    out = []
    for r in range(1, max_round + 1):
        acc = [(e["length"] - e["verified"] - 1) / gamma for (i, rr), e in rec.rows.items()
               if rr == r]
        if not acc:
            break
        out.append(round(float(np.mean(acc)), 3))
    return out


def kvr_summary(rec):
    if not rec.kernel_vs_ref:
        return {}
    d = [x[0] for x in rec.kernel_vs_ref]
    return {"snapshots": len(d), "max_abs_diff": max(d),
            "finite_mismatch": sum(x[1] for x in rec.kernel_vs_ref),
            "selection_diff_heads": sum(x[2] for x in rec.kernel_vs_ref),
            "first_snapshots": [list(x) for x in rec.kernel_vs_ref[:4]]}


# ----------------------------------------------------------------------------- main
def main():
    args = parse()
    os.environ.setdefault("JAXSPEC_CACHE", "/tmp/jxc-retr")
    import jax
    if not args.no_jax_cache:  # jax's cache (keyed by the lowered program); jaxspec's store off
        d = os.path.join(os.environ["JAXSPEC_CACHE"], "xla-probe")
        os.makedirs(d, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", d)
    else:
        os.environ["JAXSPEC_COMPILE_CACHE"] = "0"
    import jax.numpy as jnp
    import numpy as np

    import jaxspec
    from jaxspec.model import init_params
    if args.pristine:
        if args.chunk_rounds != 1:
            sys.exit("--pristine counts rounds on the host: it needs --chunk-rounds 1")
    else:
        install_patches(plain=not args.no_plain_scores)
    from jaxspec.engine import decoder_for
    from jaxspec.retrieval import RETRIEVE_BLOCK
    from jaxspec.serving import SamplingOptions, Sequence, ServingEngine

    dev = jax.devices()[0]
    env = {"jax": jax.__version__, "backend": jax.default_backend(),
           "device": getattr(dev, "device_kind", str(dev)), "argv": sys.argv[1:]}
    log(f"env {env}")
    report = {"env": env, "args": vars(args)}
    block = RETRIEVE_BLOCK

    # ---- model and prompts
    cfg = jaxspec.ModelConfig(model_type="qwen2", vocab_size=args.vocab, hidden_size=1536,
                              intermediate_size=8960, num_layers=args.layers, num_heads=12,
                              num_kv_heads=2, head_dim=128, max_position_embeddings=32768,
                              attention_bias=True, rope_theta=1e6,
                              tie_word_embeddings=bool(args.tie))
    params = init_params(cfg, jax.random.PRNGKey(args.seed), jnp.dtype(args.dtype))
    if args.qk_scale != 1.0:
        lay = dict(params["layers"])
        for k in ("wq", "bq", "wk", "bk"):
            lay[k] = (lay[k].astype(jnp.float32) * args.qk_scale).astype(lay[k].dtype)
        params = {**params, "layers": lay}
    model = jaxspec.Model(config=cfg, params=params)
    rng = np.random.default_rng(args.seed)
    B, P = args.batch, args.prompt
    lens = P - (rng.integers(0, args.ragged + 1, B) if args.ragged else np.zeros(B, int))
    prompts = [rng.integers(1, args.vocab, int(n)).astype(np.int32).tolist() for n in lens]
    max_len = args.max_len or int(lens.max()) + 512
    spec = jaxspec.Speculation(draft="self", gamma=args.gamma, sink=args.sink,
                               window=args.window, retrieve=args.retrieve, adaptive=False)
    log(f"model: qwen2 {args.layers} layers, hidden 1536, 12 q / 2 kv heads, D 128, vocab "
        f"{args.vocab}, {args.dtype}; {B} prompts of {int(lens.min())}..{int(lens.max())} "
        f"tokens, {args.new} new; {spec}")

    # the server's slot count (ServingEngine.S) for --gen-max-len server and the plan print
    from jaxspec.cache import SLOT_ALIGN, round_up
    extra = args.gamma + 2
    S_srv = round_up(max_len + extra, max(SLOT_ALIGN, 512))
    gml = {"auto": None, "server": S_srv}.get(args.gen_max_len)
    if gml is None and args.gen_max_len not in ("auto",):
        gml = int(args.gen_max_len)

    kd_fn = jax.jit(lambda ks, kg, rows, ln: jnp.max(jnp.where(
        jnp.arange(kg.shape[3])[None, None, None, :, None] < ln[None, :, None, None, None],
        jnp.abs(jnp.take(ks[:, :, :, :kg.shape[3]], rows, axis=1).astype(jnp.float32)
                - kg.astype(jnp.float32)), 0.0), axis=(0, 2, 3, 4)))

    gen = Recorder("generate", args.detail_rounds)
    srv = Recorder("server", args.detail_rounds)
    gen_tokens = gen_acc = pub_tokens = srv_tokens = srv_acc = None
    gen_k = None
    S_gen = None

    # ---- generate (internal: Decoder.prepare + Decoder.run one round per call)
    if not args.no_generate:
        t = time.perf_counter()
        dec = decoder_for(model, spec, attn_impl=args.attn_impl)
        log(f"generate: Decoder ready ({time.perf_counter() - t:.1f}s: cost-model benchmark)")
        batch = dec.prepare(prompts, max_new_tokens=args.new, ignore_eos=True, max_len=gml)
        S_gen = int(batch.state.cache.max_len)
        log(f"generate: prefilled {B} rows into {S_gen} slots ({batch.prefill_seconds:.1f}s "
            f"incl. compile); impl {dec.impl}, cache {batch.state.cache.k.dtype}")
        state = batch.state
        if not args.no_server:  # the prefilled K, to compare with the server's slots
            gen_k = jnp.array(state.cache.k[:, :, :, :int(lens.max()) - 1], copy=True)
        rd = dec.round(args.gamma, greedy=True, stop_ids=batch.stop_ids)
        ident = {b: b for b in range(B)}
        n = 0
        while True:
            pre = host_pre(state)
            state, c = dec.run(rd, batch.sp, state, 1)
            h = host_view(state)
            gen.add(h, ident, pre)
            n += 1
            if n == 1:
                log(f"generate: round 1 done (compile {c:.1f}s)")
            if h["done"].all() or n > 4 * args.new + 8:
                break
        st = jax.device_get(state.stats)
        out, n_out = np.asarray(state.out), np.asarray(state.n_out)
        gen_tokens = [out[i, :n_out[i]].tolist() for i in range(B)]
        gen_acc = np.asarray(st.accepted) / np.maximum(np.asarray(st.proposed), 1)
        log(f"generate: {n} rounds, acceptance {float(np.sum(st.accepted)) / max(float(np.sum(st.proposed)), 1):.3f}")
        del state, batch
        if not args.no_public_generate:
            res = jaxspec.generate(model, prompts, max_new_tokens=args.new, speculation=spec,
                                   attn_impl=args.attn_impl, ignore_eos=True, max_len=gml)
            pub_tokens = res.tokens
            report["public_generate"] = {k: res.stats.get(k) for k in (
                "acceptance_rate", "tokens_per_step", "target_steps", "plain_steps", "max_len",
                "draft_view", "compile_seconds", "decode_seconds")}
            log(f"jaxspec.generate (public): acceptance {res.stats.get('acceptance_rate'):.3f}, "
                f"{res.stats.get('target_steps')} steps, compile {res.stats.get('compile_seconds'):.1f}s")
        model.decoders.clear()

    # ---- server
    kdiff = {}
    if not args.no_server:
        t = time.perf_counter()
        eng = ServingEngine(model, max_batch=B, max_len=max_len, speculation=spec,
                            rounds_per_chunk=args.chunk_rounds, attn_impl=args.attn_impl,
                            ignore_eos=True, compact_rows=False, max_queue=max(256, B))
        assert eng.S == S_srv, (eng.S, S_srv)
        eng.start(warmup=True, variants=[(True, False)])
        log(f"server: engine warm ({time.perf_counter() - t:.1f}s), {B} dense slots of "
            f"{eng.S}, impl {eng.impl}, gamma {eng.gamma}, drafter {eng.decoder.drafter}")
        dec = eng.decoder
        slot_of = {}  # sequence id -> slot
        orig_admit = eng._admit_all

        def admit(admits):
            for b, s in admits:
                slot_of[s.id] = b
            return orig_admit(admits)
        eng._admit_all = admit
        seqs = [Sequence(p, SamplingOptions(max_tokens=args.new, temperature=0.0))
                for p in prompts]
        index_of = {s.id: i for i, s in enumerate(seqs)}
        orig_call = dec.call_chunk
        lock = threading.Lock()
        chunks = [0]

        def call_chunk(program, sp, state, max_rounds, pieces=None, end_after=0, num_pieces=0):
            with lock:
                row_to_prompt = {b: index_of[sid] for sid, b in slot_of.items()}
            pre = host_pre(state)
            fresh = [b for b in row_to_prompt  # rows about to run their first round
                     if not pre[0][b] and srv.host_rounds.get(b, 0) == 0
                     and row_to_prompt[b] not in kdiff]
            if fresh and gen_k is not None:
                rows = np.zeros(B, np.int32)  # slot of each prompt (its generate row)
                for b, i in row_to_prompt.items():
                    rows[i] = b
                d = np.asarray(kd_fn(state.cache.k, gen_k, jnp.asarray(rows),
                                     jnp.asarray(lens - 1, jnp.int32)))
                for b in fresh:
                    kdiff[row_to_prompt[b]] = float(d[row_to_prompt[b]])
            st, outs = orig_call(program, sp, state, max_rounds, pieces, end_after, num_pieces)
            srv.add(host_view(st), row_to_prompt, pre)
            chunks[0] += 1
            if chunks[0] == 1:
                log("server: chunk 1 done")
            return st, outs
        dec.call_chunk = call_chunk
        groups = np.array_split(np.arange(B), max(1, args.stagger))
        eng.pause_admission()
        eng.submit([seqs[i] for i in groups[0]])
        eng.resume_admission()
        for g in groups[1:]:
            target = chunks[0] + args.stagger_chunks
            while chunks[0] < target and not all(seqs[i].finished.is_set() for i in groups[0]):
                time.sleep(0.01)
            eng.submit([seqs[i] for i in g])
        deadline = time.perf_counter() + args.timeout
        for s in seqs:
            s.finished.wait(max(deadline - time.perf_counter(), 0.1))
        unfinished = sum(not s.finished.is_set() for s in seqs)
        srv_tokens = [list(s.tokens) for s in seqs]
        srv_acc = np.array([s.accepted / max(s.proposed, 1) for s in seqs])
        m = eng.metrics()
        report["server_metrics"] = {k: m.get(k) for k in (
            "acceptance_rate", "tokens_per_target_step", "chunks", "speculative_chunks",
            "plain_chunks", "draft_proposed", "draft_accepted", "position_acceptance")}
        report["server_slots"] = {int(index_of[k]): int(v) for k, v in slot_of.items()}
        log(f"server: {chunks[0]} chunks, acceptance {m.get('acceptance_rate'):.3f}, "
            f"unfinished {unfinished}, errors {[s.error for s in seqs if s.error][:2]}")
        eng.stop()

    # ---- static kernel plans of the verification (the score-writing kernel) at both S
    try:
        from pallas_kernels import dispatch as dsp
        from pallas_kernels.triton_decode import GPU_DEFAULTS, plan
        plans = {}
        T = args.gamma + 1
        for name, S in (("server", S_srv), ("generate", S_gen)):
            if S is None:
                continue
            q = jax.ShapeDtypeStruct((B, T, 12, 128), jnp.dtype(args.dtype))
            k = jax.ShapeDtypeStruct((args.layers, B, 2, S, 128), jnp.dtype(args.dtype))
            route = dsp.decode_route(q, k, interpret=True if args.attn_impl == "interpret" else None)
            pl_ = plan(B, 2, T, 6, S, 128, sink=0, window=0, bs=GPU_DEFAULTS,
                       on_gpu=jax.default_backend() == "gpu", itemsize=jnp.dtype(args.dtype).itemsize,
                       T_new=T)
            plans[name] = {"S": S, "route": route.kernel, "block_q,block_k,block_k_new,split,"
                           "num_splits,nq": list(pl_)}
        report["verify_plans"] = plans
        log(f"verify kernel plans (route, block_q, block_k, block_k_new, split, num_splits, nq): {plans}")
    except Exception as e:  # noqa: BLE001 - a diagnostic
        log(f"plan print failed: {e!r}")

    # ---- report
    print()
    print("=" * 100)
    print("RETRIEVAL PROBE: server (ServingEngine, dense slots) vs generate (INTERNAL Decoder.run loop)")
    print(f"B={B} P={int(lens.min())}..{int(lens.max())} layers={args.layers} new={args.new} "
          f"gamma={args.gamma} sink={args.sink} window={args.window} retrieve={args.retrieve} "
          f"impl={args.attn_impl} dtype={args.dtype} S(server)={S_srv} S(generate)={S_gen}")
    for rec in (gen, srv):
        if rec.snapshots:
            s = kvr_summary(rec)
            report[f"{rec.name}_kernel_vs_plain_jnp"] = s
            if s and not args.no_plain_scores:
                print(f"[{rec.name}] kernel scores vs plain-jnp scores (same q, same K): max|diff| "
                      f"{s['max_abs_diff']:.3g}, finite/-inf mismatches {s['finite_mismatch']}, "
                      f"heads whose selection differs {s['selection_diff_heads']} "
                      f"(over {s['snapshots']} snapshots)")
            report[f"{rec.name}_counter_mismatch"] = rec.counter_mismatch
            if rec.counter_mismatch:
                print(f"[{rec.name}] device round counter / verified length differ from the "
                      f"host's in {rec.counter_mismatch} row-rounds (expected with "
                      f"--chunk-rounds > 1)")
            nv, bad = range_violations(rec, args.sink, args.window, block)
            report[f"{rec.name}_range_violations"] = {"count": nv, "first": bad}
            print(f"[{rec.name}] selections outside their row's eligible blocks: {nv}"
                  + (f"  first: {bad[:2]}" if bad else ""))
    if gen.snapshots and srv.snapshots:
        cmp_ = compare(gen, srv, args, block)
        report["rounds"] = cmp_
        if kdiff:
            kv = np.array([kdiff.get(i, np.nan) for i in range(B)])
            report["prefill_k_max_abs_diff_per_prompt"] = [float(x) for x in kv]
            print(f"prefilled K, server slot vs generate row: max|diff| over rows "
                  f"{np.nanmax(kv):.3g}, rows with any diff {int(np.sum(kv > 0))}/{B}")
        print("per round of each row (selection after that round's verification = what the "
              "next round's drafts read):")
        for c in cmp_[:args.print_rounds]:
            print(f"  round {c['round']}: rows equal {c['rows_equal']}/{c['prompts']}, heads "
                  f"equal {c['heads_equal']}/{c['heads']} (differing by kind: {c['kinds']}), lengths equal "
                  f"{c['lengths_equal']}, verified equal {c['verified_equal']}, "
                  f"max|score diff| srv-gen "
                  f"{'n/a' if c['score_diff_max'] is None else format(c['score_diff_max'], '.3g')}")
            for d in c["diffs"][:args.show]:
                print(f"    prompt {d['prompt']} L{d['layer']} h{d['head']} {d['kind']}: len "
                      f"srv {d['srv_len']} gen {d['gen_len']}, verified srv {d['srv_verified']} "
                      f"gen {d['gen_verified']}; srv {d['srv']} gen {d['gen']}"
                      + (f"; only-in-one {d['only']} srv scores {d['srv_scores']} gen "
                         f"{d['gen_scores']} cuts srv {d['srv_cut']} gen {d['gen_cut']}, head "
                         f"max|score diff| {d['head_score_diff']}"
                         if "only" in d else ""))
        later = cmp_[args.print_rounds:]
        if later:
            he = sum(c["heads_equal"] for c in later)
            hh = sum(c["heads"] for c in later)
            print(f"  rounds {later[0]['round']}..{later[-1]['round']}: heads equal {he}/{hh}, "
                  f"lengths equal {sum(c['lengths_equal'] for c in later)}/"
                  f"{sum(c['prompts'] for c in later)}")

    for rec in (gen, srv):
        if rec.rows:
            a = acceptance_by_round(rec, args.gamma)
            report[f"acceptance_by_round_{rec.name}"] = a
            print(f"acceptance by round index (mean over rows, accepted/gamma) {rec.name:8s}: {a}")

    def first_diff(a, b):
        for j, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return j
        return None if len(a) == len(b) else min(len(a), len(b))

    def tok_cmp(name, a, b):
        if a is None or b is None:
            return
        eq = [x == y for x, y in zip(a, b)]
        fd = [first_diff(x, y) for x, y in zip(a, b)]
        report[f"tokens_{name}"] = {"rows_equal": int(sum(eq)), "first_diff": fd}
        bad = [(i, fd[i]) for i in range(len(eq)) if not eq[i]][:8]
        print(f"tokens {name}: rows equal {sum(eq)}/{len(eq)}"
              + (f"; first differing (prompt, index): {bad}" if bad else ""))

    print("greedy tokens (lossless: equal up to bf16 rounding of different shapes):")
    tok_cmp("server_vs_generate", srv_tokens, gen_tokens)
    tok_cmp("generate_loop_vs_public_generate", gen_tokens, pub_tokens)
    if gen_acc is not None or srv_acc is not None:
        print("acceptance per row (accepted / proposed drafts):")
        for name, acc in (("generate", gen_acc), ("server", srv_acc)):
            if acc is not None:
                report[f"acceptance_{name}"] = [round(float(x), 4) for x in acc]
                print(f"  {name:8s} mean {float(np.mean(acc)):.3f}: "
                      + " ".join(f"{x:.2f}" for x in acc))
    if "public_generate" in report:
        print(f"  jaxspec.generate (public) acceptance {report['public_generate']['acceptance_rate']:.3f}")
    if "server_metrics" in report:
        print(f"  server metrics acceptance {report['server_metrics']['acceptance_rate']:.3f}, "
              f"position acceptance {[round(x, 3) for x in report['server_metrics']['position_acceptance']]}")
    log("done")
    path = args.json or (os.path.join(os.environ["OUT"], "retr_probe.json")
                         if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=lambda o: o.tolist() if hasattr(o, "tolist")
                      else str(o))
        log(f"wrote {path}")


if __name__ == "__main__":
    main()
