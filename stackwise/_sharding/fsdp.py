"""Placing stacked params on a device mesh: FSDP, tensor parallel, stages.

The specs are per-layer (what one layer's weight would get on its own); the
layer axis is added by :func:`stackwise.stacked_spec`, replicated or split
over a stage axis. A whole model's params mix stacked leaves with others
(embeddings): ``stacked=`` says which are which. With
``stackwise.stack(..., fsdp=axes)`` each layer's params are gathered inside
the loop, one layer at a time, and never kept for the backward pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from stackwise._core import checks, trees
from stackwise._core.gather import entry_axes
from stackwise._core.served import stacked_only
from stackwise._sharding.specs import stacked_spec

__all__ = ["fsdp_specs", "shard_stacked"]

_is_spec = lambda s: s is None or isinstance(s, PartitionSpec)  # noqa: E731

# What ``stacked=`` may be: every leaf stacked or none, a tree prefix of bools,
# or a function of a leaf's path (``jax.tree_util.keystr``).
_Which = bool | Callable[[str], bool] | Any


class _LeafError(ValueError):
    """A ValueError about one leaf, raised through ``jax.tree.map`` unchanged."""


def _axis_size(mesh: Mesh | AbstractMesh, names: Any) -> int:
    return math.prod(mesh.shape[a] for a in entry_axes(names))


def _spec_axes(spec: PartitionSpec) -> set[str]:
    return {a for entry in spec for a in entry_axes(entry)}


def _check_axis(mesh: Mesh | AbstractMesh, axis: str, where: str, arg: str) -> None:
    checks.axis_names(axis, where, arg, mesh=mesh)


def _map_specs(specs: Any, params: Any, fn, where: str, arg: str = "specs") -> Any:
    """``fn(path, spec, leaf)`` over params, ``specs`` being a tree prefix of them."""
    if specs is None or isinstance(specs, PartitionSpec):
        return jax.tree_util.tree_map_with_path(lambda p, a: fn(p, specs, a), params)
    written_as_entries = isinstance(specs, (tuple, list)) and all(
        e is None or isinstance(e, str) for e in specs
    )
    if isinstance(specs, str) or (written_as_entries and not isinstance(params, (tuple, list))):
        checks.partition_spec(specs, where, arg)  # a spec written as a str or a tuple
    try:
        jax.tree.map(lambda s, sub: None, specs, params, is_leaf=_is_spec)
    except ValueError:
        raise ValueError(
            f"{where}: `{arg}` must mirror the params (a PartitionSpec or None per leaf, "
            "or per subtree), but its structure does not match the params':\n"
            f"  {arg}:  {jax.tree_util.tree_structure(specs, is_leaf=_is_spec)}\n"
            f"  params: {jax.tree_util.tree_structure(params)}\n"
            "Build it from the params, e.g. `stackwise.fsdp_specs(params, mesh)`, or "
            "`jax.tree.map(lambda a: P(), params)` and edit the leaves you shard."
        ) from None

    def subtree(p, s, sub):
        s = checks.partition_spec(s, where, arg, leaf=f"{arg}{jax.tree_util.keystr(p)}")
        return jax.tree_util.tree_map_with_path(lambda q, a: fn(p + q, s, a), sub)

    return jax.tree_util.tree_map_with_path(subtree, specs, params, is_leaf=_is_spec)


def _shape(leaf: Any, name: str, stacked: bool, where: str) -> tuple[int, ...]:
    """A leaf's shape (arrays, abstract leaves, NumPy values); a stacked leaf needs one axis."""
    shape = checks.leaf_shape(leaf, where, name)
    if stacked and not shape:
        raise _LeafError(
            f"{where}: leaf {name} is {type(leaf).__name__} {leaf!r} with no axes, so it has "
            "no layer axis; make it a stacked array (one value per layer, shape (n,)) or "
            "say it is not stacked, e.g. `stacked=lambda path: path != "
            f"{name!r}`."
        )
    return shape


def _stacked_leaves(stacked: _Which, params: Any, where: str) -> dict[str, bool]:
    """``{keystr(path): has a layer axis}`` for every leaf of ``params``."""
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    if isinstance(stacked, bool):
        return dict.fromkeys(paths, stacked)
    if callable(stacked):
        flags = {p: stacked(p) for p in paths}
    else:
        try:
            tree = jax.tree.map(
                lambda flag, sub: jax.tree.map(lambda _: flag, sub), stacked, params
            )
        except ValueError:
            raise ValueError(
                f"{where}: `stacked` must be True, False, a tree prefix of the params with "
                "a bool per subtree (e.g. `{'embed': False, 'blocks': True}`) or a function "
                "of a leaf's path; its structure does not match the params':\n"
                f"  stacked: {jax.tree_util.tree_structure(stacked)}\n"
                f"  params:  {jax.tree_util.tree_structure(params)}"
            ) from None
        flags = dict(zip(paths, jax.tree.leaves(tree)))
    bad = {p: f for p, f in flags.items() if not isinstance(f, bool)}
    if bad:
        raise TypeError(
            f"{where}: `stacked` must give a bool per leaf (True: the leaf has the layer "
            f"axis first), got {bad}."
        )
    return flags


