"""An adapter's variables in the serving layout: each stacked leaf a ``stackwise.Serving``.

The core's serving layout (:mod:`stackwise._core.serving`) is one tree per layer at the
root: ``Serving((layer_0, ..., layer_{n-1}))``. A framework keeps a Stack's variables
inside the model's own tree (a Haiku params dict, linen collections, NNX Variables), whose
containers it builds itself, so only the leaves are free to change. An adapter's serving
layout is therefore leaf-wise: every stacked leaf ``(n, ...)`` becomes a
``stackwise.Serving`` of its n per-layer arrays (:func:`split`; :func:`join` is the
inverse), which the model's tree carries like any leaf and ``jax.jit`` donates buffer by
buffer. At the call the Stack turns its leaf-wise variables into the core's form
(:func:`gather`), runs ``Stacked.apply`` over it (a Python loop of the layers), and turns
the state it returns back (:func:`scatter`). Nothing is copied by either: both only
regroup the same per-layer buffers.

A pattern of k blocks keeps its variables per position (position p holds layers p, p + k,
...), so :func:`gather` takes the k positions' trees and :func:`scatter` gives k back.

Where a Stack is a module holding its own variables (NNX, Equinox), the conversions take the
model and the Stack's place in it, as the core's and the tree adapters' take a tree and a
``path``: :func:`stack_at` finds it, and :func:`moved` refuses the Stack's old methods,
naming the one call that replaced them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from stackwise._core import checks, convert, places, trees
from stackwise._core.serving import Serving

__all__ = [
    "gather",
    "is_serving",
    "join",
    "moved",
    "scatter",
    "served",
    "split",
    "stack_at",
]


def is_serving(value: Any) -> bool:
    """Whether ``value`` is a ``stackwise.Serving`` (an ``is_leaf`` for the leaf-wise form)."""
    return isinstance(value, Serving)


def _leaves(tree: Any) -> list[tuple[str, Any]]:
    """``(path, leaf)`` of ``tree``, a leaf-wise ``Serving`` counted as one leaf."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_serving)
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in flat]


def served(tree: Any) -> bool:
    """Whether any leaf of ``tree`` is in the leaf-wise serving layout."""
    return any(is_serving(v) for _, v in _leaves(tree))


def split(tree: Any, who: str, what: str, fix: str = "") -> Any:
    """``tree`` (every leaf stacked, one depth) with each leaf a ``Serving`` of its layers.

    ``fix``: what the depth error says to do (the default: the Stack's ``init`` gives
    stacked variables).

    Raises:
      TypeError: ``tree`` already holds a ``Serving`` (convert once).
      ValueError: leaves without a common leading layer axis (listed).
    """
    found = [p for p, v in _leaves(tree) if is_serving(v)]
    if found:
        raise TypeError(
            f"{who}: `{what}` must be stacked, but `{what}{found[0]}` is already in the "
            "serving layout (a `stackwise.Serving`); convert a Stack's variables once."
        )
    if not jax.tree.leaves(tree):
        return tree
    n = checks.depth(tree, who, what, fix or "Stacked variables come from the Stack's `init`.")
    return jax.tree.map(lambda leaf: Serving(convert.unstack_exact(leaf, n)), tree)


def join(tree: Any, who: str, what: str) -> Any:
    """The inverse of :func:`split`: every ``Serving`` leaf stacked back, bit for bit.

    Raises:
      TypeError: a leaf of ``tree`` that is not a ``Serving`` (it is not in the serving
        layout).
      ValueError: leaves of different depths, or a ``Serving`` whose layers differ in
        shape or dtype.
    """
    leaves = _leaves(tree)
    _check_all(leaves, who, what)
    _check_counts(leaves, who, what)
    return jax.tree.map(
        lambda s: convert.stack_exact(list(s.layers), who), tree, is_leaf=is_serving
    )


