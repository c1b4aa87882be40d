"""What a CPU user gets, measured through the public entry points only: the `jaxspec serve` CLI over
HTTP, the `jaxspec generate` CLI as a fresh process, and `jaxspec.generate`.

    python scripts/bench_cpu.py CHECKPOINT [--out benchmarks/cpu_smollm2] [--seeds 0,1,2]

1. Server, single stream, the default server (`jaxspec serve --model CHECKPOINT`, no other flags): start-up until
   /health answers (compiling included), then per prompt seed a ~50-token prompt streamed greedily
   (128 tokens): time to first token, tokens/s after the first token, end-to-end tokens/s.
2. The same server, 32 concurrent non-streaming 32-token requests (different prompts): wall time
   until all are answered.
3. Context, not capacity (`jaxspec.generate`, batch 4, 100-token prompts, 64 new tokens): decode
   seconds per step at max_len 8192 over max_len 128, after a warm-up call of each.
4. Compilation: fresh `jaxspec generate` processes one after the other (same shapes) over an
   empty jaxspec cache: the first compiles, the later ones load the kept programs; each one's wall
   time (one new token: process start to first token and exit) and its `compile_seconds`.

Each server request's prompt comes from `jaxspec.textdata` (several seeds); every timing is after a
warm-up request."""
import argparse
import concurrent.futures
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt_text(tokenizer, n_tokens: int, seed: int) -> str:
    from jaxspec.textdata import make_prompts
    ids = make_prompts(tokenizer, n=1, length=n_tokens, seed=seed)[0]
    return tokenizer.decode(ids, skip_special_tokens=True)


def stream(url: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = None
    n = 0
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            if ev.get("choices") and ev["choices"][0].get("text") and first is None:
                first = time.perf_counter() - t0
            if ev.get("usage"):
                n = ev["usage"]["completion_tokens"]
    total = time.perf_counter() - t0
    return {"ttft_s": first, "seconds": total, "tokens": n,
            "tokens_per_s_after_first": (n - 1) / (total - first) if n > 1 else None,
            "tokens_per_s": n / total}


def bench_server(ckpt: str, seeds, tokenizer) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = subprocess.Popen([PY, "-m", "jaxspec", "serve", "--model", ckpt, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(proc.stderr.read())
            time.sleep(0.2)
        startup = time.perf_counter() - t0
        health = httpx.get(url + "/health").json()
        stream(url, prompt_text(tokenizer, 50, 999), 16)  # warm-up
        single = [stream(url, prompt_text(tokenizer, 50, s), 128) for s in seeds]
        prompts = [prompt_text(tokenizer, 50, 100 + i) for i in range(32)]

        def one(p):
            t = time.perf_counter()
            r = httpx.post(url + "/v1/completions", timeout=900,
                           json={"prompt": p, "max_tokens": 32, "temperature": 0})
            r.raise_for_status()
            return time.perf_counter() - t, r.json()["usage"]["completion_tokens"]

        t = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(32) as ex:
            done = list(ex.map(one, prompts))
        wall = time.perf_counter() - t
        return {"startup_until_healthy_s": startup, "health": health, "single_stream": single,
                "concurrent_32x32": {"wall_s": wall, "tokens": sum(n for _, n in done),
                                     "latency_p50_s": statistics.median(d for d, _ in done),
                                     "latency_max_s": max(d for d, _ in done)}}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def bench_context(ckpt: str) -> dict:
    import jaxspec
    from jaxspec.textdata import make_prompts
    model = jaxspec.load(ckpt)
    prompts = make_prompts(model.tokenizer, n=4, length=100, seed=3)
    out = {}
    for max_len in (128, 8192):
        kw = dict(max_new_tokens=24, max_len=max_len, ignore_eos=True)
        jaxspec.generate(model, prompts, **kw)  # compile
        runs = [jaxspec.generate(model, prompts, **kw).stats for _ in range(3)]
        per_step = statistics.median(r["decode_seconds"] / r["target_steps"] for r in runs)
        out[max_len] = {"seconds_per_step": per_step}
    out["ratio_8192_over_128"] = out[8192]["seconds_per_step"] / out[128]["seconds_per_step"]
    return out


def bench_second_process(ckpt: str) -> dict:
    """Fresh `jaxspec generate` processes over an empty jaxspec cache: the first compiles (and
    fills the cache), the later ones start from it. Wall time of a whole process asked for one
    new token (its first token comes before it exits) and for 32."""
    def one(n_new: int, env: dict) -> dict:
        t = time.perf_counter()
        r = subprocess.run([PY, "-m", "jaxspec", "generate", ckpt, "--chat", "--prompt",
                            "Write a haiku about the sea.", "--max-new-tokens", str(n_new)],
                           capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t
        if r.returncode:
            raise RuntimeError(r.stderr)
        stats = json.loads([ln for ln in r.stderr.splitlines() if ln.startswith("{")][-1])
        return {"wall_s": round(wall, 2), **{k: stats.get(k) for k in (
            "new_tokens", "compile_seconds", "prefill_seconds", "decode_seconds", "seconds")}}

    import tempfile
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, JAXSPEC_CACHE=cache)
        first = one(1, env)
        later = [one(1, env) for _ in range(3)]
        longer = [one(32, env) for _ in range(2)]
    return {"first_process_one_token": first, "later_processes_one_token": later,
            "later_one_token_median_wall_s": statistics.median(r["wall_s"] for r in later),
            "later_processes_32_tokens": longer}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", default=None, help="path prefix of the JSON written")
    a = ap.parse_args()
    from jaxspec.bench import environment
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.checkpoint)
    seeds = [int(s) for s in a.seeds.split(",")]
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), "")
    res = {"environment": {**environment(), "cpu": cpu, "cores": os.cpu_count()}, "checkpoint": os.path.basename(a.checkpoint.rstrip("/")),
           "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d")}
    res["server"] = bench_server(a.checkpoint, seeds, tok)
    print(json.dumps(res["server"], indent=1), flush=True)
    res["second_process"] = bench_second_process(a.checkpoint)
    print(json.dumps(res["second_process"], indent=1), flush=True)
    res["context"] = bench_context(a.checkpoint)
    print(json.dumps(res["context"], indent=1), flush=True)
    if a.out:
        Path(a.out + ".json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
