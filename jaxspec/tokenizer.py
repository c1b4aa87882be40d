"""A checkpoint's tokenizer without transformers on the start-up path.

Importing transformers takes 2-5 s on a CPU machine (more when PyTorch is installed, which
transformers then imports), longer than loading a small model's weights. `Tokenizer` reads a
checkpoint's ``tokenizer.json`` with the `tokenizers` library and renders its chat template with
jinja2, in the environment transformers documents for chat templates (sandboxed, ``trim_blocks``
and ``lstrip_blocks``, loop controls, a ``tojson`` that does not escape HTML, ``raise_exception``,
``strftime_now``). That covers what jaxspec does with a tokenizer: encode text, decode ids, apply
the chat template to text messages, look up tokens. Everything else (``batch_decode``,
``save_pretrained``, tensors, tools in chat templates, ...) goes to the transformers tokenizer of
the same folder, loaded the first time it is needed: ``model.tokenizer`` keeps the transformers
interface. ``model.tokenizer.hf`` is that transformers tokenizer.

`load_tokenizer` gives None for a folder without ``tokenizer.json`` (the caller then uses
transformers), and so does a tokenizer configuration this class does not reproduce exactly (a
``add_bos_token`` / ``add_eos_token`` setting that ``tokenizer.json``'s post-processor does not
apply, a list of named chat templates).
"""

from __future__ import annotations

import datetime
import json
import pathlib
import threading
from typing import Any

import numpy as np

SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
           "mask_token")
_CHAT_KWARGS = {"tokenize", "add_generation_prompt", "return_dict", "tools", "documents"}


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json stores it (a string or an AddedToken dict)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Encoding(dict):
    """``input_ids`` / ``attention_mask`` as keys and as attributes (as transformers' encoding)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _read_json(path: pathlib.Path) -> dict:
    if not path.exists():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def chat_template_of(folder: pathlib.Path, config: dict):
    """The folder's chat template: chat_template.jinja, chat_template.json or tokenizer_config's
    ``chat_template`` (a string, or a list of named templates), as transformers looks for it."""
    path = folder / "chat_template.jinja"
    if path.exists():
        return path.read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template")
    return template if template is not None else config.get("chat_template")


def _environment():
    """The jinja2 environment chat templates are written for."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (marks the assistant's text for training
        masks): rendered as its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


