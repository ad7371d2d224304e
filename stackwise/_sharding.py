"""Placing stacked params on a device mesh: FSDP, tensor parallel, stages.

The specs are per-layer (what one layer's weight would get on its own); the
layer axis is added by :func:`stackwise.stacked_spec`, replicated or split
over a stage axis. Inside ``Stacked.apply`` the scan slices one layer at a
time, so XLA gathers an FSDP-sharded layer's weights inside the loop body,
one layer per iteration, never the whole stack at once.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from stackwise._layout import stacked_spec

__all__ = ["fsdp_specs", "gather_params", "shard_stacked"]

_is_spec = lambda s: s is None or isinstance(s, PartitionSpec)  # noqa: E731


class _LeafError(ValueError):
    """A ValueError about one leaf, raised through ``jax.tree.map`` unchanged."""


def _axis_size(mesh: Mesh | AbstractMesh, names: Any) -> int:
    names = names if isinstance(names, tuple) else (names,)
    return math.prod(mesh.shape[a] for a in names)


def _spec_axes(spec: PartitionSpec) -> set[str]:
    used: set[str] = set()
    for entry in spec:
        if entry is None:
            continue
        used.update(entry if isinstance(entry, tuple) else (entry,))
    return used


def _check_axis(mesh: Mesh | AbstractMesh, axis: str, where: str, arg: str) -> None:
    if axis not in mesh.shape:
        raise _LeafError(
            f"{where}: `{arg}={axis!r}` is not an axis of the mesh, whose axes are "
            f"{dict(mesh.shape)}. Name one of those, or build the mesh with it, e.g. "
            f"`jax.make_mesh((8,), ({axis!r},))`."
        )


def _map_specs(specs: Any, params: Any, fn, where: str) -> Any:
    """``fn(path, spec, leaf)`` over params, ``specs`` being a tree prefix of them."""
    if specs is None or isinstance(specs, PartitionSpec):
        return jax.tree_util.tree_map_with_path(lambda p, a: fn(p, specs, a), params)
    try:
        return jax.tree_util.tree_map_with_path(
            lambda p, s, sub: jax.tree_util.tree_map_with_path(lambda q, a: fn(p + q, s, a), sub),
            specs,
            params,
            is_leaf=_is_spec,
        )
    except _LeafError:
        raise
    except ValueError:
        raise ValueError(
            f"{where}: `specs` must mirror one layer's params (a PartitionSpec or None "
            "per leaf, or per subtree), but its structure does not match the params':\n"
            f"  specs:  {jax.tree_util.tree_structure(specs, is_leaf=_is_spec)}\n"
            f"  params: {jax.tree_util.tree_structure(params)}\n"
            "Build it from the params, e.g. `stackwise.fsdp_specs(params, mesh)`, or "
            "`jax.tree.map(lambda a: P(), params)` and edit the leaves you shard."
        ) from None


def fsdp_specs(
    params: Any,
    mesh: Mesh | AbstractMesh,
    axis: str = "data",
    *,
    base: Any = None,
    min_size: int = 0,
) -> Any:
    """Per-layer specs that shard every stacked leaf's largest inner axis (FSDP).

    For each leaf of the stacked ``params`` (arrays or
    :class:`jax.ShapeDtypeStruct`, e.g. from ``jax.eval_shape(layers.init,
    key)``) the largest inner axis (not the layer axis) that ``axis`` divides
    and that ``base`` leaves unsharded is split over ``axis``; leaves with no
    such axis, or with fewer than ``min_size`` elements per layer, stay as
    ``base`` has them. The result is per-layer (no layer axis): pass it to
    :func:`shard_stacked` or :func:`stackwise.stacked_shardings`.

    >>> import jax, jax.numpy as jnp, stackwise
    >>> from jax.sharding import AbstractMesh, PartitionSpec as P
    >>> mesh = AbstractMesh((4,), ("data",))
    >>> params = {"w": jnp.zeros((6, 16, 32)), "b": jnp.zeros((6, 3))}
    >>> stackwise.fsdp_specs(params, mesh)
    {'b': P(), 'w': P(None, 'data')}

    On top of tensor-parallel specs (``base``), FSDP takes a free axis:

    >>> mesh = AbstractMesh((4, 2), ("data", "model"))
    >>> stackwise.fsdp_specs(params, mesh, base={"w": P(None, "model"), "b": None})
    {'b': P(), 'w': P('data', 'model')}

    Args:
      params: stacked params: every leaf has the layer axis first.
      mesh: a :class:`jax.sharding.Mesh` (or ``AbstractMesh``) with ``axis``.
      axis: the mesh axis to shard over (the data-parallel axis for FSDP).
      base: per-layer specs to start from (e.g. tensor-parallel specs over a
        ``"model"`` axis), a tree prefix of one layer's params; ``None``:
        everything replicated.
      min_size: leaves with fewer elements per layer stay unsharded.

    Returns:
      A tree like ``params`` with a per-layer ``PartitionSpec`` per leaf.

    Raises:
      ValueError: ``axis`` is not a mesh axis, or ``base`` does not match.
    """
    where = "stackwise.fsdp_specs"
    _check_axis(mesh, axis, where, "axis")
    size = mesh.shape[axis]

    def one(path, spec, leaf):
        shape = tuple(leaf.shape)[1:]
        entries = list(spec or ()) + [None] * (len(shape) - len(spec or ()))
        if axis in _spec_axes(PartitionSpec(*entries)) or math.prod(shape) < min_size:
            return PartitionSpec(*entries)
        free = [d for d, e in enumerate(entries) if e is None and shape[d] % size == 0]
        if free:
            entries[max(free, key=lambda d: (shape[d], -d))] = axis
        while entries and entries[-1] is None:
            entries.pop()
        return PartitionSpec(*entries)

    return _map_specs(base, params, one, where)


def shard_stacked(
    params: Any,
    mesh: Mesh,
    specs: Any = None,
    *,
    layer_axis: str | None = None,
) -> Any:
    """Places stacked params on ``mesh``: per-layer ``specs``, plus the layer axis.

    Works for any pytree of stacked arrays (from :func:`stackwise.stack`, the
    Haiku and Flax adapters, or :func:`stackwise.stack_layers`). Each leaf
    gets ``NamedSharding(mesh, stacked_spec(spec, layer_axis))``: its inner
    axes sharded as one layer would be (FSDP over a data axis, tensor
    parallel over a model axis), its layer axis replicated (``None``) or
    split over ``layer_axis`` (pipeline stages). Checks every leaf first and
    names the ones that do not fit.

    >>> import jax, jax.numpy as jnp, numpy as np, stackwise
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    >>> params = {"w": jnp.zeros((4, 8, 8)), "b": jnp.zeros((4, 8))}
    >>> placed = stackwise.shard_stacked(params, mesh, {"w": P("data"), "b": None})
    >>> placed["w"].sharding.spec
    P(None, 'data')

    Args:
      params: stacked params: every leaf has the layer axis first.
      mesh: the device mesh.
      specs: per-layer ``PartitionSpec`` s, a tree prefix of one layer's params
        (one spec for everything, one per subtree, or one per leaf); ``None``
        replicates the inner axes. See :func:`fsdp_specs`.
      layer_axis: mesh axis to split the layer axis over, or ``None``.

    Returns:
      ``params`` with every leaf placed by :func:`jax.device_put`.

    Raises:
      ValueError: an axis name not in the mesh, a spec longer than its
        leaf's inner axes, a dimension the mesh axes do not divide, or a
        ``specs`` tree that does not match ``params``.
    """
    where = "stackwise.shard_stacked"
    if layer_axis is not None:
        _check_axis(mesh, layer_axis, where, "layer_axis")

    def sharding(path, spec, leaf):
        name = jax.tree_util.keystr(path) or "<root>"
        full = stacked_spec(spec, layer_axis)
        shape = tuple(leaf.shape)
        if len(full) > len(shape):
            raise _LeafError(
                f"{where}: leaf {name} has shape {shape} (layer axis first) but its "
                f"stacked spec {full} names {len(full)} axes. The specs are per layer: "
                "leave out the layer axis (it is added for you)."
            )
        seen: set[str] = set()
        for dim, entry in enumerate(full):
            if entry is None:
                continue
            for a in entry if isinstance(entry, tuple) else (entry,):
                if a in seen:
                    raise _LeafError(
                        f"{where}: leaf {name}'s stacked spec {full} uses mesh axis {a!r} "
                        "twice; a mesh axis can split one dimension only. (The layer axis "
                        f"takes layer_axis={layer_axis!r}: leave it out of the per-layer specs.)"
                    )
                seen.add(a)
            for a in entry if isinstance(entry, tuple) else (entry,):
                _check_axis(mesh, a, f"{where}: leaf {name}", "spec axis")
            if shape[dim] % _axis_size(mesh, entry):
                what = "the layer axis" if dim == 0 else f"axis {dim}"
                raise _LeafError(
                    f"{where}: leaf {name} has shape {shape}; {what} (length "
                    f"{shape[dim]}) cannot be split over mesh axis {entry!r} of size "
                    f"{_axis_size(mesh, entry)}. Use a spec that leaves it unsharded, or "
                    "pick a mesh axis size that divides it."
                )
        return NamedSharding(mesh, full)

    return jax.device_put(params, _map_specs(specs, params, sharding, where))


def gather(params: Any, axes: str | tuple[str, ...]) -> Any:
    """``params`` resharded without the mesh ``axes`` (an all-gather over them).

    Explicit mesh axes only: a leaf whose type carries no sharding over
    ``axes`` (replicated, ``Auto`` axes, outside a mesh) is returned as it is;
    other axes of the leaf (e.g. a tensor-parallel ``"model"``) keep their
    sharding.
    """
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    names = lambda e: e if isinstance(e, tuple) else (e,)  # noqa: E731

    def one(leaf):
        sharding = getattr(jax.typeof(leaf), "sharding", None)
        spec = tuple(getattr(sharding, "spec", ()) or ())
        if not any(e is not None and set(names(e)) & set(axes) for e in spec):
            return leaf
        kept = [
            None if e is None else (tuple(a for a in names(e) if a not in axes) or None)
            for e in spec
        ]
        kept = [e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in kept]
        return jax.reshard(leaf, NamedSharding(sharding.mesh, PartitionSpec(*kept)))

    return jax.tree.map(one, params)


def gather_params(
    apply: Callable[..., Any], axis: str | tuple[str, ...] = "data"
) -> Callable[..., Any]:
    """Wraps a layer's ``apply`` to all-gather its params over ``axis`` first (FSDP).

    For meshes with explicit axes (:func:`jax.make_mesh`'s default), where
    shardings are part of the types: inside ``Stacked.apply`` each layer's
    slice of FSDP-sharded params is resharded without ``axis`` (an all-gather
    inside the scan body, one layer at a time), and in the backward pass the
    gradients go back to the sharded layout (a reduce-scatter per layer), so
    they stay sharded like the params. Other axes (e.g. a tensor-parallel
    ``"model"`` axis) keep their sharding. On ``Auto`` axes, and outside a
    mesh, it changes nothing: the compiler places the gathers itself.
    ``stackwise.stack(..., fsdp=axis)`` does the same and also never keeps
    the gathered weights for the backward pass.

    >>> import jax, jax.numpy as jnp, stackwise
    >>> apply = lambda p, x: x @ p["w"]
    >>> layers = stackwise.stack(lambda k: {"w": jnp.eye(2)}, stackwise.gather_params(apply), n=3)
    >>> layers.apply(layers.init(jax.random.key(0)), jnp.ones(2))
    Array([1., 1.], dtype=float32)

    Args:
      apply: ``apply(layer_params, *args, **kwargs)``, the layer function
        given to :func:`stackwise.stack`.
      axis: the mesh axis (or axes) the params are FSDP-sharded over.

    Returns:
      The wrapped ``apply``, same signature.
    """

    @functools.wraps(apply)
    def gathered(params, *args, **kwargs):
        return apply(gather(params, axis), *args, **kwargs)

    return gathered
