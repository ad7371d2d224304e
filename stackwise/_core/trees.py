"""Array and tree helpers the core shares (jax and numpy only), for concrete and abstract leaves.

- :func:`is_abstract`: a ``jax.ShapeDtypeStruct`` leaf (``jax.eval_shape``,
  ``nnx.eval_shape``): shapes and dtypes without values, a restore target.
- :func:`take` / :func:`take_range`: layer ``i`` / layers ``start:stop`` of a stacked leaf,
  abstract leaves giving abstract slices.
- :func:`stack_abstract` / :func:`moveaxis`: abstract leaves stacked, or an axis moved, as
  ``jnp.stack`` / ``jnp.moveaxis`` would.
- :func:`describe`: what came (``one array float32[2, 8]``, ``a tuple of 3``).
- :func:`named_leaves`: ``(keystr path, leaf)`` pairs of a tree.
- :func:`key_text`: one entry of a tree path as text (``'w'``, ``'0'``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp


def is_abstract(leaf: Any) -> bool:
    """Whether ``leaf`` is a ``jax.ShapeDtypeStruct`` (shapes and dtypes, no values)."""
    return isinstance(leaf, jax.ShapeDtypeStruct)


def take(leaf: Any, i: int) -> Any:
    """Layer ``i`` of a stacked leaf; an abstract leaf gives an abstract slice."""
    if is_abstract(leaf):
        return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype)
    return leaf[i]


def take_range(leaf: Any, start: int, stop: int, step: int = 1) -> Any:
    """Layers ``start:stop:step`` of a stacked leaf; abstract leaves give abstract ones."""
    if is_abstract(leaf):
        count = len(range(start, stop, step))
        return jax.ShapeDtypeStruct((count, *leaf.shape[1:]), leaf.dtype)
    return leaf[start:stop:step]


def stack_abstract(column: Sequence[Any]) -> Any:
    """Abstract leaves of one shape and dtype stacked along a new axis 0 (abstract)."""
    first = column[0]
    return jax.ShapeDtypeStruct((len(column), *first.shape), first.dtype)


def moveaxis(leaf: Any, source: int, destination: int) -> Any:
    """``jnp.moveaxis`` of a leaf; an abstract leaf gives the abstract result."""
    if not is_abstract(leaf):
        return jnp.moveaxis(leaf, source, destination)
    axes = list(range(len(leaf.shape)))
    axes.insert(destination % len(axes), axes.pop(source % len(axes)))
    return jax.ShapeDtypeStruct(tuple(leaf.shape[a] for a in axes), leaf.dtype)


def describe(value: Any) -> str:
    """What a function returned, for messages: ``one array float32[2, 8]``, ``a tuple of 3``."""
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}"
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"one array {getattr(value.dtype, 'name', value.dtype)}{list(value.shape)}"
    return type(value).__name__


def named_leaves(tree: Any, **kwargs: Any) -> list[tuple[str, Any]]:
    """``(keystr path, leaf)`` pairs (``<root>`` for a lone leaf)."""
    return [
        (jax.tree_util.keystr(path) or "<root>", leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree, **kwargs)
    ]


def key_text(k: Any) -> str:
    """One entry of a tree path as text: a dict key, an attribute's name or a sequence index."""
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)
