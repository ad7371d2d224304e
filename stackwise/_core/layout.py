"""Layout tools for stacked params: unstack, stack back, slice, shard."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from stackwise._core import checks, convert, trees
from stackwise._core.served import stacked_only

__all__ = ["slice_layers", "stack_layers", "unstack_layers"]


_UNSTACK = "stackwise.unstack_layers"
_STACK = "stackwise.stack_layers"


def unstack_layers(stacked: Any, *, pattern: int | None = None) -> list[Any]:
    """Splits stacked params into a list of per-layer trees (layer i = ``[i]``), exactly.

    >>> import jax.numpy as jnp, stackwise
    >>> layers = stackwise.unstack_layers({"w": jnp.arange(6.0).reshape(3, 2)})
    >>> [l["w"].tolist() for l in layers]
    [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]

    With a pattern of k layers (``stackwise.stack([init_a, init_b], ...)``),
    the params are a tuple of k stacked trees, tree p holding layers p, p+k,
    ...; the list is in layer order again:

    >>> a, b = {"w": jnp.array([0.0, 2.0, 4.0])}, {"v": jnp.array([1, 3])}
    >>> [sorted(l) for l in stackwise.unstack_layers((a, b), pattern=2)]
    [['w'], ['v'], ['w'], ['v'], ['w']]

    Args:
      stacked: a tree whose every leaf has the layer axis first; with
        ``pattern=k``, a tuple of k such trees.
      pattern: None, or the pattern's length k.

    Returns:
      The n per-layer trees; every leaf keeps its dtype.

    Raises:
      ValueError: leaves without a common leading axis (listed), or pattern
        positions whose depths no n gives.
      TypeError: ``pattern`` not a positive int, or not k trees with it.
    """
    return unstack(stacked, pattern, _UNSTACK)


def unstack(stacked: Any, pattern: Any, who: str) -> list[Any]:
    """:func:`unstack_layers` as ``who`` (its messages name ``who``)."""
    stacked_only(who, stacked=stacked)
    k = convert.check_pattern(pattern, who)
    fix = "Stacked params come from `Stacked.init` or `stackwise.stack_layers`."
    if k is None:
        return convert.unstack_exact(stacked, convert.depth_of(stacked, who, "tree", fix))
    stacked = _positions(stacked, k, who)
    positions = [
        convert.unstack_exact(
            tree,
            convert.depth_of(tree, who, f"tree of pattern position {p}", fix),
        )
        for p, tree in enumerate(stacked)
    ]
    n = convert.pattern_depth([len(layers) for layers in positions], who)
    return [positions[i % k][i // k] for i in range(n)]


def stack_layers(layers: Sequence[Any], *, pattern: int | None = None) -> Any:
    """Stacks a list of per-layer trees along a new axis 0: the inverse of :func:`unstack_layers`.

    Bitwise: every leaf keeps its dtype. Layers whose leaves differ in
    structure, shape or dtype are refused, naming the leaf and the layers,
    never promoted (bfloat16 and float32 stay apart).

    >>> import jax.numpy as jnp, stackwise
    >>> stackwise.stack_layers([{"w": jnp.zeros(2)}, {"w": jnp.ones(2)}])["w"].shape
    (2, 2)

    With ``pattern=k``, layer i goes to position ``i % k``: the result is a
    tuple of k stacked trees, the params of ``stackwise.stack`` with k layers
    in the pattern:

    >>> layers = [{"w": jnp.zeros(2)}, {"v": jnp.ones(3)}, {"w": jnp.ones(2)}]
    >>> dense, other = stackwise.stack_layers(layers, pattern=2)
    >>> dense["w"].shape, other["v"].shape
    ((2, 2), (1, 3))

    Args:
      layers: the per-layer trees, in layer order (with a pattern, the layers
        of one position must share a structure).
      pattern: None, or the pattern's length k.

    Returns:
      The stacked tree; with ``pattern=k`` a tuple of k.

    Raises:
      ValueError: no layers, fewer than k, or layers of different structure
        or leaf shapes.
      TypeError: a leaf whose dtype differs between layers, a bad ``pattern``,
        or ``layers`` that is not a list (a dict's keys would be taken as layers).
    """
    return restack(layers, pattern, _STACK)


def restack(layers: Sequence[Any], pattern: Any, who: str) -> Any:
    """:func:`stack_layers` as ``who`` (its messages name ``who``)."""
    k = convert.check_pattern(pattern, who)
    layers = _layer_list(layers, who)
    stacked_only(who, layers=layers)
    if k is None:
        return convert.stack_exact(layers, who)
    if len(layers) < k:
        raise ValueError(
            f"{who}: a pattern of {k} layers needs at least {k} layers, got {len(layers)}."
        )
    return tuple(
        convert.stack_exact(layers[p::k], who, label=lambda j, p=p: f"layer {p + j * k}")
        for p in range(k)
    )


def _layer_list(layers: Any, who: str) -> list[Any]:
    """``layers`` as a list; a mapping (whose keys would be iterated) or a non-sequence is
    refused."""
    if isinstance(layers, Mapping):
        raise TypeError(
            f"{who}: `layers` must be a list of per-layer trees in layer order, got a "
            f"{type(layers).__name__} with keys {list(layers)[:4]!r}; its keys would be "
            "taken as layers. Pass `list(layers.values())` (in layer order), or "
            "`[layers[name] for name in names]`."
        )
    if not isinstance(layers, Iterable) or isinstance(layers, (str, bytes)):
        raise TypeError(
            f"{who}: `layers` must be a list of per-layer trees, got "
            f"{type(layers).__name__} {layers!r}."
        )
    if isinstance(layers, (jax.Array, np.ndarray)):
        raise TypeError(
            f"{who}: `layers` must be a list of per-layer trees, got an array of shape "
            f"{layers.shape}; it is already stacked (wrap it in a tree, e.g. `{{'w': a}}`, "
            "to use it as stacked params)."
        )
    return list(layers)


def slice_layers(
    stacked: Any, start: int, stop: int | None = None, *, pattern: int | None = None
) -> Any:
    """Layers ``start:stop`` of stacked params, e.g. the first k as a shallower model.

    >>> import jax.numpy as jnp, stackwise
    >>> stackwise.slice_layers({"w": jnp.zeros((6, 3))}, 0, 2)["w"].shape
    (2, 3)

    Negative ``start`` / ``stop`` count from the end, as in Python (``-2``: the last two
    layers). With a pattern of k layers (``stackwise.stack([init_a, init_b], ...)``:
    a tuple of k stacked trees, position p holding layers p, p+k, ...), pass
    ``pattern=k``: the result holds layers ``start:stop`` of the model, position p of it
    holding layers ``start + p``, ``start + p + k``, ... (the params of the stack whose
    pattern starts with the kind of layer ``start``):

    >>> a, b = {"w": jnp.zeros((3, 2))}, {"v": jnp.zeros((3, 5))}  # 6 layers, a b a b a b
    >>> first4 = stackwise.slice_layers((a, b), 0, 4, pattern=2)
    >>> first4[0]["w"].shape, first4[1]["v"].shape
    ((2, 2), (2, 5))

    Args:
      stacked: a tree whose every leaf has the layer axis first (arrays, or
        ``jax.ShapeDtypeStruct`` s from ``jax.eval_shape``); with ``pattern=k``, a
        tuple of k such trees.
      start: the first layer, an int.
      stop: one past the last layer (None: to the end).
      pattern: None, or the pattern's length k.

    Returns:
      The layers' params, every leaf keeping its dtype.

    Raises:
      TypeError: ``start``/``stop`` not ints, a bad ``pattern``, or a tuple of trees
        (a pattern's params) without ``pattern=``.
      ValueError: an empty or out-of-range slice, or leaves of different depths.
    """
    who = "stackwise.slice_layers"
    stacked_only(who, stacked=stacked)
    k = convert.check_pattern(pattern, who)
    start = checks.integer(start, who, "start")
    stop = None if stop is None else checks.integer(stop, who, "stop")
    if k is None:
        _refuse_a_pattern(stacked, who)
        n = convert.depth_of(stacked, who, "tree")
    else:
        positions = _positions(stacked, k, who)
        depths = [
            convert.depth_of(t, who, f"tree of pattern position {p}")
            for p, t in enumerate(positions)
        ]
        n = convert.pattern_depth(depths, who)
    lo = start + n if start < 0 else start
    hi = n if stop is None else stop + n if stop < 0 else stop
    if not 0 <= lo < hi <= n:
        raise ValueError(
            f"{who}: need -n <= start < stop <= n={n} (negative values count from the end), "
            f"got start={start}, stop={stop}: an empty or out-of-range slice."
        )
    if k is None:
        return jax.tree.map(lambda a: trees.take_range(a, lo, hi), stacked)
    out = []
    for q in range(min(k, hi - lo)):  # the result's position q: layers lo+q, lo+q+k, ...
        first = lo + q
        p, j = first % k, first // k
        stop_j = len(range(p, hi, k))
        out.append(jax.tree.map(lambda a, j=j, s=stop_j: trees.take_range(a, j, s), positions[p]))
    return tuple(out)


def _positions(stacked: Any, k: int, who: str) -> Any:
    if not isinstance(stacked, (tuple, list)) or len(stacked) != k:
        got = (
            f"{len(stacked)} trees"
            if isinstance(stacked, (tuple, list))
            else type(stacked).__name__
        )
        raise TypeError(
            f"{who}: with pattern={k}, pass a tuple of {k} stacked trees (position p "
            f"holding layers p, p+{k}, ...), as `Stacked.init` returns them; got {got}."
        )
    return stacked


def _refuse_a_pattern(stacked: Any, who: str) -> None:
    """A tuple of several trees at the root is a pattern's params: slicing each position
    alike would take k times the layers asked for."""
    if not isinstance(stacked, (tuple, list)) or len(stacked) < 2:
        return
    if all(jax.tree_util.treedef_is_leaf(jax.tree.structure(t)) for t in stacked):
        return  # a tuple of arrays: one stack's params
    k = len(stacked)
    raise TypeError(
        f"{who}: `stacked` is a {type(stacked).__name__} of {k} trees, as the params of a "
        f"pattern of {k} layers are (position p holding layers p, p+{k}, ...): pass "
        f"`pattern={k}` to take layers of the model. (For one stack whose params are a "
        f"{type(stacked).__name__} of trees, slice every leaf: "
        "`jax.tree.map(lambda a: a[start:stop], params)`.)"
    )