def fsdp_specs(
    params: Any,
    mesh: Mesh | AbstractMesh,
    axis: str | tuple[str, ...] = "data",
    *,
    base: Any = None,
    min_size: int = 0,
    stacked: _Which = True,
) -> Any:
    """Per-layer specs that shard every stacked leaf's largest inner axis (FSDP).

    For each stacked leaf of ``params`` (arrays or
    :class:`jax.ShapeDtypeStruct`, e.g. from ``jax.eval_shape(layers.init,
    key)``) the largest inner axis (not the layer axis) that ``axis`` divides
    and that ``base`` leaves unsharded is split over ``axis``; leaves with no
    such axis, or with fewer than ``min_size`` elements per layer, stay as
    ``base`` has them. The result is per-layer (no layer axis): pass it to
    :func:`shard_stacked` or :func:`stackwise.stacked_shardings`, and build
    the stack with ``stackwise.stack(..., fsdp=axis)`` so that each layer is
    gathered inside the loop.

    >>> import jax, jax.numpy as jnp, stackwise
    >>> from jax.sharding import AbstractMesh, PartitionSpec as P
    >>> mesh = AbstractMesh((4,), ("data",))
    >>> params = {"w": jnp.zeros((6, 16, 32)), "b": jnp.zeros((6, 3))}
    >>> stackwise.fsdp_specs(params, mesh)
    {'b': P(), 'w': P(None, 'data')}

    On top of tensor-parallel specs (``base``), FSDP takes a free axis; a
    tuple of mesh axes shards over all of them:

    >>> mesh = AbstractMesh((2, 2, 2), ("data", "fsdp", "model"))
    >>> stackwise.fsdp_specs(params, mesh, ("data", "fsdp"), base={"w": P(None, "model"),
    ...                                                          "b": None})
    {'b': P(), 'w': P(('data', 'fsdp'), 'model')}

    A whole model: only the stacked leaves are touched (the others keep
    ``base``'s spec, here none):

    >>> model = {"embed": jnp.zeros((100, 16)), "blocks": params}
    >>> stackwise.fsdp_specs(model, mesh, "data", stacked={"embed": False, "blocks": True})
    {'blocks': {'b': P(), 'w': P(None, 'data')}, 'embed': P()}

    Args:
      params: the params; stacked leaves have the layer axis first.
      mesh: a :class:`jax.sharding.Mesh` (or ``AbstractMesh``) with ``axis``.
      axis: the mesh axis, or a tuple of mesh axes, to shard over.
      base: specs to start from (e.g. tensor-parallel specs over a
        ``"model"`` axis), a tree prefix of the params: per layer for stacked
        leaves, whole for the others; ``None``: everything replicated.
      min_size: leaves with fewer elements per layer stay as ``base`` has them.
      stacked: which leaves have a layer axis: ``True`` (all), a tree prefix
        of the params with a bool per subtree, or a function of a leaf's path
        (``jax.tree_util.keystr``), e.g. ``lambda path: "blocks" in path``.

    Returns:
      A tree like ``params`` with a ``PartitionSpec`` per leaf.

    Raises:
      TypeError: ``mesh`` not a mesh, ``axis`` not axis names, a spec given as a
        str or a tuple (``P('data')`` was meant), or a leaf that is not an array.
      ValueError: ``axis`` (or an axis of ``base``) is not a mesh axis, a base spec
        longer than its leaf, a stacked leaf with no axes (a Python float), or
        ``base`` / ``stacked`` do not match the params.
    """
    where = "stackwise.fsdp_specs"
    stacked_only(where, params=params)
    mesh = checks.mesh(mesh, where)
    axes = checks.axis_names(axis, where, "axis", mesh=mesh)
    min_size = checks.integer(min_size, where, "min_size", minimum=0)
    entry = axes[0] if len(axes) == 1 else axes
    size = _axis_size(mesh, axes)
    flags = _stacked_leaves(stacked, params, where)

    def one(path, spec, leaf):
        name = jax.tree_util.keystr(path) or "<root>"
        is_stacked = flags[jax.tree_util.keystr(path)]
        shape = _shape(leaf, name, is_stacked, where)
        if not is_stacked:
            return spec or PartitionSpec()
        shape = shape[1:]
        checks.spec_on_mesh(spec, mesh, where, f"the base spec of leaf {name},")
        if len(spec or ()) > len(shape):
            raise _LeafError(
                f"{where}: leaf {name} has {len(shape)} axes per layer (shape "
                f"{checks.leaf_shape(leaf, where, name)}, layer axis first) but its base "
                f"spec {spec} names {len(spec)}. The base specs "
                "are per layer: leave out the layer axis, one entry per inner axis at most."
            )
        entries = list(spec or ()) + [None] * (len(shape) - len(spec or ()))
        if set(axes) & _spec_axes(PartitionSpec(*entries)) or math.prod(shape) < min_size:
            return PartitionSpec(*entries)
        free = [d for d, e in enumerate(entries) if e is None and shape[d] % size == 0]
        if free:
            entries[max(free, key=lambda d: (shape[d], -d))] = entry
        while entries and entries[-1] is None:
            entries.pop()
        return PartitionSpec(*entries)

    return _map_specs(base, params, one, where, "base")


