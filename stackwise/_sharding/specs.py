"""Sharding specs of stacked params: a per-layer spec with the layer axis put first."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from stackwise._core import checks


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
    spec = checks.partition_spec(spec, who, "spec")
    layer_axis = checks.axis_entry(layer_axis, who, "layer_axis")
    return PartitionSpec(layer_axis, *(spec or ()))


def _written_as_entries(s: Any) -> bool:
    """A tuple or list of axis names and Nones, one at least a name: a spec written without
    ``P`` (a tree of specs holds no str)."""
    return (isinstance(s, (tuple, list)) and any(isinstance(e, str) for e in s)
            and all(e is None or isinstance(e, str) for e in s))


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
      TypeError: ``mesh`` not a mesh, a spec that is not a ``PartitionSpec`` or None
        (its path is named), or a bad ``layer_axis``.
      ValueError: an axis name the mesh does not have.
    """
    who = "stackwise.stacked_shardings"
    mesh = checks.mesh(mesh, who)
    layer_axis = checks.axis_entry(layer_axis, who, "layer_axis", mesh=mesh)

    def is_spec(s: Any) -> bool:  # (and a spec written as a tuple of names, refused below)
        return s is None or isinstance(s, PartitionSpec) or _written_as_entries(s)

    def sharding(path, s):
        key = jax.tree_util.keystr(path)
        s = checks.partition_spec(s, who, "specs", leaf=f"specs{key}")
        checks.spec_on_mesh(s, mesh, who, f"the spec of leaf {key or '<root>'},")
        return NamedSharding(mesh, stacked_spec(s, layer_axis))

    return jax.tree_util.tree_map_with_path(sharding, specs, is_leaf=is_spec)

