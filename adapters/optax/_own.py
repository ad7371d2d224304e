"""Transformations run through their own options instead of ``vmap``: ``optax.partition``
(and so ``contrib.muon``, which is one) and Muon's weight dimension numbers. How they are
recognised (optax's closures) is in ``_upstream.py``.

- **partition**: a label function reads a leaf's shape (Muon's own: ``'muon' if x.ndim == 2
  else 'adam'``), so it is called on one layer's view of the tree, as the loop model's
  layers would be labelled, and each group's transformation is wrapped on its own (an
  elementwise AdamW group stays the same program). The result is an ``optax.partition``
  again: its state has the structure of the original's.
- **scale_by_muon**, **scale_by_shape**: a copy of the update function whose dimension
  numbers are the loop model's for one layer, every axis shifted past the layer axes. Muon
  takes all other axes as batch axes and orthogonalises each layer's matrix in one batch
  (the same arithmetic as the loop model's, without a ``vmap`` around Muon's own).
"""

from __future__ import annotations

from typing import Any

import jax

import optax
from stackwise.optax import _upstream
from stackwise.optax._plan import view
from stackwise.optax._which import Which, leaf_depths

__all__ = ["layer_labels", "own_batch_axes"]

_WHERE = "stackwise.optax.layerwise"


def layer_labels(param_labels: Any, stacked: Which) -> Any:
    """A label function called on one layer's view of the tree (a label tree as it is)."""
    if not callable(param_labels):
        return param_labels

    def labels(tree):
        return param_labels(view(tree, leaf_depths(stacked, tree, _WHERE)))

    return labels


def own_batch_axes(tx: Any, stacked: Which) -> optax.GradientTransformation | None:
    """Muon's ``scale_by_muon`` / ``scale_by_shape`` with the layer axes as batch axes."""
    part = _upstream.muon_part(tx)
    if part is None:
        return None
    given, forced = part.dimensions, part.forces_2d
    dims_type = optax.contrib.MuonDimensionNumbers

    def dimensions(updates):
        depths = leaf_depths(stacked, updates, _WHERE)
        layer = view(updates, depths)
        resolved = given(layer) if callable(given) else given
        pairs, treedef = jax.tree_util.tree_flatten_with_path(layer)
        if resolved is None:
            per_leaf = [None] * len(pairs)
        else:
            is_dims = lambda x: x is None or isinstance(x, dims_type)  # noqa: E731
            per_leaf = treedef.flatten_up_to(jax.tree.map(
                lambda dn, sub: jax.tree.map(lambda _: dn, sub), resolved, layer,
                is_leaf=is_dims))
        out = []
        for (path, leaf), d, dn in zip(pairs, depths, per_leaf):
            ndim = len(leaf.shape)
            if not d:
                out.append(dn)
            elif forced and ndim == 2:
                out.append(dims_type(reduction_axis=(d,), output_axis=(d + 1,)))
            elif isinstance(dn, dims_type):
                out.append(dims_type(*(_shifted(a, ndim, d) for a in dn)))
            else:
                raise ValueError(
                    f"{_WHERE}: Muon's leaf {jax.tree_util.keystr(path) or '<root>'} has "
                    f"one layer of shape {leaf.shape}: Muon orthogonalises 2-D matrices, or "
                    "leaves its `weight_dimension_numbers` describe, and these give none "
                    f"for it (the loop model's optimizer would fail on it too). Give it "
                    "dimension numbers, or use `optax.contrib.muon`, which gives such "
                    "leaves AdamW."
                )
        return jax.tree.unflatten(treedef, out)

    return _upstream.with_dimensions(part, dimensions)


def _shifted(axes: Any, ndim: int, depth: int) -> tuple[int, ...]:
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    return tuple(a % ndim + depth for a in axes)