def shard_stacked(
    params: Any,
    mesh: Mesh,
    specs: Any = None,
    *,
    layer_axis: str | None = None,
    repeats: int = 1,
    stacked: _Which = True,
) -> Any:
    """Places stacked params on ``mesh``: per-layer ``specs``, plus the layer axis.

    Works for any pytree of stacked arrays (from :func:`stackwise.stack`, the
    adapters, or :func:`stackwise.stack_layers`). Each stacked leaf gets
    ``NamedSharding(mesh, stacked_spec(spec, layer_axis))``: its inner axes
    sharded as one layer would be (FSDP over a data axis, tensor parallel
    over a model axis), its layer axis replicated (``None``) or split over
    ``layer_axis`` (pipeline stages). Leaves that ``stacked`` says have no
    layer axis (embeddings; or specs that already name it, as
    ``nn.get_partition_spec`` of a linen Stack gives them) get their spec as
    it is. Checks every leaf first and names the ones that do not fit.

    >>> import jax, jax.numpy as jnp, numpy as np, stackwise
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    >>> params = {"w": jnp.zeros((4, 8, 8)), "b": jnp.zeros((4, 8))}
    >>> placed = stackwise.shard_stacked(params, mesh, {"w": P("data"), "b": None})
    >>> placed["w"].sharding.spec
    P(None, 'data')

    For a circular pipeline (``stackwise.pipeline(..., schedule="circular",
    repeats=V)``), ``repeats=V`` lays each stacked leaf out as ``(V, n/V,
    ...)`` with the second axis split over ``layer_axis``: stage s then holds
    chunks s, s+S, s+2S, ... without moving anything at each step. The
    stack's apply takes the usual layout back:
    ``jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), placed)``.

    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("stage",))
    >>> placed = stackwise.shard_stacked(params, mesh, layer_axis="stage", repeats=2)
    >>> placed["w"].shape, placed["w"].sharding.spec
    ((2, 2, 8, 8), P(None, 'stage'))

    Args:
      params: the params; stacked leaves have the layer axis first.
      mesh: the device mesh.
      specs: ``PartitionSpec`` s, a tree prefix of the params (one spec for
        everything, one per subtree, or one per leaf): per layer for stacked
        leaves, whole for the others; ``None`` replicates. See
        :func:`fsdp_specs` and :func:`stackwise.logical_specs`.
      layer_axis: mesh axis to split the layer axis over, or ``None``.
      repeats: V > 1 lays stacked leaves out for a circular pipeline (needs
        ``layer_axis``); see above.
      stacked: which leaves have a layer axis that ``specs`` leave out:
        ``True`` (all), ``False`` (none: full specs), a tree prefix of the
        params with a bool per subtree, or a function of a leaf's path.

    Returns:
      ``params`` with every leaf placed by :func:`jax.device_put`; an abstract leaf
      (``jax.ShapeDtypeStruct``, e.g. a checkpoint's restore target from
      ``jax.eval_shape``) comes back abstract, carrying its ``NamedSharding``.

    Raises:
      TypeError: ``mesh`` not a ``Mesh`` of devices, a spec given as a str or a
        tuple, or a leaf that is not an array.
      ValueError: an axis name not in the mesh, a spec longer than its
        leaf's axes, a dimension the mesh axes do not divide, a stacked leaf with
        no axes, or ``specs`` / ``stacked`` trees that do not match ``params``.
    """
    where = "stackwise.shard_stacked"
    stacked_only(where, params=params)
    mesh = checks.mesh(mesh, where)
    if isinstance(mesh, AbstractMesh):
        raise TypeError(
            f"{where}: `mesh` must be a `jax.sharding.Mesh` of devices to place the params "
            "on, got an AbstractMesh; build one with `jax.make_mesh(...)` (an AbstractMesh "
            "suffices for `stackwise.fsdp_specs` and `stackwise.logical_specs`)."
        )
    layer_axis = checks.axis_entry(layer_axis, where, "layer_axis", mesh=mesh)
    repeats = checks.integer(repeats, where, "repeats", minimum=1)
    if repeats > 1 and layer_axis is None:
        raise ValueError(
            f"{where}: `repeats={repeats}` lays the layers out for a circular pipeline over "
            "a stage axis; name it with `layer_axis=`, e.g. `layer_axis='stage'`."
        )
    flags = _stacked_leaves(stacked, params, where)

    def place(path, spec, leaf):
        name = jax.tree_util.keystr(path) or "<root>"
        shape = _shape(leaf, name, flags[jax.tree_util.keystr(path)], where)
        if not flags[jax.tree_util.keystr(path)]:
            full = spec or PartitionSpec()
        elif repeats > 1:
            if shape[0] % repeats:
                raise _LeafError(
                    f"{where}: leaf {name} has {shape[0]} layers, which `repeats={repeats}` "
                    "does not divide."
                )
            shape = (repeats, shape[0] // repeats, *shape[1:])
            full = PartitionSpec(None, layer_axis, *(spec or ()))
        else:
            full = stacked_spec(spec, layer_axis)
        _check_leaf(mesh, name, shape, full, flags[jax.tree_util.keystr(path)], layer_axis)
        sharding = NamedSharding(mesh, full)
        if trees.is_abstract(leaf):  # a restore target: the shape, placed
            return _Placed(jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=sharding), None)
        if shape != checks.leaf_shape(leaf, where, name):
            leaf = _reshape(leaf, shape, sharding)
        return _Placed(leaf, sharding)

    pairs = _map_specs(specs, params, place, where)
    is_pair = lambda v: isinstance(v, _Placed)  # noqa: E731
    leaves = jax.tree.map(lambda v: v.leaf, pairs, is_leaf=is_pair)
    shardings = jax.tree.map(lambda v: v.sharding, pairs, is_leaf=is_pair)
    if not any(trees.is_abstract(a) for a in jax.tree.leaves(leaves)):
        return jax.device_put(leaves, shardings)
    return jax.tree.map(
        lambda v: v.leaf if v.sharding is None else jax.device_put(v.leaf, v.sharding),
        pairs,
        is_leaf=is_pair,
    )