class Tokenizer:
    """A checkpoint's tokenizer (see the module docstring). Build it with `load_tokenizer`."""

    def __init__(self, folder: pathlib.Path, backend, config: dict, chat_template: str | None):
        self._folder = pathlib.Path(folder)
        self._backend = backend
        self._config = config
        self._chat_template = chat_template
        self._template = None  # compiled on first use
        self._hf = None
        self._lock = threading.Lock()
        self._specials = {k: _token_text(config.get(k)) for k in SPECIAL}
        extra = config.get("additional_special_tokens") or config.get("extra_special_tokens")
        self._extra = [t for t in map(_token_text, extra) if t] if isinstance(extra, list) else []

    # ---------------------------------------------------------------- what transformers offers too
    @property
    def hf(self):
        """The transformers tokenizer of the same folder (loaded on first use)."""
        with self._lock:
            if self._hf is None:
                from transformers import AutoTokenizer, PreTrainedTokenizerFast
                try:
                    self._hf = AutoTokenizer.from_pretrained(str(self._folder))
                except Exception:  # noqa: BLE001 - a class this transformers does not know
                    self._hf = PreTrainedTokenizerFast.from_pretrained(str(self._folder))
            return self._hf

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __repr__(self):
        return f"jaxspec.tokenizer.Tokenizer({str(self._folder)!r}, vocab={len(self)})"

    def __getstate__(self):  # (picklable, as transformers' tokenizers are: for worker processes)
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_hf", "_template")}

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.Lock(), _hf=None, _template=None)

    def __len__(self):
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def backend_tokenizer(self):
        """The `tokenizers.Tokenizer`."""
        return self._backend

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def __call__(self, text, text_pair=None, add_special_tokens: bool = True, **kw):
        kw.pop("verbose", None)
        if text_pair is not None:
            kw["text_pair"] = text_pair
        if kw or not (isinstance(text, str) or isinstance(text, list)
                      and all(isinstance(t, str) for t in text)):
            return self.hf(text, add_special_tokens=add_special_tokens, **kw)
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens=add_special_tokens)
            return Encoding(input_ids=ids, attention_mask=[1] * len(ids))
        encs = self._backend.encode_batch(text, add_special_tokens=add_special_tokens)
        return Encoding(input_ids=[e.ids for e in encs],
                        attention_mask=[[1] * len(e.ids) for e in encs])

    def encode(self, text: str, text_pair=None, add_special_tokens: bool = True,
               **kw) -> list[int]:
        if text_pair is not None:
            kw["text_pair"] = text_pair
        if kw or not isinstance(text, str):
            return self.hf.encode(text, add_special_tokens=add_special_tokens, **kw)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None, **kw) -> str:
        clean = (self._config.get("clean_up_tokenization_spaces", False)
                 if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces)
        if kw or clean:
            return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens,
                                  clean_up_tokenization_spaces=clean_up_tokenization_spaces, **kw)
        ids = np.asarray(token_ids)  # an int, a numpy / jax scalar, a list, an array
        if ids.ndim == 0:
            ids = ids.reshape(1)
        if ids.ndim == 2:  # a batch: one text per row, as transformers 5 decodes it
            return [self.decode(row, skip_special_tokens, clean_up_tokenization_spaces)
                    for row in ids]
        return self._backend.decode([int(t) for t in ids.reshape(-1)],
                                    skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            i = self._backend.token_to_id(tokens)
            return self.unk_token_id if i is None else i
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        if skip_special_tokens:
            return self.hf.convert_ids_to_tokens(ids, skip_special_tokens=True)
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        return [self._backend.id_to_token(int(i)) for i in ids]

    def _special(self, key):
        return self._specials[key]

    def _special_id(self, key):
        t = self._specials[key]
        return None if t is None else self._backend.token_to_id(t)

    bos_token = property(lambda self: self._special("bos_token"))
    eos_token = property(lambda self: self._special("eos_token"))
    unk_token = property(lambda self: self._special("unk_token"))
    pad_token = property(lambda self: self._special("pad_token"))
    bos_token_id = property(lambda self: self._special_id("bos_token"))
    eos_token_id = property(lambda self: self._special_id("eos_token"))
    unk_token_id = property(lambda self: self._special_id("unk_token"))
    pad_token_id = property(lambda self: self._special_id("pad_token"))

    @property
    def special_tokens_map(self) -> dict:
        out = {k: v for k, v in self._specials.items() if v is not None}
        if self._extra:
            out["additional_special_tokens"] = list(self._extra)
        return out

    def apply_chat_template(self, conversation, tools=None, documents=None, chat_template=None,
                            add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True,
                            *, return_dict: bool = False, **kw):
        """The chat template applied to one conversation of text messages (a list of
        ``{"role": str, "content": str}``); other inputs and options go to transformers (the
        arguments in transformers' order)."""
        plain = (isinstance(conversation, list) and conversation
                 and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                         and isinstance(m.get("content"), str) for m in conversation))
        if chat_template is not None:
            kw["chat_template"] = chat_template
        if continue_final_message:
            kw["continue_final_message"] = True
        if kw or tools is not None or documents is not None or not plain \
                or not isinstance(self._chat_template, str):
            return self.hf.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=tokenize,
                return_dict=return_dict, tools=tools, documents=documents, **kw)
        if self._template is None:
            self._template = _environment().from_string(self._chat_template)
        messages = [{k: v for k, v in m.items() if v is not None} for m in conversation]
        text = self._template.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt,
                                     **self.special_tokens_map)
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return Encoding(input_ids=ids, attention_mask=[1] * len(ids)) if return_dict else ids


def token_id(t) -> int:
    """A token id from an int-like value (a float such as 1.5 is an error, not truncated)."""
    if isinstance(t, (int, np.integer)) and not isinstance(t, bool):
        return int(t)
    if isinstance(t, (float, np.floating)) and float(t).is_integer():
        return int(t)
    raise TypeError(f"not a token id: {t!r}")


def load_tokenizer(folder) -> Tokenizer | None:
    """A `Tokenizer` over ``folder``'s tokenizer.json, or None where transformers must load it
    (no tokenizer.json, or a configuration `Tokenizer` does not reproduce)."""
    folder = pathlib.Path(folder)
    path = folder / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer as Backend
    try:
        backend = Backend.from_file(str(path))
        config = _read_json(folder / "tokenizer_config.json")
        legacy = _read_json(folder / "special_tokens_map.json")
        template = chat_template_of(folder, config)
    except Exception:  # noqa: BLE001 - unreadable files: transformers says what is wrong
        return None
    # a tokenizer.json saved with truncation or padding switched on (fine-tuning scripts do):
    # transformers encodes without them unless asked, and so do we (prompts would be cut)
    backend.no_truncation()
    backend.no_padding()
    if config.get("split_special_tokens"):  # text such as "<|user|>" stays text
        backend.encode_special_tokens = True
    for k, v in legacy.items():
        config.setdefault(k, v)
    if template is not None and not isinstance(template, str):
        return None  # named templates: transformers chooses
    tok = Tokenizer(folder, backend, config, template)
    # transformers adds BOS / EOS itself for these settings where the post-processor does not
    for key, first in (("add_bos_token", True), ("add_eos_token", False)):
        if key not in config:
            continue
        want = tok._special_id("bos_token" if first else "eos_token")
        if want is None:
            continue
        ids = backend.encode("a", add_special_tokens=True).ids
        plain = backend.encode("a", add_special_tokens=False).ids
        added = (ids[:1] == [want] and len(ids) > len(plain)) if first else \
            (ids[-1:] == [want] and len(ids) > len(plain))
        if bool(config[key]) != added:
            return None
    return tok
