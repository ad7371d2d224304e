"""Transformations run through their own options instead of ``vmap``: ``optax.partition``
(and so ``contrib.muon``, which is one) and Muon's weight dimension numbers.

- **partition** (``optax/transforms/_combining.py``: its ``update_fn`` keeps ``transforms``
  and ``param_labels`` in its closure): a label function reads a leaf's shape (Muon's own:
  ``'muon' if x.ndim == 2 else 'adam'``), so it is called on one layer's view of the tree, as
  the loop model's layers would be labelled, and each group's transformation is wrapped on
  its own (an elementwise AdamW group stays the same program). The result is an
  ``optax.partition`` again: its state has the structure of the original's.
- **scale_by_muon**, **scale_by_shape** (``optax/contrib/_muon.py``; their ``update_fn``
  keep ``weight_dimension_numbers`` in their closure): a copy of the update function whose
  dimension numbers are the loop model's for one layer, every axis shifted past the layer
  axes. Muon takes all other axes as batch axes and orthogonalises each layer's matrix in one
  batch (the same arithmetic as the loop model's, without a ``vmap`` around Muon's own).
"""

from __future__ import annotations

import types
from typing import Any

import jax

import optax
from stackwise.optax._plan import closure, view
from stackwise.optax._which import Which, leaf_depths

__all__ = ["own_batch_axes", "partition_parts"]

_WHERE = "stackwise.optax.layerwise"
_PARTITION = "partition.<locals>.update_fn"
# Muon's parts that read dimension numbers; the first forces (0, 1) on a 2-D leaf
# (`orthogonalize_via_newton_schulz`: `if x.ndim == 2: dimension_numbers = (0, 1)`).
_MUON = "scale_by_muon.<locals>.update_fn"
_SHAPE = "scale_by_shape.<locals>.update_fn"


def partition_parts(tx: Any) -> tuple[dict, Any, bool] | None:
    """``(transforms, param_labels, mask_compatible_extra_args)`` of an ``optax.partition``."""
    cells = closure(tx.update) if tx.update.__qualname__ == _PARTITION else {}
    if not {"transforms", "param_labels", "mask_compatible_extra_args"} <= cells.keys():
        return None
    return cells["transforms"], cells["param_labels"], cells["mask_compatible_extra_args"]


def layer_labels(param_labels: Any, stacked: Which) -> Any:
    """A label function called on one layer's view of the tree (a label tree as it is)."""
    if not callable(param_labels):
        return param_labels

    def labels(tree):
        return param_labels(view(tree, leaf_depths(stacked, tree, _WHERE)))

    return labels


def _inner(tx: Any) -> Any:
    """The transformation behind ``with_extra_args_support``'s wrapper (or ``tx``)."""
    update = tx.update
    if update.__qualname__ == "with_extra_args_support.<locals>.update":
        return closure(update).get("tx", tx)
    return tx


def own_batch_axes(tx: Any, stacked: Which) -> optax.GradientTransformation | None:
    """Muon's ``scale_by_muon`` / ``scale_by_shape`` with the layer axes as batch axes."""
    inner = _inner(tx)
    name = getattr(inner.update, "__qualname__", "")
    cells = closure(inner.update)
    if name not in (_MUON, _SHAPE) or "weight_dimension_numbers" not in cells:
        return None
    given = cells["weight_dimension_numbers"]
    dims_type = optax.contrib.MuonDimensionNumbers
    forced = name == _MUON

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

    update = inner.update
    cells = [types.CellType(dimensions) if v == "weight_dimension_numbers" else c
             for v, c in zip(update.__code__.co_freevars, update.__closure__)]
    copy = types.FunctionType(update.__code__, update.__globals__, update.__name__,
                              update.__defaults__, tuple(cells))
    copy.__qualname__, copy.__kwdefaults__ = update.__qualname__, update.__kwdefaults__
    return optax.GradientTransformation(inner.init, copy)


def _shifted(axes: Any, ndim: int, depth: int) -> tuple[int, ...]:
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    return tuple(a % ndim + depth for a in axes)
