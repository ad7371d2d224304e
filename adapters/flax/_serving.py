"""A linen Stack's variables in the serving layout: each stacked leaf a ``stackwise.Serving``.

:func:`to_serving` converts, once, the subtree at a Stack's path in every collection
(``params``, ``cache``, ``batch_stats``, ...): each stacked leaf ``(n, ...)`` becomes a
``stackwise.Serving`` of its n per-layer arrays (``stackwise._kit.serving``), so that the
variables dict keeps the model's own structure and ``jax.jit`` donates each layer's buffer
on its own. :func:`from_serving` is the exact inverse. The Stack (``_stack.py``) runs such
variables as a Python loop over the layers (the core's serving path) and stores its new
state (a cache, sown values) served again.

A partitioning box (``nn.Partitioned``, ``nn.LogicallyPartitioned``) is kept around the
``Serving``, with the stacked layout's names (the layer axis first): the Stack removes the
layer axis from the names per layer, as in the stacked layout, and :func:`from_serving`
gives the stacked box back bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

from stackwise import _kit
from stackwise.flax._convert import Path, _copy_to, _paths, get, show, variables_dict

__all__ = ["from_serving", "to_serving"]


def to_serving(variables: Mapping[str, Any], path: Path | list[Path]) -> dict[str, Any]:
    """A Stack's variables in the serving layout: per-layer buffers, converted once.

    In every collection, each stacked leaf of the Stack at ``path`` becomes a
    ``stackwise.Serving`` of its n per-layer arrays; the rest of the model is kept. The
    Stack runs such variables as a Python loop over the layers, as a loop of the blocks
    does: no layer slices a stacked weight, and a donated cache (``mutable=["cache"]``)
    is written in place in each layer's own buffer, and comes back served. Its outputs
    are a loop of the blocks', bit for bit (``to_loop``'s variables).

    >>> import jax, jax.numpy as jnp, flax.linen as nn, stackwise.flax
    >>> class Model(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return stackwise.flax.Stack(nn.Dense(4), n=3, name="layers")(x)
    >>> x = jnp.ones((2, 4))
    >>> variables = Model().init(jax.random.key(0), x)
    >>> served = stackwise.flax.to_serving(variables, "layers")
    >>> served["params"]["layers"]["kernel"]
    Serving(3 layers)
    >>> y = jax.jit(Model().apply)(served, x)          # a Python loop of the 3 layers
    >>> bool(jnp.allclose(y, Model().apply(variables, x), atol=1e-6))
    True
    >>> back = stackwise.flax.from_serving(served, "layers")
    >>> jax.tree.all(jax.tree.map(jnp.array_equal, back, variables))
    True

    With a KV cache (``nn.MultiHeadDotProductAttention(decode=True)``, or a block's own
    ``self.variable("cache", ...)``), convert the variables ``init`` gave with the cache;
    ``model.apply(served, x, mutable=["cache"])`` returns the cache served, ready for the
    next token. Sown values (``mutable=["intermediates"]``) come back served as well, one
    array per layer; ``has_aux`` outputs come back stacked, as from the stacked Stack.
    A LoRA or ``stackwise.quant`` node in the params is served leaf by leaf (its codes,
    scales and adapters one buffer per layer, 4-bit codes still packed), and so are qwix's
    quantized arrays.

    Converting holds both layouts for a moment: drop the stacked variables afterwards.

    Args:
      variables: all variables of a model, ``{collection: tree}``, with the Stack's
        stacked, as ``init`` (or :func:`from_loop`) gives them.
      path: the Stack's path in each collection, e.g. ``"layers"`` or
        ``"decoder/layers"``; for a pattern, the list of its k positions' paths
        (``["layers/Local_0", "layers/Global_0"]``), as for :func:`to_loop`.

    Returns:
      New variables (the input is not modified), every leaf exact.

    Raises:
      TypeError: variables already in the serving layout (convert once), or a bad
        ``variables`` or ``path``.
      ValueError: ``path`` in no collection, or leaves without a common leading layer
        axis (listed; one depth across collections, and a pattern's positions of one n).
    """
    who = "stackwise.flax.to_serving"
    return _convert(variables, path, who, _kit.serving.split)


def from_serving(variables: Mapping[str, Any], path: Path | list[Path]) -> dict[str, Any]:
    """The inverse of :func:`to_serving`: the Stack's served variables stacked back, exactly.

    >>> import jax.numpy as jnp, stackwise.flax
    >>> variables = {"params": {"layers": {"w": jnp.arange(6.0).reshape(3, 2)}}}
    >>> served = stackwise.flax.to_serving(variables, "layers")
    >>> stackwise.flax.from_serving(served, "layers")["params"]["layers"]["w"].tolist()
    [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]

    Args:
      variables: all variables of a model, with the Stack's in the serving layout (from
        :func:`to_serving`, or returned served by a call, e.g. its ``cache``).
      path: the Stack's path, or a pattern's list of paths, as given to
        :func:`to_serving`.

    Returns:
      New variables with the Stack's leaves stacked (dtypes and boxes kept).

    Raises:
      TypeError: a leaf of the Stack's that is not served (stacked variables, or some
        served and some not), or a bad ``variables`` or ``path``.
      ValueError: ``path`` in no collection, or served leaves of different depths.
    """
    who = "stackwise.flax.from_serving"
    return _convert(variables, path, who, _kit.serving.join)


def _convert(
    variables: Any, path: Any, who: str, convert: Callable[[Any, str, str], Any]
) -> dict[str, Any]:
    variables = variables_dict(variables, who, served=True)
    paths = _paths(path, who)
    if all(get(t, p) is None for t in variables.values() for p in paths):
        where = " or ".join(repr("/".join(p)) for p in paths)
        have = {col: sorted(t) for col, t in variables.items()}
        raise ValueError(
            f"{who}: no collection has {where}; the variables have {have}. Give the "
            "Stack's path (its name, under its parents' names)."
        )
    out = {}
    depths: dict[int, dict[str, int]] = {}  # position -> collection -> its depth
    for col, tree in variables.items():
        out[col] = tree = dict(tree)
        for q, where in enumerate(paths):
            sub = get(tree, where)
            if sub is None:
                continue
            what = f"variables['{col}']" + "".join(f"['{p}']" for p in where)
            new = convert(sub, who, what)
            _copy_to(tree, where[:-1])[where[-1]] = new
            leaves = jax.tree.leaves(new, is_leaf=_kit.serving.is_serving)
            if leaves:
                depths.setdefault(q, {})[show(col, where)] = _depth(leaves[0])
    _check_depths(depths, len(paths), who)
    return out


def _depth(leaf: Any) -> int:
    return len(leaf) if _kit.serving.is_serving(leaf) else leaf.shape[0]


def _check_depths(depths: dict[int, dict[str, int]], k: int, who: str) -> None:
    """One depth per position across collections; a pattern's positions of one n."""
    counts = {}
    for q, held in depths.items():
        if len(set(held.values())) > 1:
            listed = ", ".join(f"{where}: {d}" for where, d in held.items())
            raise ValueError(
                f"{who}: the Stack's collections hold different numbers of layers "
                f"({listed}); every collection of a block has one layer axis. Convert "
                "one model's variables, as its `init` gave them."
            )
        counts[q] = next(iter(held.values()))
    if k > 1:
        _kit.pattern_depths(counts, k, who)
