"""Layout tools for stacked params: unstack, stack back, slice, shard."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["slice_layers", "stack_layers", "stacked_shardings", "stacked_spec", "unstack_layers"]


def _depth(stacked: Any, what: str) -> int:
    leaves = jax.tree_util.tree_leaves_with_path(stacked)
    if not leaves:
        raise ValueError(f"{what}: the stacked tree has no array leaves.")
    depths = {jnp.shape(a)[0] if jnp.ndim(a) else None for _, a in leaves}
    if len(depths) != 1 or None in depths:
        lines = "\n".join(
            f"  {jax.tree_util.keystr(p) or '<root>'}: shape {jnp.shape(a)}" for p, a in leaves
        )
        raise ValueError(
            f"{what}: every leaf needs the same leading layer axis, but the leaves are:\n{lines}"
        )
    return depths.pop()


def unstack_layers(stacked: Any) -> list[Any]:
    """Splits stacked params into a list of per-layer trees (layer i = ``[i]``).

    >>> import jax.numpy as jnp, stackwise
    >>> layers = stackwise.unstack_layers({"w": jnp.arange(6.0).reshape(3, 2)})
    >>> [l["w"].tolist() for l in layers]
    [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    """
    n = _depth(stacked, "stackwise.unstack_layers")
    return [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(n)]


def stack_layers(layers: Sequence[Any]) -> Any:
    """Stacks a list of per-layer trees (all of one structure) along a new axis 0.

    The inverse of :func:`unstack_layers`, bitwise.

    >>> import jax.numpy as jnp, stackwise
    >>> stackwise.stack_layers([{"w": jnp.zeros(2)}, {"w": jnp.ones(2)}])["w"].shape
    (2, 2)
    """
    layers = list(layers)
    if not layers:
        raise ValueError("stackwise.stack_layers: needs at least one layer, got an empty list.")
    first = jax.tree_util.tree_structure(layers[0])
    for i, layer in enumerate(layers[1:], 1):
        if jax.tree_util.tree_structure(layer) != first:
            raise ValueError(
                f"stackwise.stack_layers: layer {i} has structure "
                f"{jax.tree_util.tree_structure(layer)}, but layer 0 has {first}; "
                "every layer must have the same params structure."
            )
    return jax.tree.map(lambda *a: jnp.stack(a), *layers)


def slice_layers(stacked: Any, start: int, stop: int | None = None) -> Any:
    """Layers ``start:stop`` of stacked params, e.g. the first k as a shallower model.

    >>> import jax.numpy as jnp, stackwise
    >>> stackwise.slice_layers({"w": jnp.zeros((6, 3))}, 0, 2)["w"].shape
    (2, 3)
    """
    n = _depth(stacked, "stackwise.slice_layers")
    stop = n if stop is None else stop
    if not 0 <= start < stop <= n:
        raise ValueError(
            f"stackwise.slice_layers: need 0 <= start < stop <= n={n}, got "
            f"start={start}, stop={stop}."
        )
    return jax.tree.map(lambda a: a[start:stop], stacked)


def stacked_spec(spec: PartitionSpec | None, layer_axis: str | None = None) -> PartitionSpec:
    """The ``PartitionSpec`` of a stacked leaf from the spec of one layer's leaf.

    The layer axis is prepended (``None``: replicated across layers; a mesh
    axis name: layers split over it); the inner axes keep their specs.

    >>> from jax.sharding import PartitionSpec as P
    >>> import stackwise
    >>> stackwise.stacked_spec(P("data", None))
    P(None, 'data', None)
    >>> stackwise.stacked_spec(P(None, "model"), layer_axis="stage")
    P('stage', None, 'model')
    """
    return PartitionSpec(layer_axis, *(spec or ()))


def stacked_shardings(mesh: Mesh, specs: Any, layer_axis: str | None = None) -> Any:
    """``NamedSharding`` s for stacked params from a tree of per-layer specs.

    ``specs`` mirrors one layer's params with a ``PartitionSpec`` (or
    ``None`` for replicated) per leaf. Use the result as ``out_shardings`` of
    a jitted ``Stacked.init`` or with :func:`jax.device_put`.

    >>> import jax, numpy as np, stackwise
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    >>> s = stackwise.stacked_shardings(mesh, {"w": P("data", None)})
    >>> s["w"].spec
    P(None, 'data', None)
    """
    is_spec = lambda s: s is None or isinstance(s, PartitionSpec)  # noqa: E731
    return jax.tree.map(
        lambda s: NamedSharding(mesh, stacked_spec(s, layer_axis)), specs, is_leaf=is_spec
    )
