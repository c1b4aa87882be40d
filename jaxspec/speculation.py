"""How to speculate: the `Speculation` settings a user passes, checked against the target model.

A speculation is a drafter (the target's own weights over a sparse StreamingLLM view of its cache,
or a separate draft model with a full or ring-buffer cache), a token tree (a chain of ``gamma``
drafts is the linear tree), and whether each part of a generation chooses between speculating and
plain decoding from the cost model (`jaxspec.costs`). `jaxspec.decoding` runs it; this module
only describes and validates.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import numpy as np

from jaxspec.config import sliding_window_of
from jaxspec.model import Model
from jaxspec.retrieval import RETRIEVE_BLOCK
from jaxspec.tree import TokenTree

GAMMA_CANDIDATES = (1, 2, 3, 4, 5, 6)  # what gamma="auto" chooses from (0: plain decoding)


@dataclasses.dataclass(frozen=True, eq=False)
class Speculation:
    """How to speculate.

    draft: ``"self"`` (the target's weights over a sparse sink + window view of its own cache) or a
        `jaxspec.Model` sharing the target's vocabulary.
    gamma: drafts per round (>= 1), or ``"auto"``: chosen per call from the cost model (measured
        step times and the running acceptance), 0 (plain decoding) where no gamma pays.
    sink, window: StreamingLLM sparse KV of the draft. ``window=None`` means a full cache: for a
        separate draft its own full cache; for ``draft="self"`` the whole target cache (the draft is
        then the target itself and ``sink`` is unused: every draft is accepted, for testing).
    tree: token-tree speculation instead of a chain: SpecInfer's expansion config ``(k1, .., km)``
        (the node at depth i gets k_{i+1} children), a parents list (starting with -1), a
        `jaxspec.tree.TokenTree`, or the path of a JSON file written by ``jaxspec tree-search``.
        ``gamma`` is then unused.
    tree_sampling: how children are drawn at temperature > 0: ``"without_replacement"``
        (Gumbel-top-k, higher acceptance) or ``"iid"`` (SpecInfer's independent draws). At
        temperature 0 children are the draft's top-k.
    adaptive: between stretches of rounds, choose between speculating and plain decode steps from
        the cost model of the rows still running and each row's own acceptance: rows whose drafts
        are rarely accepted, or a batch whose other rows have finished, are decoded plainly
        instead of paying ``gamma`` draft steps per token. Default on. Either kind of round is
        lossless, so the output does not depend on the choice.
    retrieve: self-speculation only: besides the sink and the window, each draft step also reads
        this many context slots per row, layer and KV head, in whole blocks of
        `jaxspec.retrieval.RETRIEVE_BLOCK` (64) slots: the blocks on which the latest
        verification's queries put the largest logits, refreshed every round
        (`jaxspec.retrieval`). A multiple of 64, 0 (the sink and window alone), or ``"auto"``
        (the default): about half of ``window``'s keys go to retrieved blocks instead (window
        1008 -> the last 496 positions + 512 retrieved slots: the same keys per draft step), in
        ``generate`` and the serving engine alike (dense slots or a block pool); models with a
        sliding attention window keep the window alone. Verification keeps the output lossless
        whatever the draft reads.
    """

    draft: Any = "self"
    gamma: int | str = 4
    sink: int = 16
    window: int | None = 1008
    tree: Any = None
    tree_sampling: str = "without_replacement"
    adaptive: bool = True
    retrieve: int | str = "auto"

    def resolved(self, *, sliding: bool = False) -> tuple[int | None, int]:
        """``(window, retrieve)`` the self-draft reads with (`retrieve` above): "auto" splits
        the window where it applies (a self-draft with a window, a model without a sliding
        window: ``sliding``), an int is taken as given."""
        r = self.retrieve
        if r != "auto":
            return self.window, int(r)
        w = self.window
        if not self.is_self or w is None or sliding:
            return w, 0
        r = int(round(w / 2 / RETRIEVE_BLOCK)) * RETRIEVE_BLOCK
        return (w - r, r) if r and w - r > 0 else (w, 0)

    @property
    def is_self(self) -> bool:
        return isinstance(self.draft, str) and self.draft == "self"


def resolve_tree(tree) -> TokenTree | None:
    """A TokenTree from any accepted ``Speculation.tree`` form (see `Speculation`)."""
    if tree is None or isinstance(tree, TokenTree):
        return tree
    if isinstance(tree, (str, pathlib.Path)):
        path = pathlib.Path(tree)
        if not path.exists():
            raise ValueError(f"tree {str(tree)!r} is neither an expansion config nor a tree file")
        try:
            data = json.loads(path.read_text())
            parents = data["parents"] if isinstance(data, dict) else data
            if not isinstance(parents, list) or not all(_is_int(p) for p in parents):
                raise TypeError(f"its parents must be a list of ints, got {parents!r}")
            return TokenTree.from_parents(parents)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"tree file {str(tree)!r} is not a tree (a JSON list of parents or "
                             f"{{'parents': [...]}}): {e}") from None
    try:
        seq = list(tree)
    except TypeError:
        seq = None
    if seq is None or not all(_is_int(x) for x in seq):
        raise ValueError(f"tree must be an expansion config or a parents list of ints, a "
                         f"TokenTree or a file, got {tree!r}")
    seq = [int(x) for x in seq]
    if not seq:
        raise ValueError("tree is empty")
    if seq[0] == -1:
        return TokenTree.from_parents(seq)
    if any(k < 1 for k in seq):
        raise ValueError(f"tree expansion counts must be >= 1, got {seq}")
    return TokenTree.from_expansion(seq)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def validate(spec: Speculation, model: Model) -> TokenTree | None:
    """Checks a Speculation against a target model before anything compiles; returns its tree
    (None for a chain). Raises ValueError / TypeError naming the setting."""
    if not isinstance(spec, Speculation):
        raise TypeError(f"speculation must be a jaxspec.Speculation, got {type(spec).__name__}")
    g = spec.gamma
    if g != "auto" and (not _is_int(g) or g < 1):
        raise ValueError(f"gamma must be an int >= 1 or 'auto', got {g!r}")
    if not _is_int(spec.sink) or spec.sink < 0:
        raise ValueError(f"sink must be an int >= 0, got {spec.sink!r}")
    if spec.window is not None and (not _is_int(spec.window) or spec.window < 0):
        raise ValueError(f"window must be an int >= 0 or None, got {spec.window!r}")
    if spec.adaptive not in (True, False):
        raise ValueError(f"adaptive must be True or False, got {spec.adaptive!r}")
    if spec.tree_sampling not in ("without_replacement", "iid"):
        raise ValueError(f"tree_sampling must be 'without_replacement' or 'iid', "
                         f"got {spec.tree_sampling!r}")
    tree = resolve_tree(spec.tree)
    if tree is not None and g == "auto":
        raise ValueError("gamma='auto' picks a chain length; it cannot be combined with a tree")
    if tree is not None:
        wide = max(len(c) for c in tree.children)
        if wide > model.config.vocab_size:
            raise ValueError(f"the tree gives a node {wide} children, more than the "
                             f"{model.config.vocab_size} tokens of the vocabulary")
    r = spec.retrieve
    if r != "auto" and (not _is_int(r) or r < 0 or r % RETRIEVE_BLOCK):
        raise ValueError(f"retrieve must be 'auto' or an int >= 0 and a multiple of "
                         f"{RETRIEVE_BLOCK} (slots in whole blocks), got {r!r}")
    if r != "auto" and r and not (spec.is_self and spec.window is not None):
        raise ValueError("retrieve applies to self-speculation over a sparse view "
                         "(draft='self' with a window)")
    if r != "auto" and r and sliding_window_of(model.config) is not None:
        raise ValueError("retrieve needs a model without sliding-window attention (a draft of "
                         "such a model already reads at most the model's window)")
    if spec.is_self:
        if spec.window is not None and spec.window + spec.sink == 0:
            raise ValueError("self-speculation needs sink + window > 0 context slots")
    elif isinstance(spec.draft, Model):
        d = spec.draft
        if d.config.vocab_size != model.config.vocab_size:
            raise ValueError(f"draft vocabulary ({d.config.vocab_size}) differs from the target's "
                             f"({model.config.vocab_size}): they must share a tokenizer")
        if d.tokenizer is not None and model.tokenizer is not None:
            if d.tokenizer.get_vocab() != model.tokenizer.get_vocab():
                raise ValueError("draft and target tokenizers differ")
        if d.dtype != model.dtype:
            raise ValueError(f"draft dtype {d.dtype} differs from the target's {model.dtype}; "
                             f"load both with the same dtype (jaxspec.load(path, dtype=...))")
        if spec.window is not None:
            depth = tree.max_depth if tree is not None else (
                max(GAMMA_CANDIDATES) if g == "auto" else int(g))
            if spec.window < depth + 2:
                what = "tree depth" if tree is not None else "gamma"
                raise ValueError(f"a ring-buffer draft needs window >= {what} + 2 = {depth + 2}, "
                                 f"got {spec.window}")
    else:
        raise TypeError(f"draft must be 'self' or a jaxspec.Model, got {type(spec.draft).__name__}")
    return tree
