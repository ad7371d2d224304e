"""Layout tools for stacked params: unstack, stack back, slice, shard."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from stackwise import _convert

__all__ = ["slice_layers", "stack_layers", "stacked_shardings", "stacked_spec", "unstack_layers"]


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
    k = _convert.check_pattern(pattern, _UNSTACK)
    fix = "Stacked params come from `Stacked.init` or `stackwise.stack_layers`."
    if k is None:
        return _convert.unstack_exact(stacked, _convert.depth_of(stacked, _UNSTACK, "tree", fix))
    if not isinstance(stacked, (tuple, list)) or len(stacked) != k:
        got = (
            f"{len(stacked)} trees"
            if isinstance(stacked, (tuple, list))
            else type(stacked).__name__
        )
        raise TypeError(
            f"{_UNSTACK}: with pattern={k}, pass a tuple of {k} stacked trees (position p "
            f"holding layers p, p+{k}, ...), as `Stacked.init` returns them; got {got}."
        )
    positions = [
        _convert.unstack_exact(
            tree,
            _convert.depth_of(tree, _UNSTACK, f"tree of pattern position {p}", fix),
        )
        for p, tree in enumerate(stacked)
    ]
    n = _convert.pattern_depth([len(layers) for layers in positions], _UNSTACK)
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
      TypeError: a leaf whose dtype differs between layers, or a bad
        ``pattern``.
    """
    k = _convert.check_pattern(pattern, _STACK)
    layers = list(layers)
    if k is None:
        return _convert.stack_exact(layers, _STACK)
    if len(layers) < k:
        raise ValueError(
            f"{_STACK}: a pattern of {k} layers needs at least {k} layers, got {len(layers)}."
        )
    return tuple(
        _convert.stack_exact(layers[p::k], _STACK, label=lambda j, p=p: f"layer {p + j * k}")
        for p in range(k)
    )


def slice_layers(stacked: Any, start: int, stop: int | None = None) -> Any:
    """Layers ``start:stop`` of stacked params, e.g. the first k as a shallower model.

    >>> import jax.numpy as jnp, stackwise
    >>> stackwise.slice_layers({"w": jnp.zeros((6, 3))}, 0, 2)["w"].shape
    (2, 3)
    """
    who = "stackwise.slice_layers"
    n = _convert.depth_of(stacked, who, "tree")
    for arg, value in (("start", start), ("stop", stop)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{who}: `{arg}` must be an int, got {type(value).__name__} {value!r}.")
    stop = n if stop is None else stop
    if not 0 <= start < stop <= n:
        raise ValueError(f"{who}: need 0 <= start < stop <= n={n}, got start={start}, stop={stop}.")
    return jax.tree.map(lambda a: a[start:stop], stacked)


def _check_axis(axis: Any, what: str, who: str) -> None:
    ok = (
        axis is None
        or isinstance(axis, str)
        or (isinstance(axis, tuple) and axis and all(isinstance(a, str) for a in axis))
    )
    if not ok:
        raise TypeError(
            f"{who}: {what} must be None (replicated), a mesh axis name or a tuple of "
            f"names, got {type(axis).__name__} {axis!r}."
        )


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

    Args:
      spec: one layer's leaf's ``PartitionSpec``, or None (replicated).
      layer_axis: None, a mesh axis name or a tuple of names for the layer axis.

    Raises:
      TypeError: ``spec`` is not a ``PartitionSpec`` or None (a bare string
        such as ``"data"`` would otherwise be read letter by letter), or a bad
        ``layer_axis``.
    """
    who = "stackwise.stacked_spec"
    if spec is not None and not isinstance(spec, PartitionSpec):
        example = (
            f"`P({spec!r})` to split the leaf's first axis over {spec!r}"
            if isinstance(spec, str)
            else "`P(*spec)`"
            if isinstance(spec, tuple)
            else "`P('data', None)`"
        )
        raise TypeError(
            f"{who}: `spec` must be a `jax.sharding.PartitionSpec` or None, got "
            f"{type(spec).__name__} {spec!r}; pass {example}."
        )
    _check_axis(layer_axis, "`layer_axis`", who)
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

    Raises:
      TypeError: a spec that is not a ``PartitionSpec`` or None (its path is
        named), or a bad ``layer_axis``.
    """
    is_spec = lambda s: s is None or isinstance(s, PartitionSpec)  # noqa: E731

    def sharding(path, s):
        if not is_spec(s):
            hint = f" Pass `P({s!r})`." if isinstance(s, str) else ""
            raise TypeError(
                f"stackwise.stacked_shardings: the spec at {jax.tree_util.keystr(path)} is "
                f"{type(s).__name__} {s!r}, not a `PartitionSpec` or None.{hint}"
            )
        return NamedSharding(mesh, stacked_spec(s, layer_axis))

    return jax.tree_util.tree_map_with_path(sharding, specs, is_leaf=is_spec)
