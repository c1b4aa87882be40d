"""Checkpoint conversion (HF safetensors incl. sharded, GGUF), atomicity, CLI, and clear errors."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

import jaxspec
from jaxspec.checkpoint import CheckpointError

from hf_models import convert_hf, jax_logits, make_hf_model, torch_logits


def test_gguf_converts_to_same_logits_as_transformers(tmp_path):
    """HF model -> GGUF (written like llama.cpp, q/k permuted) -> jaxspec.convert -> logits."""
    from test_gguf_io import write_tiny_gguf
    for variant, arch in (("llama-gqa", "llama"), ("qwen2-bias", "qwen2"), ("llama-bias", "llama"),
                          ("qwen3", "qwen3")):
        hf = make_hf_model(variant, seed=4)
        sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
        path = write_tiny_gguf(tmp_path / f"{variant}.gguf", sd, hf.config, arch)
        model = jaxspec.load(jaxspec.convert(path, tmp_path / variant, dtype="float32",
                                             progress=False))
        tokens = np.random.default_rng(0).integers(0, hf.config.vocab_size, size=(2, 19))
        np.testing.assert_allclose(jax_logits(model, tokens), torch_logits(hf, tokens),
                                   atol=1e-4, rtol=0)


def test_gguf_rope_freqs_give_the_logits_of_transformers(tmp_path):
    """The RoPE scaling of a Llama-3.1 GGUF lives in its `rope_freqs` tensor. Both forms: factors
    of the llama3 form (read back as HF's rope_scaling), and any other factors (kept as
    `rope_freq_factors`; transformers' frequencies divided by them, as llama.cpp does)."""
    import torch

    from test_gguf_io import llama_cpp_rope_factors, write_tiny_gguf
    tokens = np.random.default_rng(2).integers(0, 101, size=(2, 150))  # past 64: scaling bites
    hf = make_hf_model("llama3-rope", seed=5)
    cfg = hf.config.to_dict()
    scaling = dict(cfg.get("rope_parameters") or cfg["rope_scaling"])
    theta = scaling.get("rope_theta", cfg.get("rope_theta"))
    factors = llama_cpp_rope_factors(scaling, theta, 16)
    assert 1.0 < factors.max() and len(set(factors.tolist())) > 2  # high, medium and low bands
    plain = dict(cfg, rope_scaling=None, rope_parameters=None, rope_theta=theta)
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    path = write_tiny_gguf(tmp_path / "l3.gguf", sd, plain, "llama",
                           extra_tensors={"rope_freqs.weight": factors})
    model = jaxspec.load(jaxspec.convert(path, tmp_path / "l3", dtype="float32", progress=False))
    assert dict(model.config.rope_scaling)["rope_type"] == "llama3"
    np.testing.assert_allclose(jax_logits(model, tokens), torch_logits(hf, tokens), atol=1e-4, rtol=0)

    hf = make_hf_model("llama-gqa", seed=6)
    factors = np.random.default_rng(4).uniform(0.5, 6.0, size=8).astype(np.float32)
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    path = write_tiny_gguf(tmp_path / "f.gguf", sd, hf.config, "llama",
                           extra_tensors={"rope_freqs.weight": factors})
    model = jaxspec.load(jaxspec.convert(path, tmp_path / "f", dtype="float32", progress=False))
    assert model.config.rope_freq_factors is not None
    want_plain = torch_logits(hf, tokens)
    rot = hf.model.rotary_emb
    rot.inv_freq = rot.inv_freq / torch.from_numpy(factors)
    want = torch_logits(hf, tokens)
    assert np.abs(want - want_plain).max() > 1e-2  # the factors matter at these positions
    np.testing.assert_allclose(jax_logits(model, tokens), want, atol=1e-4, rtol=0)


def test_sharded_safetensors_and_dtype(tmp_path):
    hf = make_hf_model("llama-gqa", seed=9)
    src = tmp_path / "hf"
    hf.save_pretrained(src, max_shard_size="20KB")
    assert (src / "model.safetensors.index.json").exists()
    dst = jaxspec.convert(src, tmp_path / "ckpt", progress=False)  # default bfloat16
    model = jaxspec.load(dst)
    assert model.dtype == jax.numpy.bfloat16
    m32 = jaxspec.load(dst, dtype="float32")
    tokens = np.random.default_rng(1).integers(0, 101, size=(1, 12))
    np.testing.assert_allclose(jax_logits(m32, tokens), torch_logits(hf, tokens), atol=0.15)


def test_conversion_is_atomic(tmp_path, monkeypatch):
    hf = make_hf_model("llama-gqa", seed=1)
    src = tmp_path / "hf"
    hf.save_pretrained(src)
    good = jaxspec.convert(src, tmp_path / "ckpt", dtype="float32", progress=False)
    before = sorted(p.relative_to(good) for p in good.rglob("*"))
    import jaxspec.checkpoint as ck

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ck, "_save_params", boom)
    with pytest.raises(KeyboardInterrupt):
        jaxspec.convert(src, tmp_path / "ckpt", overwrite=True, progress=False)
    with pytest.raises(KeyboardInterrupt):
        jaxspec.convert(src, tmp_path / "fresh", progress=False)
    assert not (tmp_path / "fresh").exists()
    assert sorted(p.relative_to(good) for p in good.rglob("*")) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left
    jaxspec.load(good)  # still loads


