"""Which leaves of a model's params are stacked, read from the model itself (NNX, Equinox)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax

from stackwise.optax._which import Position, pattern

__all__ = ["stacked_in"]


# Each Stack found: its path prefix, and for a pattern the prefixes of its k positions (in
# order) and its n.
_Found = tuple[str, list[str], int]


def _nnx_prefixes(model: Any) -> list[_Found] | None:
    nnx = sys.modules.get("flax.nnx")
    if nnx is None or not isinstance(model, nnx.Module):
        return None
    from stackwise.nnx import Stack

    found = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Stack):
            prefix = "".join(f"[{k!r}]" for k in path)
            positions = ([f"{prefix}['layers'][{p}]" for p in range(len(node.layers))]
                         if node.pattern else [])
            found.append((prefix, positions, node.n))
    return found


def _equinox_prefixes(model: Any) -> list[_Found] | None:
    eqx = sys.modules.get("equinox")
    if eqx is None or not isinstance(model, eqx.Module):
        return None
    from stackwise.equinox import Stack

    found = []

    def add(stack, prefix):
        pattern = isinstance(stack.layers, tuple)
        found.append((prefix, [f"{prefix}.layers[{p}]" for p in range(len(stack.layers))]
                      if pattern else [], stack.n))

    def walk(node, prefix):
        pairs = jax.tree_util.tree_flatten_with_path(
            node, is_leaf=lambda x: x is not node and isinstance(x, Stack))[0]
        for path, child in pairs:
            if isinstance(child, Stack):
                add(child, prefix + jax.tree_util.keystr(path))
                walk(child, found[-1][0])

    if isinstance(model, Stack):
        add(model, "")
    walk(model, "")
    return found


def _under(path: str, prefix: str) -> bool:
    return path.startswith(prefix) and path[len(prefix): len(prefix) + 1] in ("", ".", "[")


def stacked_in(model: Any) -> Callable[[str], int]:
    """``stacked=`` for the params of an NNX or Equinox model: every leaf under a Stack.

    The result is a function of a leaf's path (``jax.tree_util.keystr``) giving the number
    of Stacks it lies under (2 for a Stack of Stacks; in a pattern Stack, not nested, its
    position, as :func:`stackwise.optax.pattern` gives it), for :func:`layerwise`, with
    ``nnx.state(model, nnx.Param)`` (or ``nnx.Optimizer(model, tx, wrt=nnx.Param)``) and
    ``eqx.filter(model, eqx.is_array)`` alike:

    >>> import jax, jax.numpy as jnp, equinox as eqx, optax, stackwise.equinox, stackwise.optax
    >>> class Model(eqx.Module):
    ...     embed: jax.Array
    ...     blocks: stackwise.equinox.Stack
    >>> blocks = stackwise.equinox.Stack(lambda key: eqx.nn.Linear(4, 4, key=key), n=3,
    ...                                  key=jax.random.key(0))
    >>> model = Model(jnp.ones((10, 4)), blocks)
    >>> which = stackwise.optax.stacked_in(model)
    >>> which(".blocks.layers.weight"), which(".embed")
    (1, 0)
    >>> tx = stackwise.optax.layerwise(optax.lamb(1e-3), stacked=which)
    >>> state = tx.init(eqx.filter(model, eqx.is_array))

    For Haiku and Flax linen params (plain dicts), name the Stack's module instead, e.g.
    ``stacked=lambda path: "stack/" in path`` or ``{"params": {"Stack_0": True, ...}}``.

    Args:
      model: an ``nnx.Module`` or ``eqx.Module`` holding ``stackwise.nnx.Stack`` s or
        ``stackwise.equinox.Stack`` s.

    Returns:
      A function ``path -> depth`` (or a pattern position).

    Raises:
      TypeError: ``model`` is neither, or holds no Stack.
    """
    where = "stackwise.optax.stacked_in"
    prefixes = _nnx_prefixes(model)
    if prefixes is None:
        prefixes = _equinox_prefixes(model)
    if prefixes is None:
        raise TypeError(
            f"{where}: `model` must be an nnx.Module or an eqx.Module, got "
            f"{type(model).__name__}. For Haiku or linen params, pass `stacked=` a tree prefix "
            "or a function of the path to `layerwise`, e.g. `stacked=lambda path: 'stack/' "
            "in path`."
        )
    if not prefixes:
        raise TypeError(
            f"{where}: `model` ({type(model).__name__}) holds no stackwise Stack, so none of "
            "its leaves has a layer axis; use the plain optimizer, or `layerwise(tx, "
            "stacked=False)`."
        )

    def depth(path: str) -> int | Position:
        around = [(positions, n) for prefix, positions, n in prefixes if _under(path, prefix)]
        if len(around) == 1 and around[0][0]:  # in one Stack, a pattern: its position
            positions, n = around[0]
            for p, position in enumerate(positions):
                if _under(path, position):
                    return pattern(n, len(positions))[p]
        return len(around)

    return depth
