"""Exact conversions between Haiku params/state layouts.

Three layouts hold the same numbers: a Python loop of ``n`` separately named
blocks (``block``, ``block_1``, ...), :class:`stackwise.haiku.Stack`
(``stack/block`` with a leading axis ``n``) and ``hk.layer_stack``
(``__layer_stack_no_per_layer/block`` with a leading axis ``n``). The
functions here move a params or state dict between them, bitwise, leaving the
entries of other modules untouched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["from_layer_stack", "from_loop", "to_layer_stack", "to_loop"]

Tree = Mapping[str, Mapping[str, Any]]


def _split(tree: Tree, prefix: str) -> tuple[dict, dict]:
    """``(inside, outside)``: entries under module ``prefix`` (keyed by the rest of
    their name, e.g. ``""`` or ``"/linear"``) and all others."""
    inside, outside = {}, {}
    for key, bundle in tree.items():
        if key == prefix or key.startswith(prefix + "/"):
            inside[key[len(prefix) :]] = bundle
        else:
            outside[key] = bundle
    return inside, outside


def _names(loop_names: str | Sequence[str], n: int | None, fn: str) -> list[str]:
    if isinstance(loop_names, str):
        if n is None:
            raise TypeError(
                f"stackwise.haiku.{fn}: with `loop_names` a single name "
                f"({loop_names!r}), pass the number of layers `n` too."
            )
        return [loop_names if i == 0 else f"{loop_names}_{i}" for i in range(n)]
    names = list(loop_names)
    if not names or not all(isinstance(s, str) for s in names):
        raise TypeError(
            f"stackwise.haiku.{fn}: `loop_names` must be a module name (expanded to "
            f"Haiku's `name`, `name_1`, ...) or a non-empty list of n module names, "
            f"got {loop_names!r}."
        )
    if n is not None and n != len(names):
        raise ValueError(f"stackwise.haiku.{fn}: got n={n} but {len(names)} `loop_names`.")
    return names


def _modules(tree: Tree) -> str:
    return ", ".join(repr(k) for k in sorted(tree)) or "none"


def _merge(outside: dict, new: dict, fn: str) -> dict:
    clash = sorted(set(outside) & set(new))
    if clash:
        raise ValueError(
            f"stackwise.haiku.{fn}: the converted modules {clash} already exist in the "
            "tree; remove them or choose other names."
        )
    return {**outside, **new}


def to_loop(
    tree: Tree, stacked_name: str, loop_names: str | Sequence[str]
) -> dict[str, dict[str, Any]]:
    """Stacked params or state (of a :class:`Stack` or ``hk.layer_stack``) → a Python loop's.

    Every module under ``stacked_name`` (the block's name inside the stack,
    e.g. ``"stack/block"``) is sliced along its leading axis into ``n``
    modules: layer i's ``stacked_name + rest`` becomes ``loop_names[i] + rest``.
    Other modules are kept as they are.

    >>> import jax.numpy as jnp, stackwise.haiku
    >>> stacked = {"stack/block/linear": {"w": jnp.zeros((3, 4, 4))}, "head": {"b": jnp.ones(2)}}
    >>> loop = stackwise.haiku.to_loop(stacked, "stack/block", "block")
    >>> {k: v["w" if "w" in v else "b"].shape for k, v in loop.items()}
    {'head': (2,), 'block/linear': (4, 4), 'block_1/linear': (4, 4), 'block_2/linear': (4, 4)}

    Args:
      tree: a Haiku params or state dict, ``{module_name: {name: value}}``.
      stacked_name: the stacked block's module name, e.g. ``"stack/block"``,
        ``"model/~/stack/block"`` (a Stack) or
        ``"__layer_stack_no_per_layer/block"`` (``hk.layer_stack``); ``"stack"``
        for a function block with a single module, which then maps to the
        names of that module.
      loop_names: the loop's n module names for the block, e.g.
        ``["block", "block_1", "block_2"]``; a single name is expanded the way
        Haiku names repeated modules (``"block"`` → ``block``, ``block_1``,
        ...), ``n`` being the stacked depth.

    Returns:
      A new dict in the loop's layout.

    Raises:
      ValueError: nothing under ``stacked_name``, leaves whose leading axis is
        not the number of loop names, or converted names that clash.
    """
    inside, outside = _split(tree, stacked_name)
    if not inside:
        raise ValueError(
            f"stackwise.haiku.to_loop: no module named {stacked_name!r} or under it; "
            f"the tree has {_modules(tree)}."
        )
    depths = {jnp.shape(a)[0] if jnp.ndim(a) else None for a in jax.tree.leaves(inside)}
    depth = next(iter(depths)) if len(depths) == 1 else None
    names = _names(loop_names, depth or 0, "to_loop") if isinstance(loop_names, str) else None
    names = names or _names(loop_names, None, "to_loop")
    bad = [
        f"  {stacked_name}{rest}/{jax.tree_util.keystr(path, simple=True, separator='/')}: "
        f"shape {jnp.shape(a)}"
        for rest, bundle in inside.items()
        for path, a in jax.tree_util.tree_leaves_with_path(bundle)
        if jnp.ndim(a) == 0 or jnp.shape(a)[0] != len(names)
    ]
    if bad:
        raise ValueError(
            f"stackwise.haiku.to_loop: every leaf under {stacked_name!r} needs a leading "
            f"layer axis of length {len(names)} (one per loop name), but these do not:\n"
            + "\n".join(bad)
        )
    new = {
        name + rest: jax.tree.map(lambda a, i=i: a[i], dict(bundle))
        for i, name in enumerate(names)
        for rest, bundle in inside.items()
    }
    return _merge(outside, new, "to_loop")


def from_loop(
    tree: Tree, stacked_name: str, loop_names: str | Sequence[str], n: int | None = None
) -> dict[str, dict[str, Any]]:
    """A Python loop's params or state → stacked (a :class:`Stack`'s layout), exactly.

    The inverse of :func:`to_loop`: layer i's modules ``loop_names[i] + rest``
    are stacked along a new leading axis into ``stacked_name + rest``. Other
    modules are kept as they are.

    >>> import haiku as hk, jax, jax.numpy as jnp, stackwise.haiku
    >>> def loop(x):
    ...     for _ in range(3):
    ...         x = x + hk.Linear(4)(x)
    ...     return x
    >>> loop = hk.transform(loop)
    >>> loop_params = loop.init(jax.random.key(0), jnp.ones(4))
    >>> params = stackwise.haiku.from_loop(loop_params, "stack/linear", "linear", n=3)
    >>> jax.tree.map(jnp.shape, params)
    {'stack/linear': {'b': (3, 4), 'w': (3, 4, 4)}}
    >>> stacked = hk.transform(lambda x: stackwise.haiku.Stack(lambda x: x + hk.Linear(4)(x), 3)(x))
    >>> bool(jnp.allclose(stacked.apply(params, None, jnp.ones(4)),
    ...                   loop.apply(loop_params, None, jnp.ones(4))))
    True

    Args:
      tree: a Haiku params or state dict holding the loop's modules.
      stacked_name: the block's module name in the stacked model, e.g.
        ``"stack/block"`` (see :func:`to_loop`).
      loop_names: the loop's n module names for the block, or a single name
        expanded as Haiku names repeated modules (then ``n`` is needed).
      n: the number of layers; needed when ``loop_names`` is a single name.

    Returns:
      A new dict in the stacked layout.

    Raises:
      ValueError: a layer's modules are missing or differ in structure from
        layer 0's, or converted names clash.
      TypeError: ``loop_names`` is a single name and ``n`` is not given.
    """
    names = _names(loop_names, n, "from_loop")
    per_layer, outside = [], dict(tree)
    for i, name in enumerate(names):
        inside, outside = _split(outside, name)
        if not inside:
            raise ValueError(
                f"stackwise.haiku.from_loop: layer {i}'s module {name!r} is not in the "
                f"tree; it has {_modules(tree)}."
            )
        per_layer.append({rest: dict(bundle) for rest, bundle in inside.items()})
    first = jax.tree_util.tree_structure(per_layer[0])
    for i, layer in enumerate(per_layer[1:], 1):
        if jax.tree_util.tree_structure(layer) != first:
            raise ValueError(
                f"stackwise.haiku.from_loop: layer {i} ({names[i]!r}) holds "
                f"{sorted(layer)} with structure {jax.tree_util.tree_structure(layer)}, "
                f"but layer 0 ({names[0]!r}) holds {sorted(per_layer[0])} with "
                f"structure {first}; every layer must have the same modules and params."
            )
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
    new = {stacked_name + rest: bundle for rest, bundle in stacked.items()}
    return _merge(outside, new, "from_loop")


def _rename(tree: Tree, old: str, new: str, fn: str) -> dict[str, dict[str, Any]]:
    inside, outside = _split(tree, old)
    if not inside:
        raise ValueError(
            f"stackwise.haiku.{fn}: no module named {old!r} or under it; the tree has "
            f"{_modules(tree)}."
        )
    return _merge(outside, {new + rest: dict(b) for rest, b in inside.items()}, fn)


def to_layer_stack(
    tree: Tree, stack_name: str, layer_stack_name: str = "__layer_stack_no_per_layer"
) -> dict[str, dict[str, Any]]:
    """A :class:`Stack`'s params or state → ``hk.layer_stack``'s (same arrays, renamed).

    Both layouts stack every leaf along a leading axis ``n`` and keep the
    block's own module names; only the prefix differs. For
    ``hk.layer_stack(n)(lambda x: Block()(x))`` called where the Stack was,
    the block lives under ``"<scope>/__layer_stack_no_per_layer/block"``
    (``__layer_stack_with_per_layer`` with ``with_per_layer_inputs=True``, or
    the ``name`` given to ``hk.layer_stack``).

    >>> import jax.numpy as jnp, stackwise.haiku
    >>> tree = {"stack/block/linear": {"w": jnp.zeros((3, 4, 4))}}
    >>> list(stackwise.haiku.to_layer_stack(tree, "stack"))
    ['__layer_stack_no_per_layer/block/linear']

    Args:
      tree: a Haiku params or state dict.
      stack_name: the Stack's module name, e.g. ``"stack"`` or
        ``"model/~/stack"``.
      layer_stack_name: the ``hk.layer_stack``'s full name prefix.

    Returns:
      A new dict in ``hk.layer_stack``'s layout.
    """
    return _rename(tree, stack_name, layer_stack_name, "to_layer_stack")


def from_layer_stack(
    tree: Tree, stack_name: str, layer_stack_name: str = "__layer_stack_no_per_layer"
) -> dict[str, dict[str, Any]]:
    """``hk.layer_stack``'s params or state → a :class:`Stack`'s; see :func:`to_layer_stack`.

    >>> import jax.numpy as jnp, stackwise.haiku
    >>> tree = {"__layer_stack_no_per_layer/block/linear": {"w": jnp.zeros((3, 4, 4))}}
    >>> list(stackwise.haiku.from_layer_stack(tree, "stack"))
    ['stack/block/linear']

    Args:
      tree: a Haiku params or state dict.
      stack_name: the Stack's module name, e.g. ``"stack"``.
      layer_stack_name: the ``hk.layer_stack``'s full name prefix.

    Returns:
      A new dict in the Stack's layout.
    """
    return _rename(tree, layer_stack_name, stack_name, "from_layer_stack")