def test_refuses_to_overwrite(tmp_path):
    hf = make_hf_model("llama-gqa", seed=1)
    hf.save_pretrained(tmp_path / "hf")
    jaxspec.convert(tmp_path / "hf", tmp_path / "ckpt", progress=False)
    with pytest.raises(FileExistsError, match="overwrite"):
        jaxspec.convert(tmp_path / "hf", tmp_path / "ckpt", progress=False)


def test_overwrite_replaces_only_a_checkpoint(tmp_path):
    """overwrite=True deleted whatever folder it was given: the source itself, a folder holding
    the source, or one that was no checkpoint at all (save() too)."""
    from tiny import tiny_model
    hf = make_hf_model("llama-gqa", seed=1)
    src = tmp_path / "models" / "hf"
    hf.save_pretrained(src)
    files = sorted(p.name for p in src.iterdir())
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.tex").write_text("mine")
    for dst, err in ((src, ValueError), (src.parent, ValueError), (notes, FileExistsError)):
        with pytest.raises(err, match="source|not a jaxspec checkpoint"):
            jaxspec.convert(src, dst, overwrite=True, progress=False)
    with pytest.raises(FileExistsError, match="not a jaxspec checkpoint"):
        jaxspec.save(tiny_model(), notes, overwrite=True)
    assert sorted(p.name for p in src.iterdir()) == files
    assert (notes / "thesis.tex").read_text() == "mine"
    ck = jaxspec.convert(src, tmp_path / "ck", progress=False)
    jaxspec.convert(src, ck, overwrite=True, dtype="float32", progress=False)  # a checkpoint: yes
    assert jaxspec.load(ck).dtype == np.float32
    with pytest.raises(PermissionError, match="cannot write"):  # before any weight is read
        jaxspec.convert(src, notes / "thesis.tex" / "ck", progress=False)


def test_checkpoint_folders_follow_the_umask(tmp_path):
    """mkdtemp's 0700 stayed the checkpoint's mode: another user (a server) could not read it."""
    from tiny import tiny_model
    old = os.umask(0o027)
    try:
        ck = jaxspec.save(tiny_model(), tmp_path / "ck")
    finally:
        os.umask(old)
    assert ck.stat().st_mode & 0o777 == 0o750


def test_save_and_load_check_what_they_are_given(tmp_path):
    """save() wrote parameters whose shapes the config contradicts (a checkpoint load refused);
    load(dtype="int8") cast every weight to 0."""
    from tiny import tiny_model
    m = tiny_model()
    bad = dict(m.params, final_norm=m.params["final_norm"][:-1])
    with pytest.raises(CheckpointError, match="final_norm"):
        jaxspec.save(bad, tmp_path / "bad", config=m.config)
    assert not (tmp_path / "bad").exists()
    ck = jaxspec.save(m, tmp_path / "ck")
    for dtype in ("int8", "float64", "nope"):
        with pytest.raises(ValueError, match="dtype"):
            jaxspec.load(ck, dtype=dtype)


def test_config_errors_and_defaults(tmp_path):
    """A config.json that is a list raised a raw AttributeError, a null field an int() error
    that named no field; a Qwen3 config without head_dim took hidden / heads where transformers
    takes 128."""
    import transformers
    from jaxspec.config import ConfigError, ModelConfig
    with pytest.raises(ConfigError, match="JSON object"):
        ModelConfig.from_hf_dict([1, 2])
    d = make_hf_model("qwen3", seed=0).config.to_dict()
    with pytest.raises(ConfigError, match="num_attention_heads"):
        ModelConfig.from_hf_dict({**d, "num_attention_heads": None})
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_hf_dict({**d, "hidden_size": "64"})
    d.pop("head_dim")
    want = transformers.Qwen3Config(**d).head_dim
    assert want != d["hidden_size"] // d["num_attention_heads"]
    assert ModelConfig.from_hf_dict(d).head_dim == want