class _Placed(NamedTuple):
    """A leaf and where it goes (None: an abstract leaf that carries its sharding)."""

    leaf: Any
    sharding: NamedSharding | None


def _reshape(leaf: Any, shape: tuple, sharding: NamedSharding) -> Any:
    """``leaf`` reshaped; an array split over its layer axis is regrouped on the way."""
    spec = tuple(getattr(getattr(jax.typeof(leaf), "sharding", None), "spec", ()) or ())
    if spec and spec[0] is not None:
        return jax.lax.reshape(leaf, shape, out_sharding=sharding)
    return jnp.reshape(leaf, shape)


def _check_leaf(
    mesh, name: str, shape: tuple, full: PartitionSpec, stacked: bool, layer_axis: str | None
) -> None:
    where = "stackwise.shard_stacked"
    if len(full) > len(shape):
        fix = (
            "The specs are per layer: leave out the layer axis (it is added for you). If "
            "they already name it (as `nn.get_partition_spec` / `nnx.get_partition_spec` "
            "of a Stack's params do), pass `stacked=False`."
            if stacked
            else "Give one entry per axis at most."
        )
        raise _LeafError(
            f"{where}: leaf {name} has shape {shape}"
            + (" (layer axis first)" if stacked else "")
            + f" but its spec {full} names {len(full)} axes. {fix}"
        )
    seen: set[str] = set()
    for dim, entry in enumerate(full):
        for a in entry_axes(entry):
            if a in seen:
                raise _LeafError(
                    f"{where}: leaf {name}'s spec {full} uses mesh axis {a!r} twice; a mesh "
                    "axis can split one dimension only. (The layer axis takes "
                    f"layer_axis={layer_axis!r}: leave it out of the per-layer specs.)"
                )
            seen.add(a)
            _check_axis(mesh, a, f"{where}: leaf {name}", "spec axis")
        if entry is not None and shape[dim] % _axis_size(mesh, entry):
            what = "the layer axis" if dim == 0 and stacked else f"axis {dim}"
            raise _LeafError(
                f"{where}: leaf {name} has shape {shape}; {what} (length {shape[dim]}) "
                f"cannot be split over mesh axis {entry!r} of size "
                f"{_axis_size(mesh, entry)}. Use a spec that leaves it unsharded, or pick a "
                "mesh axis size that divides it."
            )


