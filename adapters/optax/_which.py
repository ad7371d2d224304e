"""Which leaves of a tree are stacked (``stacked=``), and which layers of them (``freeze=``,
``layer_mask``'s ``layers``, ``lr_scale=``): resolved per flat leaf, checked with the shared
checks of :mod:`stackwise._core.checks` so that a misuse reads as it does in the core."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from stackwise import _kit
from stackwise.quant import Quantized

__all__ = ["Position", "Which", "layer_set", "leaf_depths", "layer_values", "map_rows",
           "pattern", "rows", "selected"]

# What `stacked=` may be: as in `stackwise.fsdp_specs`, plus an int (how many leading layer
# axes: 2 for a stack of stacks) and a pattern's positions (`pattern(n, k)`).
Which = bool | int | Callable[[str], Any] | Any


@dataclasses.dataclass(frozen=True)
class Position:
    """Position ``index`` of a pattern of ``k`` layers, ``n`` layers in all: one layer axis
    whose row r is layer ``index + r * k`` of the model (a pytree leaf, not a node)."""

    index: int
    k: int
    n: int

    def layers(self) -> np.ndarray:
        """The model's layer indices of this position's rows, in order."""
        return np.arange(self.index, self.n, self.k)


def pattern(n: int, k: int) -> tuple[Position, ...]:
    """``stacked=`` for a pattern's params: its k positions, n layers in all.

    ``stackwise.stack([a, b], ..., n=5)`` makes a tuple of k = 2 stacked trees, position p
    holding layers p, p + k, ...; layer indices (``freeze=``, ``lr_scale=``, ``layer_mask``)
    then name the model's layers, as in the loop:

    >>> import jax, jax.numpy as jnp, optax, stackwise, stackwise.optax
    >>> params = ({"w": jnp.ones((3, 2))}, {"v": jnp.ones((2, 4))})   # layers 0, 2, 4 | 1, 3
    >>> tx = stackwise.optax.layerwise(optax.sgd(1.0), stackwise.optax.pattern(5, 2),
    ...                                freeze=[0, 1])
    >>> u, _ = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
    >>> u[0]["w"][:, 0].tolist(), u[1]["v"][:, 0].tolist()
    ([0.0, -1.0, -1.0], [0.0, -1.0])

    In a whole model's tree prefix: ``stacked={"blocks": pattern(n, k), "embed": False}``;
    as a function of the path, position p's leaves get ``pattern(n, k)[p]``.

    Args:
      n: the number of layers of the stack.
      k: the number of positions of the pattern (``len(init)``).

    Returns:
      A tuple of k positions, each a ``stacked=`` value for the leaves of its position.

    Raises:
      TypeError: ``n`` or ``k`` is not an int.
      ValueError: ``k`` is below 1, or ``n`` below ``k``.
    """
    where = "stackwise.optax.pattern"
    k = _kit.integer(k, where, "k", minimum=1)
    n = _kit.integer(n, where, "n", minimum=k)
    return tuple(Position(p, k, n) for p in range(k))


def _depth_of(value: Any, name: str, where: str) -> int:
    """A leaf's number of leading layer axes: a bool (True: one) or an int >= 0, an int as
    :func:`stackwise._core.checks.integer` takes one (NumPy integers too); named by the leaf."""
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    try:
        return _kit.integer(value, where, "stacked", minimum=0)
    except (TypeError, ValueError):
        pass
    raise TypeError(
        f"{where}: `stacked` must give each leaf a bool (True: one layer axis first) or an "
        f"int >= 0 (the number of leading layer axes, 2 for a stack of stacks); leaf {name} "
        f"got {value!r}."
    )


def leaf_depths(stacked: Which, tree: Any, where: str) -> list[int]:
    """The number of leading layer axes of each flat leaf of ``tree``, checked."""
    return _resolve(stacked, tree, where)[0]


def _check_not_quantized(tree: Any, where: str) -> None:
    """A quantized weight is frozen: its integer codes are no optimizer's to move."""
    is_q = lambda v: isinstance(v, Quantized)  # noqa: E731
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_q):
        if is_q(leaf) and jax.tree.leaves(leaf):  # (split's trainable half: an empty shell)
            raise TypeError(
                f"{where}: params leaf {jax.tree_util.keystr(path)} is a quantized weight "
                f"(`stackwise.quant.Quantized`, {leaf.kind}); its integer codes cannot take "
                "an optimizer's updates. Optimize the adapters only: `trainable, frozen = "
                "stackwise.lora.split(params)`, then `tx.init(trainable)`."
            )


