"""Which leaves of a tree are stacked (``stacked=``), and which layers of them (``freeze=``,
``layer_mask``'s ``layers``, ``lr_scale=``): resolved per flat leaf, checked with the shared
checks of :mod:`stackwise._check` so that a misuse reads as it does in the core."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from stackwise import _check

__all__ = ["Which", "layer_set", "leaf_depths", "layer_values", "map_rows", "rows", "selected"]

# What `stacked=` may be: as in `stackwise.fsdp_specs`, plus an int (how many leading layer
# axes: 2 for a stack of stacks).
Which = bool | int | Callable[[str], Any] | Any


def _depth_of(value: Any, name: str, where: str) -> int:
    """A leaf's number of leading layer axes: a bool (True: one) or an int >= 0, an int as
    :func:`stackwise._check.integer` takes one (NumPy integers too); named by the leaf."""
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    try:
        return _check.integer(value, where, "stacked", minimum=0)
    except (TypeError, ValueError):
        pass
    raise TypeError(
        f"{where}: `stacked` must give each leaf a bool (True: one layer axis first) or an "
        f"int >= 0 (the number of leading layer axes, 2 for a stack of stacks); leaf {name} "
        f"got {value!r}."
    )


def leaf_depths(stacked: Which, tree: Any, where: str) -> list[int]:
    """The number of leading layer axes of each flat leaf of ``tree``, checked."""
    pairs = jax.tree_util.tree_leaves_with_path(tree)
    names = [jax.tree_util.keystr(p) or "<root>" for p, _ in pairs]
    if isinstance(stacked, bool | int | np.bool_ | np.integer):
        depths = [_depth_of(stacked, n, where) for n in names]
    elif callable(stacked):
        depths = [_depth_of(stacked(jax.tree_util.keystr(p)), n, where)
                  for (p, _), n in zip(pairs, names)]
    else:
        try:
            flags = jax.tree.map(lambda flag, sub: jax.tree.map(lambda _: flag, sub),
                                 stacked, tree)
        except (ValueError, TypeError):
            raise ValueError(
                f"{where}: `stacked` must be True, False, an int, a tree prefix of the params "
                "with a bool or int per subtree (e.g. `{'embed': False, 'blocks': True}`) or a "
                "function of a leaf's path (`jax.tree_util.keystr`); its structure does not "
                "match the params':\n"
                f"  stacked: {jax.tree_util.tree_structure(stacked)}\n"
                f"  params:  {jax.tree_util.tree_structure(tree)}"
            ) from None
        depths = [_depth_of(f, n, where) for f, n in zip(jax.tree.leaves(flags), names)]
    for (_, leaf), name, d in zip(pairs, names, depths):
        shape = _check.leaf_shape(leaf, where, name)  # arrays, abstract leaves, numbers
        if len(shape) < d:
            raise ValueError(
                f"{where}: leaf {name} has shape {shape}, but `stacked` says it "
                f"has {d} leading layer axes. Mark only the stacked leaves (e.g. "
                "`stacked=lambda path: 'blocks' in path`), or give the right depth."
            )
    return depths


def layer_values(values: Any, leaf: Any, depth: int, name: str, where: str, arg: str):
    """``values`` (one per layer) shaped to broadcast against ``leaf``'s layer axes."""
    layer_shape = tuple(leaf.shape[:depth])
    n = math.prod(layer_shape)
    if values.shape != (n,):
        raise ValueError(
            f"{where}: `{arg}` gives {values.shape[0]} values, one per layer, but leaf {name} "
            f"has {n} layers (layer axes {layer_shape}). Give one value per layer of the "
            "stack; for a pattern (positions with different numbers of layers), wrap each "
            "position's params separately."
        )
    return jnp.asarray(values).reshape(layer_shape + (1,) * (len(leaf.shape) - depth))


def layer_set(layers: Any, where: str, arg: str) -> tuple[int, ...]:
    """Layer indices (one, or a collection), each an int as :func:`stackwise._check.integer`
    takes one; negative ones count from the end, per leaf (:func:`selected`)."""
    if isinstance(layers, int | np.integer) and not isinstance(layers, bool):
        layers = (layers,)
    try:
        out = tuple(layers)
    except TypeError:
        raise TypeError(
            f"{where}: `{arg}` must be a collection of layer indices, e.g. `{arg}=range(2)`, "
            f"got {layers!r}."
        ) from None
    return tuple(_check.integer(i, where, f"{arg}[{k}]") for k, i in enumerate(out))


def rows(tree: Any, depths: list[int], fn) -> list:
    """Per flat leaf: ``fn(name, leaf, depth)`` for a stacked leaf, None for the others."""
    pairs = jax.tree_util.tree_leaves_with_path(tree)
    return [fn(jax.tree_util.keystr(p) or "<root>", a, d) if d else None
            for (p, a), d in zip(pairs, depths)]


def map_rows(fn, rows: list, *trees) -> Any:
    """``fn(row, *leaves)`` on the stacked leaves of ``trees``; the first tree's leaf elsewhere."""
    flat = [jax.tree.leaves(t) for t in trees]
    out = [a[0] if r is None else fn(r, *a) for r, a in zip(rows, zip(*flat))]
    return jax.tree.unflatten(jax.tree.structure(trees[0]), out)


def selected(layers: tuple[int, ...], where: str, arg: str):
    """``fn(name, leaf, depth)`` for :func:`rows`: True on ``layers`` of the leaf, each
    checked against the leaf's own number of layers by :func:`stackwise._check.layer_index`."""

    def mask(name, leaf, depth):
        n = math.prod(leaf.shape[:depth])
        try:
            chosen = [_check.layer_index(i, n, where, arg) for i in layers]
        except IndexError as error:
            raise IndexError(
                f"{error} `{arg}` names it, but leaf {name} has {n} layers; name only layers "
                "every stacked leaf has (or mark the others `stacked=False`)."
            ) from None
        return layer_values(np.isin(np.arange(n), chosen), leaf, depth, name, where, arg)

    return mask
