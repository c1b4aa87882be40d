"""`jaxspec.tokenizer.Tokenizer` (tokenizer.json read by `tokenizers`, chat templates by jinja2)
gives what transformers' tokenizer of the same folder gives: ids, decoded text, chat templates,
special tokens; and loading a checkpoint does not import transformers."""

import json
import subprocess
import sys

import numpy as np
import pytest

from jaxspec.checkpoint import save_tokenizer
from jaxspec.tokenizer import Tokenizer, load_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def area(r):\n    return 3.14159 * r ** 2\n",
    "Tokenizers split text into pieces; les élèves étudient à Paris. 東京は大きい。",
    "  spaces   and\ttabs\nnew lines\r\n and émoji 🙂🙃 ",
    "<p>HTML &amp; entities</p> {\"json\": [1, 2, 3]}",
]
SPECIALS = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]

# chat templates written for these tests, in the styles models use
TEMPLATES = {
    "roles": ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' }}\n"
              "{{ m['content'] | trim }}{{ eos_token }}\n{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
    "system_default": (
        "{% if messages[0]['role'] != 'system' %}<|system|>\nYou answer briefly.</s>\n{% endif %}"
        "{% for m in messages %}\n  {% if m['role'] not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
        "<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
    "alternating": (
        "{{ bos_token }}{% for m in messages %}"
        "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate') }}{% endif %}"
        "{% if m['role'] == 'user' %}[Q] {{ m['content'] | tojson }}"
        "{% else %}{% generation %}[A] {{ m['content'] }}{% endgeneration %}{{ eos_token }}"
        "{% endif %}{% if loop.last %}{% break %}{% endif %}{% endfor %}"),
}


def build_tokenizer(folder, *, bos: bool, template: str | None, config: dict | None = None):
    """A byte-level BPE tokenizer trained on CORPUS (BOS added by the post-processor when
    ``bos``), saved as a checkpoint saves it; ``config`` overrides tokenizer_config.json keys."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, processors, \
        trainers
    from transformers import PreTrainedTokenizerFast
    t = Backend(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if bos:
        t.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", t.token_to_id("<s>"))])
    tok = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>", pad_token="</s>",
                                  additional_special_tokens=SPECIALS[3:])
    if template is not None:
        tok.chat_template = template
    save_tokenizer(tok, folder)
    if config:
        path = folder / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return tok


def random_texts(rng, n):
    pieces = SPECIALS + [w for text in CORPUS for w in text.split(" ")] + ["\n", " ", "\t", "  "]
    return ["".join(rng.choice(pieces, size=int(rng.integers(0, 12)))) for _ in range(n)]


@pytest.mark.parametrize("bos", [True, False])
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_the_same_as_transformers(tmp_path, bos, name):
    from transformers import AutoTokenizer
    build_tokenizer(tmp_path, bos=bos, template=TEMPLATES[name])
    ours, hf = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert isinstance(ours, Tokenizer)
    rng = np.random.default_rng()
    texts = CORPUS + random_texts(rng, 60)
    for text in texts:
        for special in (True, False):
            assert ours(text, add_special_tokens=special)["input_ids"] == \
                hf(text, add_special_tokens=special)["input_ids"], (text, special)
        assert ours.encode(text) == hf.encode(text), text
    assert ours(texts, add_special_tokens=False)["input_ids"] == \
        hf(texts, add_special_tokens=False)["input_ids"]
    for _ in range(60):
        ids = rng.integers(0, len(hf), size=int(rng.integers(1, 40))).tolist()
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False) \
                == hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False), ids
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id",
                 "eos_token_id", "unk_token_id", "pad_token_id", "chat_template"):
        assert getattr(ours, attr) == getattr(hf, attr), attr
    assert ours.get_vocab() == hf.get_vocab() and len(ours) == len(hf)
    for token in SPECIALS + ["Ġthe", "no-such-token"]:
        assert ours.convert_tokens_to_ids(token) == hf.convert_tokens_to_ids(token), token
    # chat: conversations of random texts, with and without the generation prompt
    roles = ["user", "assistant"]
    for k in range(1, 6):
        words = random_texts(rng, k)
        conv = [{"role": roles[i % 2], "content": w} for i, w in enumerate(words)]
        if name == "system_default" and k % 2:
            conv = [{"role": "system", "content": "Be kind."}] + conv
        for gen in (True, False):
            want = hf.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
            assert ours.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False) \
                == want
            ids = hf.apply_chat_template(conv, add_generation_prompt=gen, tokenize=True,
                                         return_dict=False)
            assert ours.apply_chat_template(conv, add_generation_prompt=gen) == list(ids)
    # a template's raise_exception is an error, as with transformers
    bad = [{"role": "tool", "content": "x"}] if name == "system_default" else \
        [{"role": "assistant", "content": "x"}]
    if name != "roles":
        import jinja2
        with pytest.raises(jinja2.exceptions.TemplateError):
            hf.apply_chat_template(bad, tokenize=False)
        with pytest.raises(jinja2.exceptions.TemplateError):
            ours.apply_chat_template(bad, tokenize=False)


def test_saved_truncation_padding_and_split_special_tokens(tmp_path):
    """A tokenizer.json saved with truncation / padding on (fine-tuning scripts do) cut every
    prompt: transformers encodes without them; split_special_tokens in tokenizer_config.json
    was ignored (user text "<|user|>" became the control token)."""
    from transformers import AutoTokenizer
    build_tokenizer(tmp_path / "a", bos=True, template=TEMPLATES["roles"])
    path = tmp_path / "a" / "tokenizer.json"
    j = json.loads(path.read_text())
    j["truncation"] = {"direction": "Right", "max_length": 5, "strategy": "LongestFirst",
                       "stride": 0}
    j["padding"] = {"strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": None,
                    "pad_id": 1, "pad_type_id": 0, "pad_token": "</s>"}
    path.write_text(json.dumps(j))
    ours, hf = load_tokenizer(tmp_path / "a"), AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    for text in CORPUS:
        assert ours.encode(text) == hf.encode(text) and len(ours.encode(text)) > 5
    assert ours(CORPUS[:2])["input_ids"] == hf(CORPUS[:2])["input_ids"]
    conv = [{"role": "user", "content": CORPUS[0]}]
    want = hf.apply_chat_template(conv, tokenize=False)
    assert ours.apply_chat_template(conv) == hf(want, add_special_tokens=False)["input_ids"]
    build_tokenizer(tmp_path / "b", bos=True, template=None, config={"split_special_tokens": True})
    ours, hf = load_tokenizer(tmp_path / "b"), AutoTokenizer.from_pretrained(str(tmp_path / "b"))
    text = "<|user|>hi</s>"
    assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert hf.convert_tokens_to_ids("<|user|>") not in ours.encode(text, add_special_tokens=False)


def test_arguments_in_the_order_of_transformers(tmp_path):
    """encode(text, pair) and tok(text, pair) raised; apply_chat_template(conversation, tools)
    took the tools for add_generation_prompt; decode of a numpy scalar id raised, of a batch too."""
    from transformers import AutoTokenizer
    template = ("{% if tools %}[TOOLS]{{ tools | tojson }}\n{% endif %}{% for m in messages %}"
                "<|{{ m.role }}|>{{ m.content }}</s>{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    build_tokenizer(tmp_path, bos=True, template=template)
    ours, hf = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.encode("the dog", "a fox") == hf.encode("the dog", "a fox")
    assert ours("the dog", "a fox")["input_ids"] == hf("the dog", "a fox")["input_ids"]
    conv = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert ours.apply_chat_template(conv, tools, tokenize=False) == \
        hf.apply_chat_template(conv, tools, tokenize=False)
    assert ours.apply_chat_template(conv, None, None, None, True, tokenize=False) == \
        hf.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    ids = ours.encode("the fox jumps")
    assert ours.decode(np.int64(ids[1])) == hf.decode([ids[1]])
    assert ours.decode(np.asarray([ids, ids])) == [hf.decode(ids)] * 2


def test_everything_else_goes_to_transformers(tmp_path):
    build_tokenizer(tmp_path, bos=True, template=TEMPLATES["roles"])
    ours = load_tokenizer(tmp_path)
    ids = [ours(t)["input_ids"] for t in CORPUS[:2]]
    assert ours.batch_decode(ids, skip_special_tokens=True) == \
        [ours.decode(i, skip_special_tokens=True) for i in ids]
    assert type(ours.hf).__module__.startswith("transformers")
    enc = ours("the fox")
    assert enc.input_ids == enc["input_ids"] and enc.attention_mask == [1] * len(enc.input_ids)
    import pickle
    again = pickle.loads(pickle.dumps(ours))
    assert again("the fox")["input_ids"] == enc["input_ids"]
    assert again.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        ours.apply_chat_template([{"role": "user", "content": "hi"}])
    # inputs this class does not render itself (content parts) go to transformers as well
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    try:
        want = ours.hf.apply_chat_template(parts, tokenize=False)
    except Exception as e:  # noqa: BLE001 - the template may not take parts: the same error
        with pytest.raises(type(e)):
            ours.apply_chat_template(parts, tokenize=False)
    else:
        assert ours.apply_chat_template(parts, tokenize=False) == want


def test_settings_it_does_not_reproduce_are_left_to_transformers(tmp_path):
    # BOS asked for by tokenizer_config.json but not added by tokenizer.json's post-processor
    build_tokenizer(tmp_path / "a", bos=False, template=None, config={"add_bos_token": True})
    assert load_tokenizer(tmp_path / "a") is None
    # ... and consistent settings are fine
    build_tokenizer(tmp_path / "b", bos=True, template=None, config={"add_bos_token": True})
    assert isinstance(load_tokenizer(tmp_path / "b"), Tokenizer)
    # named chat templates
    build_tokenizer(tmp_path / "c", bos=True, template=None, config={
        "chat_template": [{"name": "default", "template": TEMPLATES["roles"]}]})
    assert load_tokenizer(tmp_path / "c") is None
    assert load_tokenizer(tmp_path / "nothing-here") is None


def test_loading_a_checkpoint_does_not_import_transformers(tmp_path):
    import jaxspec
    from tiny import tiny_model
    m = tiny_model()
    m.tokenizer = build_tokenizer(tmp_path / "tok", bos=True, template=TEMPLATES["roles"])
    jaxspec.save(m, tmp_path / "ckpt")
    code = (
        "import sys, jaxspec\n"
        f"m = jaxspec.load({str(tmp_path / 'ckpt')!r})\n"
        "ids = m.tokenizer('the fox')['input_ids']\n"
        "chat = m.tokenizer.apply_chat_template([{'role': 'user', 'content': 'hi'}],"
        " add_generation_prompt=True)\n"
        "print(type(m.tokenizer).__name__, 'transformers' in sys.modules, ids, chat)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True).stdout.split(" ", 2)
    assert out[:2] == ["Tokenizer", "False"], out
    hf = m.tokenizer
    want = f"{hf('the fox')['input_ids']} " + str(list(hf.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True,
        return_dict=False)))
    assert out[2].strip() == want
