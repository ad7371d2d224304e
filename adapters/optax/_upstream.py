"""Every tie of ``stackwise.optax`` to optax's internals, in one place.

optax's public API gives a ``GradientTransformation`` as an opaque ``(init, update)`` pair.
To run a chain part by part, a partition group by group and Muon through its own batch axes,
``layerwise`` reads how optax builds a few of its transformations: the qualified name of an
``update`` function and the variables its closure holds. Each tie below names the optax
version it mirrors (0.2.8, the newest when it was written) and what breaks if upstream
changes it.

Each reader returns None when its tie no longer holds (another name, other closure
variables), and ``layerwise`` then treats the transformation as an opaque one: classified by
the dataflow of its program, run per layer (``vmap``) or on the loop model's tree. That path
is exact, only slower (or, for a chain, without per-part savings). So a changed optax makes
stackwise slower, never wrong; ``tests/optax/test_optax_upstream.py`` checks every tie in the
fast tier, so that the change is seen at once, and that each fallback stays exact.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, NamedTuple

import optax

__all__ = ["MuonPart", "chain_parts", "closure", "is_global_norm_clip", "muon_part",
           "partition_parts", "unwrap_extra_args", "with_dimensions"]

# The qualified names optax 0.2.8 gives the update functions read below.
# optax/_src/base.py, `with_extra_args_support`: `def update(updates, state, params=None,
# **extra_args)`, closing over `tx`. If renamed, a wrapped part is not seen through: a
# wrapped `clip_by_global_norm` or Muon part then runs on the loop view / vmapped (exact).
EXTRA_ARGS = "with_extra_args_support.<locals>.update"
# optax/transforms/_combining.py, `chain`: `def update_fn(updates, state, params=None,
# **extra_args)`, closing over `update_fns` (and its `init_fn` over `init_fns`). If renamed
# or the cells change, a chain (and every alias: `adamw`, `lamb`, ...) is one opaque part:
# exact, but a chain with a per-leaf part then runs every part per layer.
CHAIN = "chain.<locals>.update_fn"
# optax/transforms/_combining.py, `partition` (and `multi_transform`, which calls it):
# `def update_fn(...)`, closing over `transforms`, `param_labels` and
# `mask_compatible_extra_args`. If this changes, a partition is one opaque part (exact:
# its label function is then called under `vmap` or on the loop tree, seeing one layer).
PARTITION = "partition.<locals>.update_fn"
# optax/transforms/_clipping.py, `clip_by_global_norm`: `g_norm = optax.tree.norm(updates)`,
# a sum over every element of the tree, so the same on stacked leaves as on the loop's. If
# renamed, it runs on the loop view (exact, a program that grows with n). If its norm ever
# stopped being over all elements, `test_optax_upstream.py` compares it on split leaves.
GLOBAL_NORM_CLIP = "clip_by_global_norm.<locals>.update_fn"
# optax/contrib/_muon.py, `scale_by_muon` and `scale_by_shape`: `def update_fn(updates,
# state, params=None)`, closing over `weight_dimension_numbers` (a tree or a function of the
# updates). `scale_by_muon`'s `orthogonalize_via_newton_schulz` forces
# `MuonDimensionNumbers(0, 1)` on a 2-D leaf. If either changes, the part runs vmapped per
# layer (exact: its dimension numbers are then resolved on one layer's leaves).
MUON = "scale_by_muon.<locals>.update_fn"
SHAPE = "scale_by_shape.<locals>.update_fn"


def closure(fn: Any) -> dict[str, Any]:
    """The variables a function closes over, by name (none for other callables)."""
    cells = getattr(fn, "__closure__", None) or ()
    code = getattr(fn, "__code__", None)
    if code is None or len(code.co_freevars) != len(cells):
        return {}
    return {name: c.cell_contents for name, c in zip(code.co_freevars, cells)}


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", "")


def unwrap_extra_args(tx: Any) -> Any:
    """The transformation behind ``optax.with_extra_args_support``'s wrapper (or ``tx``)."""
    if _name(tx.update) == EXTRA_ARGS:
        inner = closure(tx.update).get("tx")
        if inner is not None and callable(getattr(inner, "update", None)):
            return unwrap_extra_args(inner)
    return tx


def is_global_norm_clip(tx: Any) -> bool:
    """Whether ``tx`` is ``optax.clip_by_global_norm(...)`` (seen through the wrapper)."""
    return _name(unwrap_extra_args(tx).update) == GLOBAL_NORM_CLIP


def chain_parts(tx: Any) -> list | None:
    """The parts of an ``optax.chain`` (read from its update function's closure), or None."""
    if _name(tx.update) != CHAIN:
        return None
    update_fns = closure(tx.update).get("update_fns")
    init_fns = closure(tx.update).get("init_fns") or closure(tx.init).get("init_fns")
    if (not isinstance(update_fns, tuple | list) or not isinstance(init_fns, tuple | list)
            or len(init_fns) != len(update_fns)
            or not all(callable(f) for f in (*init_fns, *update_fns))):
        return None
    return [optax.GradientTransformationExtraArgs(i, u) for i, u in zip(init_fns, update_fns)]


def partition_parts(tx: Any) -> tuple[dict, Any, bool] | None:
    """``(transforms, param_labels, mask_compatible_extra_args)`` of an ``optax.partition``."""
    if _name(tx.update) != PARTITION:
        return None
    cells = closure(tx.update)
    if not {"transforms", "param_labels", "mask_compatible_extra_args"} <= cells.keys():
        return None
    if not isinstance(cells["transforms"], dict):
        return None
    return cells["transforms"], cells["param_labels"], cells["mask_compatible_extra_args"]


class MuonPart(NamedTuple):
    """A Muon part read from its closure: its ``init``, ``update``, the dimension numbers it
    was given, and whether it forces ``MuonDimensionNumbers(0, 1)`` on a 2-D leaf."""

    init: Callable
    update: Callable
    dimensions: Any
    forces_2d: bool


def muon_part(tx: Any) -> MuonPart | None:
    """``optax.contrib.scale_by_muon`` / ``scale_by_shape`` (seen through the wrapper)."""
    inner = unwrap_extra_args(tx)
    name = _name(inner.update)
    cells = closure(inner.update)
    if name not in (MUON, SHAPE) or "weight_dimension_numbers" not in cells:
        return None
    return MuonPart(inner.init, inner.update, cells["weight_dimension_numbers"], name == MUON)


def with_dimensions(part: MuonPart, dimensions: Callable) -> optax.GradientTransformation:
    """A copy of a Muon part's update function whose ``weight_dimension_numbers`` cell
    holds ``dimensions`` (the same code, globals and other cells): Muon as optax wrote it,
    given other dimension numbers."""
    update = part.update
    cells = tuple(types.CellType(dimensions) if v == "weight_dimension_numbers" else c
                  for v, c in zip(update.__code__.co_freevars, update.__closure__))
    copy = types.FunctionType(update.__code__, update.__globals__, update.__name__,
                              update.__defaults__, cells)
    copy.__qualname__, copy.__kwdefaults__ = update.__qualname__, update.__kwdefaults__
    return optax.GradientTransformation(part.init, copy)
