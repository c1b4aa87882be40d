"""Command-line argument types and groups shared by ``jaxspec generate`` and ``jaxspec serve``.

Every parser here turns a bad value into an error that names its option, and none of them loads
a model: the commands check all their arguments before the (slow) model load.
"""

from __future__ import annotations

import argparse


def parse_tree(s: str | None):
    """``--tree``: an expansion config (``2,2,1``), a parents list or the path of a tree file."""
    if not s:
        return None
    try:
        return tuple(int(x) for x in s.split(","))
    except ValueError:
        return s  # a tree file from `jaxspec tree-search`


def parse_gamma(s: str):
    """``--gamma``: an int >= 1 or 'auto'."""
    if s == "auto":
        return s
    try:
        g = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1 or 'auto', got {s!r}") from None
    if g < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1 or 'auto', got {s!r}")
    return g


def window_arg(s: str):
    """``--window``: an int >= 0, or 'none' (a draft model with a full cache instead of a ring)."""
    if s.lower() == "none":
        return None
    try:
        w = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int or 'none', got {s!r}") from None
    if w < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 or 'none', got {s!r}")
    return w


def mesh_from_args(a):
    """``--tp N --dp M``: a data x model mesh (None when both are 1 or absent)."""
    tp, dp = a.tp, a.dp
    if tp is None and dp is None:
        return None
    if (tp is not None and tp < 1) or (dp is not None and dp < 1):
        raise ValueError(f"--tp and --dp must be >= 1, got --tp {tp} --dp {dp}")
    if (tp or 1) * (dp or 1) == 1:
        return None
    from jaxspec.sharding import make_mesh
    return make_mesh(data=dp or 1, model=tp)
