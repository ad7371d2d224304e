"""Linen's partitioning boxes (``nn.Partitioned``, ``nn.LogicallyPartitioned``).

A variable made with ``nn.with_partitioning`` (or its logical twin) is
stored in a box that holds its array and one partitioning name per axis. The
Stack (``_stack.py``) and the conversions (``_convert.py``,
``_correspond.py``) read the arrays through the boxes and check the layer
axis's name with these; the conversions also put arrays back in their boxes
with the layer axis added or removed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from flax.core import meta

__all__ = [
    "box_meta",
    "check_same_boxes",
    "is_box",
    "partition",
    "rebox",
    "unbox",
    "value",
    "wrong_layer_axis",
]


def is_box(x: Any) -> bool:
    """Whether ``x`` is a box (a linen ``AxisMetadata``), not an array."""
    return isinstance(x, meta.AxisMetadata)


def value(x: Any) -> Any:
    """A box's array, without the sharding constraint ``Partitioned.unbox`` may add;
    anything else as it is."""
    if isinstance(x, meta.Partitioned):
        return x.unbox(apply_constraint=False)
    return x.unbox() if is_box(x) else x


def unbox(tree: Any) -> Any:
    """``tree`` with every box replaced by its array."""
    return jax.tree.map(value, tree, is_leaf=is_box)


def partition(axis_name: Any) -> dict:
    """The ``params`` of ``add_axis`` / ``remove_axis`` for an axis named ``axis_name``."""
    return {nn.PARTITION_NAME: axis_name}


def rebox(boxed: Any, values: Any, update: Callable[[Any], Any]) -> Any:
    """``values`` (unboxed) put back in the boxes of ``boxed``, each box ``update``d."""
    return jax.tree.map(
        lambda b, v: update(b.replace_boxed(v)) if is_box(b) else v, boxed, values, is_leaf=is_box
    )


def box_meta(b: Any) -> Any:
    """A box's kind and partitioning without its array (None for an array)."""
    return (type(b).__name__, b.replace_boxed(None)) if is_box(b) else None


def check_same_boxes(layers: list, col: str, label: Callable[[int], str], who: str) -> None:
    """Layers' boxes (partitioning metadata) must agree, or stacking would drop some."""
    first = jax.tree_util.tree_leaves_with_path(layers[0], is_leaf=is_box)
    for i, layer in enumerate(layers[1:], 1):
        for (path, a), b in zip(first, jax.tree_util.tree_leaves(layer, is_leaf=is_box)):
            if box_meta(a) != box_meta(b):
                raise ValueError(
                    f"{who}: variable {col}{jax.tree_util.keystr(path)} has partitioning "
                    f"{box_meta(b)} in {label(i)} but {box_meta(a)} in {label(0)}; the "
                    "stacked variable keeps one partitioning, so the layers must agree."
                )


def wrong_layer_axis(tree: Any, axis_name: Any) -> tuple[Any, tuple] | None:
    """``(path, names)`` of the first box in ``tree`` whose first (layer) axis is not
    named ``axis_name``, or None if every box's is."""
    for path, b in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_box):
        names = getattr(b, "names", None)
        if is_box(b) and names is not None and (not names or names[0] != axis_name):
            return path, tuple(names)
    return None
