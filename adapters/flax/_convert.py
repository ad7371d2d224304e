"""Exact conversions between a Stack's variables and other layouts.

- a Python loop of blocks (``layers_0``, ``layers_1``, ... or any naming):
  :func:`unstack_variables` / :func:`stack_variables`;
- ``nn.scan`` (any ``variable_axes``, any ``metadata_params`` partition name):
  :func:`to_scan` / :func:`from_scan`.

Every collection is converted; partitioning boxes (``nn.Partitioned``,
``nn.LogicallyPartitioned``) keep their metadata with the layer axis added or
removed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import meta
from flax.core.scope import in_filter

import stackwise
from stackwise.flax._stack import _unbox, _value

__all__ = ["from_scan", "stack_variables", "to_scan", "unstack_variables"]

Names = str | Callable[[int], str]


def _split(path: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if path is None or path == "":
        return ()
    if isinstance(path, str):
        return tuple(p for p in path.split("/") if p)
    return tuple(path)


def _layer_path(names: Names, i: int) -> tuple[str, ...]:
    name = names(i) if callable(names) else names.format(i)
    if not isinstance(name, str) or not name:
        raise TypeError(
            f"stackwise.flax: `names` must give a non-empty str for each layer index "
            f"(a format string like 'layers_{{}}' or a function), got {name!r} for layer {i}."
        )
    return _split(name)


def _get(tree: Mapping, path: tuple[str, ...]) -> Any:
    for p in path:
        if not isinstance(tree, Mapping) or p not in tree:
            return None
        tree = tree[p]
    return tree


def _copy_to(tree: dict, path: tuple[str, ...]) -> dict:
    """Copies the dicts along ``path`` so that it can be edited; returns the last one."""
    for p in path:
        tree[p] = dict(tree.get(p, {}))
        tree = tree[p]
    return tree


def _pop(tree: dict, path: tuple[str, ...]) -> Any:
    parent = _copy_to(tree, path[:-1])
    value = parent.pop(path[-1])
    # Drop dicts left empty by the pop, as Flax never stores them.
    for k in range(len(path) - 1, 0, -1):
        if _get(tree, path[:k]) == {}:
            _copy_to(tree, path[: k - 1]).pop(path[k - 1])
    return value


def _put(tree: dict, path: tuple[str, ...], value: Any) -> None:
    _copy_to(tree, path[:-1])[path[-1]] = value


def _params(axis_name: Any) -> dict:
    return {nn.PARTITION_NAME: axis_name}


def _rebox(boxed: Any, values: Any, update: Callable[[Any], Any]) -> Any:
    """``values`` (unboxed) put back in the boxes of ``boxed``, each box ``update``d."""
    return jax.tree.map(
        lambda b, v: update(b.replace_boxed(v)) if _box(b) else v, boxed, values, is_leaf=_box
    )


def unstack_variables(
    variables: Mapping[str, Any],
    path: str | tuple[str, ...],
    *,
    names: Names = "layers_{}",
    layer_axis_name: str | None = None,
) -> dict[str, Any]:
    """A Stack's variables in the layout of a Python loop of blocks, in every collection.

    The stacked subtree at ``path`` (e.g. ``"layers"`` or ``"encoder/layers"``)
    is replaced, in each collection, by ``n`` per-layer subtrees named
    ``names.format(i)`` (or ``names(i)``; a name with ``/`` nests) next to it.

    >>> import jax.numpy as jnp, stackwise.flax
    >>> stacked = {"params": {"layers": {"w": jnp.zeros((3, 2))}, "head": {"b": jnp.ones(2)}}}
    >>> loop = stackwise.flax.unstack_variables(stacked, "layers")
    >>> sorted(loop["params"]), loop["params"]["layers_2"]["w"].shape
    (['head', 'layers_0', 'layers_1', 'layers_2'], (2,))

    Args:
      variables: all variables of a model, ``{collection: tree}``.
      path: where the Stack's variables are in each collection.
      names: the per-layer names: a format string or a function of the index.
      layer_axis_name: the Stack's ``layer_axis_name`` (removed from every
        partitioning spec).

    Returns:
      New variables (the input is not modified); arrays are sliced exactly.
    """
    where = _split(path)
    if not where:
        raise ValueError("stackwise.flax.unstack_variables: `path` must name the Stack.")
    p_layer = _params(layer_axis_name)
    out = {}
    for col, tree in variables.items():
        tree = dict(tree)
        if _get(tree, where) is not None:
            stacked = _pop(tree, where)
            values = stackwise.unstack_layers(_unbox(stacked))
            for i, layer in enumerate(values):
                layer = _rebox(stacked, layer, lambda b: b.remove_axis(0, p_layer))
                _put(tree, where[:-1] + _layer_path(names, i), layer)
        out[col] = tree
    return out


def stack_variables(
    variables: Mapping[str, Any],
    path: str | tuple[str, ...],
    *,
    names: Names = "layers_{}",
    n: int | None = None,
    layer_axis_name: str | None = None,
) -> dict[str, Any]:
    """The inverse of :func:`unstack_variables`: a loop's variables in a Stack's layout.

    >>> import jax, jax.numpy as jnp, stackwise.flax
    >>> loop = {"params": {f"block{i}": {"w": jnp.full(2, i)} for i in range(3)}}
    >>> stacked = stackwise.flax.stack_variables(loop, "stack", names="block{}")
    >>> stacked["params"]["stack"]["w"].tolist()
    [[0, 0], [1, 1], [2, 2]]
    >>> back = stackwise.flax.unstack_variables(stacked, "stack", names="block{}")
    >>> jax.tree.all(jax.tree.map(jnp.array_equal, back, loop))
    True

    Args:
      variables: all variables of a model, ``{collection: tree}``.
      path: where the Stack's variables go in each collection.
      names: the per-layer names: a format string or a function of the index.
      n: the number of layers; by default, layers ``0, 1, ...`` are taken for
        as long as ``names(i)`` exists in the first collection.
      layer_axis_name: the Stack's ``layer_axis_name`` (added to every
        partitioning spec).

    Returns:
      New variables (the input is not modified).

    Raises:
      ValueError: no layer found, or layers whose variables differ in structure.
    """
    where = _split(path)
    if not where:
        raise ValueError("stackwise.flax.stack_variables: `path` must name the Stack.")
    parent = where[:-1]
    p_layer = _params(layer_axis_name)
    if n is None:
        n = 0
        while any(_get(t, parent + _layer_path(names, n)) is not None for t in variables.values()):
            n += 1
    if n < 1:
        raise ValueError(
            f"stackwise.flax.stack_variables: found no layer named "
            f"{'/'.join(parent + _layer_path(names, 0))!r} in any collection "
            f"({sorted(variables)}); pass the per-layer naming as `names=`."
        )
    out = {}
    for col, tree in variables.items():
        tree = dict(tree)
        paths = [parent + _layer_path(names, i) for i in range(n)]
        present = [_get(tree, p) is not None for p in paths]
        if any(present):
            if not all(present):
                missing = [i for i, ok in enumerate(present) if not ok]
                raise ValueError(
                    f"stackwise.flax.stack_variables: collection {col!r} has some of the "
                    f"{n} layers but not layers {missing}; pass `n=` or `names=`."
                )
            layers = [_pop(tree, p) for p in paths]
            try:
                values = stackwise.stack_layers([_unbox(layer) for layer in layers])
            except ValueError as e:
                raise ValueError(
                    f"stackwise.flax.stack_variables, collection {col!r}: {e}"
                ) from None
            _put(tree, where, _rebox(layers[0], values, lambda b: b.add_axis(0, p_layer)))
        out[col] = tree
    return out


def _axis_for(variable_axes: Mapping[Any, Any], col: str) -> int | None:
    for filt, axis in variable_axes.items():
        if in_filter(filt, col):
            if isinstance(axis, bool) or not isinstance(axis, int):
                raise ValueError(
                    f"stackwise.flax: collection {col!r} has scan axis {axis!r} in "
                    "`variable_axes`; only collections stacked along an int axis convert "
                    "(a broadcast collection holds one copy shared by all layers)."
                )
            return axis
    return None


def _move(
    variables: Mapping[str, Any],
    path: str | tuple[str, ...] | None,
    variable_axes: Mapping[Any, Any],
    to_stack: bool,
    scan_axis_name: Any,
    layer_axis_name: Any,
    what: str,
) -> dict[str, Any]:
    where = _split(path)
    p_scan, p_layer = _params(scan_axis_name), _params(layer_axis_name)
    out = {}
    for col, tree in variables.items():
        axis = _axis_for(variable_axes, col)
        sub = _get(tree, where) if where else tree
        if axis is None or sub is None:
            out[col] = tree
            continue
        src, dst = (axis, 0) if to_stack else (0, axis)
        p_src, p_dst = (p_scan, p_layer) if to_stack else (p_layer, p_scan)

        def move(path, b, src=src, dst=dst, p_src=p_src, p_dst=p_dst, col=col):
            if not isinstance(b, meta.AxisMetadata):
                return jnp.moveaxis(b, src, dst)
            names = getattr(b, "names", None)
            expected = p_src[nn.PARTITION_NAME]
            if names is not None and (len(names) <= src or names[src] != expected):
                fix = "`scan_axis_name`" if to_stack else "`layer_axis_name`"
                raise ValueError(
                    f"stackwise.flax.{what}: variable `{col}{jax.tree_util.keystr(path)}` "
                    f"is partitioned as {tuple(names)}, whose axis {src} should be named "
                    f"{expected!r}; pass the name it was given as {fix}."
                )
            moved = b.replace_boxed(jnp.moveaxis(_value(b), src, dst))
            return moved.remove_axis(src, p_src).add_axis(dst, p_dst)

        moved = jax.tree_util.tree_map_with_path(move, sub, is_leaf=_box)
        if where:
            tree = dict(tree)
            _put(tree, where, moved)
            out[col] = tree
        else:
            out[col] = moved
    return out


def from_scan(
    variables: Mapping[str, Any],
    path: str | tuple[str, ...] | None = None,
    *,
    variable_axes: Mapping[Any, Any] | None = None,
    scan_axis_name: str | None = None,
    layer_axis_name: str | None = None,
) -> dict[str, Any]:
    """Variables of an ``nn.scan`` of the block in a Stack's layout, in every collection.

    ``nn.scan(Block, variable_axes={True: 0}, ...)`` stores each collection
    with the layer axis first, which is the Stack's layout: with that setting
    and the same partition name the conversion is the identity. Other
    ``variable_axes`` (e.g. ``{"params": 1}``) and another
    ``metadata_params={nn.PARTITION_NAME: ...}`` name are moved and renamed.

    >>> import jax.numpy as jnp, stackwise.flax
    >>> scanned = {"params": {"layers": {"w": jnp.zeros((5, 3, 2))}}}
    >>> v = stackwise.flax.from_scan(scanned, "layers", variable_axes={"params": 2})
    >>> v["params"]["layers"]["w"].shape
    (2, 5, 3)
    >>> back = stackwise.flax.to_scan(v, "layers", variable_axes={"params": 2})
    >>> back["params"]["layers"]["w"].shape
    (5, 3, 2)

    Args:
      variables: ``{collection: tree}``, all of a model's variables.
      path: where the scanned module's variables are in each collection
        (``None``: the whole collection, as from ``nn.scan(...)`` at top level).
      variable_axes: the ``variable_axes`` given to ``nn.scan`` (default
        ``{True: 0}``); collections it does not match are left as they are.
      scan_axis_name: ``nn.scan``'s ``metadata_params[nn.PARTITION_NAME]``.
      layer_axis_name: the Stack's ``layer_axis_name``.

    Returns:
      New variables (the input is not modified).

    Raises:
      ValueError: a collection broadcast by ``nn.scan`` (not stacked), or a
        partitioning whose scan axis has another name than ``scan_axis_name``.
    """
    axes = {True: 0} if variable_axes is None else variable_axes
    return _move(variables, path, axes, True, scan_axis_name, layer_axis_name, "from_scan")


def to_scan(
    variables: Mapping[str, Any],
    path: str | tuple[str, ...] | None = None,
    *,
    variable_axes: Mapping[Any, Any] | None = None,
    scan_axis_name: str | None = None,
    layer_axis_name: str | None = None,
) -> dict[str, Any]:
    """The inverse of :func:`from_scan`: a Stack's variables in ``nn.scan``'s layout.

    >>> import jax.numpy as jnp, stackwise.flax
    >>> v = {"params": {"w": jnp.zeros((4, 3))}, "cache": {"k": jnp.zeros((4, 2))}}
    >>> s = stackwise.flax.to_scan(v, variable_axes={"params": 1, "cache": 0})
    >>> s["params"]["w"].shape, s["cache"]["k"].shape
    ((3, 4), (4, 2))

    Args and Returns: as :func:`from_scan`, the other way round.
    """
    axes = {True: 0} if variable_axes is None else variable_axes
    return _move(variables, path, axes, False, scan_axis_name, layer_axis_name, "to_scan")


def _box(x: Any) -> bool:
    return isinstance(x, meta.AxisMetadata)