def _resolve(stacked: Which, tree: Any, where: str) -> tuple[list[int], list[Position | None]]:
    _kit.stacked_only(where, params=tree)
    _check_not_quantized(tree, where)
    pairs = jax.tree_util.tree_leaves_with_path(tree)
    names = [jax.tree_util.keystr(p) or "<root>" for p, _ in pairs]
    if isinstance(stacked, bool | int | np.bool_ | np.integer | Position):
        values = [stacked] * len(names)
    elif callable(stacked):
        values = [stacked(jax.tree_util.keystr(p)) for p, _ in pairs]
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
        values = jax.tree.leaves(flags)
    positions = [v if isinstance(v, Position) else None for v in values]
    depths = [1 if p else _depth_of(v, n, where) for v, p, n in zip(values, positions, names)]
    for (_, leaf), name, d, p in zip(pairs, names, depths, positions):
        shape = _kit.leaf_shape(leaf, where, name)  # arrays, abstract leaves, numbers
        if len(shape) < d:
            raise ValueError(
                f"{where}: leaf {name} has shape {shape}, but `stacked` says it "
                f"has {d} leading layer axes. Mark only the stacked leaves (e.g. "
                "`stacked=lambda path: 'blocks' in path`), or give the right depth."
            )
        if p is not None and shape[0] != len(p.layers()):
            raise ValueError(
                f"{where}: leaf {name} has {shape[0]} layers (shape {shape}), but `stacked` "
                f"says it is position {p.index} of a pattern of k={p.k}, n={p.n} layers, "
                f"which holds {len(p.layers())} (layers {p.index}, {p.index + p.k}, ...). "
                "Give `stackwise.optax.pattern(n, k)` the stack's own n and k, position p "
                "to position p's params."
            )
    return depths, positions


def layer_values(values: Any, leaf: Any, depth: int, position: Position | None, name: str,
                 where: str, arg: str):
    """``values`` (one per layer of the model) shaped to broadcast against ``leaf``'s layer
    axes: its rows' values (a pattern position's every k-th)."""
    layer_shape = tuple(leaf.shape[:depth])
    n = math.prod(layer_shape) if position is None else position.n
    if values.shape != (n,):
        held = (f"has {n} layers (layer axes {layer_shape})" if position is None else
                f"is position {position.index} of a pattern of {n} layers")
        raise ValueError(
            f"{where}: `{arg}` gives {values.shape[0]} values, one per layer, but leaf {name} "
            f"{held}. Give one value per layer of the stack; for a pattern, mark its "
            "positions with `stacked=stackwise.optax.pattern(n, k)`."
        )
    if position is not None:
        values = values[position.layers()]
    return jnp.asarray(values).reshape(layer_shape + (1,) * (len(leaf.shape) - depth))


def layer_set(layers: Any, where: str, arg: str) -> tuple[int, ...]:
    """Layer indices (one, or a collection), each an int as :func:`stackwise._core.checks.integer`
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
    return tuple(_kit.integer(i, where, f"{arg}[{k}]") for k, i in enumerate(out))


def rows(tree: Any, stacked: Which, where: str, fn) -> list:
    """Per flat leaf: ``fn(name, leaf, depth, position)`` for a stacked leaf, None for the
    others."""
    depths, positions = _resolve(stacked, tree, where)
    pairs = jax.tree_util.tree_leaves_with_path(tree)
    return [fn(jax.tree_util.keystr(p) or "<root>", a, d, q) if d else None
            for (p, a), d, q in zip(pairs, depths, positions)]


def map_rows(fn, rows: list, *trees) -> Any:
    """``fn(row, *leaves)`` on the stacked leaves of ``trees``; the first tree's leaf elsewhere."""
    flat = [jax.tree.leaves(t) for t in trees]
    out = [a[0] if r is None else fn(r, *a) for r, a in zip(rows, zip(*flat))]
    return jax.tree.unflatten(jax.tree.structure(trees[0]), out)


def selected(layers: tuple[int, ...], where: str, arg: str):
    """``fn(name, leaf, depth, position)`` for :func:`rows`: True on ``layers`` of the leaf,
    each checked by :func:`stackwise._core.checks.layer_number` against the leaf's own number of
    layers (a pattern's: the model's n)."""

    def mask(name, leaf, depth, position):
        n = math.prod(leaf.shape[:depth]) if position is None else position.n
        try:
            chosen = [_kit.layer_number(i, n, where, arg) for i in layers]
        except IndexError as error:
            held = (f"has {n} layers" if position is None
                    else f"is in a pattern of {n} layers")
            raise IndexError(
                f"{error} `{arg}` names it, but leaf {name} {held}; name only layers "
                "every stacked leaf has (or mark the others `stacked=False`)."
            ) from None
        return layer_values(np.isin(np.arange(n), chosen), leaf, depth, position, name, where,
                            arg)

    return mask