def test_bad_checkpoints_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        jaxspec.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a jaxspec checkpoint"):
        jaxspec.load(tmp_path / "empty")
    hf = make_hf_model("llama-gqa", seed=1)
    hf.save_pretrained(tmp_path / "hf")
    with pytest.raises(CheckpointError, match="convert"):
        jaxspec.load(tmp_path / "hf")
    ck = jaxspec.convert(tmp_path / "hf", tmp_path / "ckpt", progress=False)
    (ck / "jaxspec_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt"):
        jaxspec.load(ck)
    ck2 = jaxspec.convert(tmp_path / "hf", tmp_path / "ckpt2", progress=False)
    for f in (ck2 / "params").rglob("*"):
        if f.is_file() and f.stat().st_size > 1000:
            f.write_bytes(b"\0" * 10)
    with pytest.raises(CheckpointError, match="cannot restore"):
        jaxspec.load(ck2)


def test_gguf_yarn_gives_the_logits_of_transformers(tmp_path):
    """A GGUF's YaRN metadata (`rope.scaling.type` yarn, factor, original context, llama.cpp's
    attn_factor, which multiplies YaRN's own 1 + 0.1 ln(factor)) -> transformers' yarn."""
    import math

    from test_gguf_io import write_tiny_gguf
    tokens = np.random.default_rng(3).integers(0, 101, size=(2, 120))
    for attn_factor in (None, 0.8):
        scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
        if attn_factor is not None:
            scaling["attention_factor"] = attn_factor * (1 + 0.1 * math.log(4.0))
        hf = make_hf_model("qwen2-yarn", seed=7, rope_scaling=scaling)
        cfg = hf.config.to_dict()
        plain = dict(cfg, rope_scaling=None, rope_parameters=None,
                     rope_theta=(cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        meta = {"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
                "qwen2.rope.scaling.original_context_length": 64}
        if attn_factor is not None:
            meta["qwen2.rope.scaling.attn_factor"] = attn_factor
        sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
        path = write_tiny_gguf(tmp_path / f"y{attn_factor}.gguf", sd, plain, "qwen2", metadata=meta)
        model = jaxspec.load(jaxspec.convert(path, tmp_path / f"y{attn_factor}", dtype="float32",
                                             progress=False))
        np.testing.assert_allclose(jax_logits(model, tokens), torch_logits(hf, tokens),
                                   atol=1e-4, rtol=0)


def test_unsupported_model_options_are_refused_when_the_config_is_read(tmp_path):
    """Options jaxspec does not run are refused with their name, not run wrongly."""
    from jaxspec.config import ConfigError, ModelConfig
    base = dict(model_type="llama", vocab_size=101, hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    ModelConfig.from_hf_dict(dict(base, hidden_act="silu"))
    for extra, match in (
            (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
            (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "'dynamic'.*dynamic NTK"),
            (dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}), "'longrope'"),
            (dict(rope_scaling={"rope_type": "su", "factor": 2.0}), "'su'"),
            (dict(rope_scaling={"rope_type": "linear"}), "needs a 'factor'"),
            (dict(partial_rotary_factor=0.5), "partial rotary"),
            (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4,
                                   "partial_rotary_factor": 0.5}), "partial rotary")):
        with pytest.raises(ConfigError, match=match):
            ModelConfig.from_hf_dict(dict(base, **extra))
    # transformers builds Qwen2 with q/k/v biases and Mistral without, whatever the field says
    assert ModelConfig.from_hf_dict(dict(base, model_type="qwen2", attention_bias=False)).attention_bias
    assert not ModelConfig.from_hf_dict(dict(base, model_type="mistral", attention_bias=True,
                                             mlp_bias=True)).attention_bias
    llama = ModelConfig.from_hf_dict(dict(base, attention_bias=True, mlp_bias=True))
    assert llama.attention_out_bias and llama.mlp_bias
    assert ModelConfig.from_hf_dict(llama.to_hf_dict()) == llama
    with pytest.raises(ConfigError, match="mlp_bias"):
        ModelConfig(model_type="qwen2", vocab_size=8, hidden_size=8, intermediate_size=8,
                    num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, mlp_bias=True)