def gather(positions: Sequence[Any], n: int, pattern: bool, who: str, what: str) -> Serving:
    """The core's :class:`Serving` (layer i's tree, in layer order) of a Stack's leaf-wise
    variables: ``positions`` holds one tree per pattern position (one tree without a
    pattern), each leaf a ``Serving`` of that position's layers.

    Raises:
      TypeError: a leaf that is stacked while others are served (one layout per Stack).
      ValueError: a position whose ``Serving`` leaves do not hold its number of layers.
    """
    k = len(positions)
    for p, tree in enumerate(positions):
        leaves = _leaves(tree)
        _check_all(leaves, who, what)
        count = len(range(p, n, k))
        where = f" of pattern position {p}" if pattern else ""
        for path, leaf in leaves:
            if len(leaf) != count:
                raise ValueError(
                    f"{who}: `{what}{path}`{where} holds {len(leaf)} layers in the serving "
                    f"layout, but the Stack (n={n}) runs {count} there; convert this "
                    "Stack's own stacked variables."
                )
    layers = [
        jax.tree.map(lambda s, j=i // k: s.layers[j], positions[i % k], is_leaf=is_serving)
        for i in range(n)
    ]
    return Serving(layers, k if pattern else None)


def scatter(serving: Serving, k: int) -> list[Any]:
    """The inverse of :func:`gather`: the k positions' trees, each leaf a ``Serving``."""
    return [
        jax.tree.map(lambda *layers: Serving(layers), *serving.layers[p::k])
        for p in range(k)
    ]


def _check_all(leaves: list[tuple[str, Any]], who: str, what: str) -> None:
    stacked = [path for path, leaf in leaves if not is_serving(leaf)]
    if stacked:
        served_at = [path for path, leaf in leaves if is_serving(leaf)]
        also = f", while `{what}{served_at[0]}` is served" if served_at else ""
        raise TypeError(
            f"{who}: `{what}{stacked[0]}` is {trees.describe(dict(leaves)[stacked[0]])}, "
            f"not in the serving layout (a `stackwise.Serving`){also}; a Stack's variables "
            "go in one layout. Convert them all with the adapter's `to_serving`, or all "
            "back with its `from_serving`."
        )


def _check_counts(leaves: list[tuple[str, Any]], who: str, what: str) -> None:
    counts = {path: len(leaf) for path, leaf in leaves}
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"`{what}{p}`: {c}" for p, c in counts.items())
        raise ValueError(
            f"{who}: the served leaves of `{what}` hold different numbers of layers "
            f"({listed}); they must come from one Stack's variables."
        )


# --------------------------------------------------------------------------
# A Stack that is a module: its place in the model, and the old methods.


def stack_at(
    module: Any, path: Any, stacks: Sequence[tuple[tuple, Any]], kind: type, who: str
) -> tuple[tuple, Any]:
    """``(keys, stack)``: the ``kind`` Stack at ``path`` in ``module`` (None: ``module`` is
    the Stack). ``stacks`` lists every Stack of ``module`` as ``(keys, stack)``, keys being
    attribute names and list indices (``("decoder", "blocks")``); ``path`` is written
    ``"decoder.blocks"``, ``"decoder/blocks"`` or as such a tuple.

    Raises:
      TypeError: ``path`` None but ``module`` not a Stack, or a ``path`` naming no place.
      ValueError: no Stack at ``path`` (the Stacks of ``module`` listed).
    """
    name = f"{kind.__module__.rsplit('.', 1)[0]}.{kind.__name__}"  # stackwise.nnx.Stack
    held = ", ".join(places.show(k) for k, _ in stacks) or "none"
    if path is None:
        if isinstance(module, kind):
            return (), module
        example = places.show(stacks[0][0]) if stacks else "'blocks'"
        raise TypeError(
            f"{who}: `module` is a {type(module).__name__}, not a `{name}`; give `path`, the "
            f"place of the Stack to convert in it (its Stacks: {held}), e.g. "
            f"`{who}(model, {example})`."
        )
    keys = places.parts(path, who, seps="/.")
    for at, stack in stacks:
        if tuple(map(str, at)) == tuple(map(str, keys)):
            return at, stack
    raise ValueError(
        f"{who}: `module` (a {type(module).__name__}) holds no `{name}` at "
        f"{places.show(keys)}; its Stacks are at: {held}. Give one of those as `path` "
        "(attribute names and list indices joined by '.' or '/')."
    )


def moved(who: str, call: str) -> TypeError:
    """The error of a Stack's old serving method ``who``: the layout is now made by the
    framework's ``call`` (written out), which returns a new model and changes nothing."""
    return TypeError(
        f"{who}: a Stack is no longer converted to or from the serving layout by its own "
        f"method (NNX's converted in place, and with it every module sharing its "
        f"Variables). Call `{call}`: it returns a new model (or Stack) and leaves the given "
        "one, and every module sharing its variables, as it was. The same call serves every "
        "framework (`stackwise.to_serving(tree, path)`, `stackwise.flax.to_serving(variables, "
        "path)`, ...)."
    )