def test_unsupported_architecture_and_missing_source(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        jaxspec.convert(src, tmp_path / "out")
    with pytest.raises(FileNotFoundError):
        jaxspec.convert(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "x.bin").write_bytes(b"123")
    with pytest.raises(ValueError, match="gguf"):
        jaxspec.convert(tmp_path / "x.bin", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_generate_rejects_bad_input(tmp_path):
    from tiny import tiny_model
    m = tiny_model(ctx=64)
    cases = [
        (dict(prompts=[]), ValueError, "empty"),
        (dict(prompts=[[1, 2], []]), ValueError, "prompt 1 is empty"),
        (dict(prompts=[[1] * 64]), ValueError, "context"),
        (dict(prompts=[[1, 999]]), ValueError, "vocabulary"),
        (dict(prompts=["hi"]), ValueError, "tokenizer"),
        (dict(prompts="hello"), TypeError, "list of prompts"),
        (dict(max_new_tokens=-1), ValueError, "max_new_tokens"),
        (dict(top_p=0.0), ValueError, "top_p"),
        (dict(top_p=1.5), ValueError, "top_p"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(top_k=-2), ValueError, "top_k"),
    ]
    for kw, exc, msg in cases:
        args = dict(prompts=[[1, 2, 3]], max_new_tokens=4) | kw
        with pytest.raises(exc, match=msg):
            jaxspec.generate(m, args.pop("prompts"), **args)
    assert jaxspec.generate(m, [[1, 2]], max_new_tokens=0).tokens == [[]]


def test_cli_convert_and_generate(tmp_path):
    hf = make_hf_model("llama-gqa", seed=1)
    hf.save_pretrained(tmp_path / "hf")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = lambda *a: subprocess.run([sys.executable, "-m", "jaxspec", *a], capture_output=True,
                                    text=True, env=env, timeout=300)
    r = run("convert", str(tmp_path / "hf"), str(tmp_path / "ck"), "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    r = run("generate", str(tmp_path / "ck"), "--prompt", "hello", "--max-new-tokens", "3")
    assert r.returncode == 2 and "tokenizer" in r.stderr  # tiny model has no tokenizer
    r = run("generate", str(tmp_path / "nope"), "--prompt", "x")
    assert r.returncode == 2 and "no checkpoint" in r.stderr and "Traceback" not in r.stderr


def test_tokenizer_that_cannot_be_built_is_an_error_with_a_remedy(tmp_path, capsys):
    """A GGUF whose tokenizer cannot be rebuilt, or a Hugging Face folder whose tokenizer files do not
    load, stops the conversion before any weight is read (nothing is written) and names the remedy;
    --no-tokenizer converts the weights alone."""
    from jaxspec import cli
    from test_gguf_io import byte_level_vocab, tiny_model, write_tiny_gguf

    vocab = dict(byte_level_vocab(), pre="a-pre-tokenizer-nobody-knows")
    tiny = tiny_model("qwen2", vocab=len(vocab["tokens"]))
    gguf_path = write_tiny_gguf(tmp_path / "m.gguf", tiny.state, tiny.config, tokenizer=vocab)
    with pytest.raises(ValueError, match="a-pre-tokenizer-nobody-knows(.|\n)*Hugging Face folder(.|\n)*--no-tokenizer"):
        jaxspec.convert(gguf_path, tmp_path / "a", progress=False)
    with pytest.raises(SystemExit) as e:
        cli.main(["convert", str(gguf_path), str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--no-tokenizer" in err and "Traceback" not in err
    assert not (tmp_path / "a").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    cli.main(["convert", str(gguf_path), str(tmp_path / "a"), "--no-tokenizer", "--dtype", "float32"])
    assert not (tmp_path / "a" / "tokenizer.json").exists()
    assert jaxspec.load(tmp_path / "a").tokenizer is None

    hf = make_hf_model("llama-gqa", seed=1)
    hf.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text("{not a tokenizer")
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "NoSuchTokenizer"}))
    with pytest.raises(CheckpointError, match="cannot load the tokenizer(.|\n)*--no-tokenizer"):
        jaxspec.convert(tmp_path / "hf", tmp_path / "b", progress=False)
    assert not (tmp_path / "b").exists()
    assert jaxspec.convert(tmp_path / "hf", tmp_path / "b", progress=False, tokenizer=False).exists()
