"""What a gradient transformation does with a leaf: read from its jaxpr, not from its name.

One layer's view of the tree (every stacked leaf sliced to one layer, the others whole) is
traced through the transformation's ``update`` once, with :func:`jax.make_jaxpr`, and the
dataflow of the program is followed from each input leaf to each output:

- **elementwise**: every operation that touches a stacked leaf's values is elementwise
  (``add``, ``mul``, ``sqrt``, ``select_n``, ...), and no output mixes two leaves. Such a
  transformation (``scale_by_adam``, ``sgd``, ``lion``, ``add_decayed_weights``, ...) gives
  the loop model's updates on stacked leaves as it is, so it runs unwrapped: the same
  program.
- **per leaf**: no output mixes two leaves, but some operation reduces, contracts or
  reshapes a leaf (``scale_by_trust_ratio``, ``adafactor``, ``contrib.muon``,
  ``adaptive_grad_clip``, ``clip_by_block_rms``, ...). On a stacked leaf it would see all
  layers as one array: it runs per layer, vmapped over the layer axes.
- **mixing**: an output depends on two leaves, one of them stacked (``clip_by_global_norm``
  and anything that reduces over the whole tree).

An elementwise transformation runs on the stacked tree, where every Python function inside it
sees the stacked shapes: a weight-decay ``mask=`` of ``lambda p: jax.tree.map(lambda x:
x.ndim >= 2, p)``, a label function, a constant that depends on ``x.ndim``. So it runs as it
is only if :func:`batched_alike` holds: its program traced on the stacked tree is its program
on one layer's view, operation for operation, with layer axes added to some values (the same
primitives, the same literals and constants, the same structure of outputs). Otherwise it
runs per layer, where those functions see one layer's shapes, as in the loop.

Which inputs an output depends on is over-approximated where the program has control flow
(``while``, ``cond``, ``scan``: every output of such an operation depends on every input),
so a transformation is never called elementwise or per-leaf when it is not; calls (``jit``,
``custom_jvp``, ``custom_vjp``) are followed inside. Values that only take a leaf's *shape*
(``zeros_like``) do not depend on it, as in JAX's own batching.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

__all__ = ["Program", "batched_alike"]

# Primitives that map each element to an element of the same position (and those that only
# change the dtype or copy). A call of one on a stacked leaf keeps the layers apart.
ELEMENTWISE = frozenset(
    """abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp conj convert_element_type
    copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt igamma imag
    integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or pow
    real reduce_precision rem round rsqrt select_n sign sin sinh sqrt square sub tan tanh xor
    """.split()
)

# Primitives whose sub-program is a plain call: followed inside, input by input.
_CALLS = frozenset(
    ["pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
     "custom_vjp_call_jaxpr", "remat", "checkpoint"]
)


def _sub_jaxpr(eqn) -> Any:
    if eqn.primitive.name not in _CALLS:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if sub is not None:
            inner = getattr(sub, "jaxpr", sub)
            if len(inner.invars) == len(eqn.invars) and len(inner.outvars) == len(eqn.outvars):
                return inner
    return None


def _run(jaxpr, in_labels: list[frozenset], watched: frozenset, state: list[bool]):
    env: dict[Any, frozenset] = {}
    empty = frozenset()

    def read(v):
        return empty if isinstance(v, jcore.Literal) else env.get(v, empty)

    for var, labels in zip(jaxpr.invars, in_labels):
        env[var] = labels
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        sub = _sub_jaxpr(eqn)
        if sub is not None:
            outs = _run(sub, ins, watched, state)
        else:
            touched = any(labels & watched for labels in ins)
            if touched and not _elementwise(eqn, ins, watched):
                state[0] = False
            union = frozenset().union(*ins) if ins else empty
            outs = [union] * len(eqn.outvars)
        for var, labels in zip(eqn.outvars, outs):
            env[var] = labels
    return [read(v) for v in jaxpr.outvars]


def _elementwise(eqn, ins, watched) -> bool:
    name = eqn.primitive.name
    if name in ELEMENTWISE:
        return True
    if name in ("broadcast_in_dim", "reshape", "squeeze", "expand_dims"):
        # Broadcasting a scalar that no stacked leaf feeds, or a no-op reshape.
        operand = eqn.invars[0]
        same = tuple(operand.aval.shape) == tuple(eqn.outvars[0].aval.shape)
        return same or not (ins[0] & watched)
    return False


class Program:
    """One traced function, whose dataflow can be followed from any labelling of its inputs.

    ``Program(fn, args).run(in_labels, watched)`` gives, per flat output leaf, the frozenset of
    input labels it depends on, and whether every operation that touches a ``watched`` label
    is elementwise.
    """

    def __init__(self, fn, args: tuple):
        self.jaxpr = jax.make_jaxpr(fn)(*args).jaxpr

    def run(self, in_labels: list[frozenset], watched: frozenset) -> tuple[list[frozenset], bool]:
        state = [True]
        outputs = _run(self.jaxpr, in_labels, watched, state)
        return outputs, state[0]


# Parameters that carry a shape: on the stacked tree they gain the layer axes. The values
# they shape are compared by their avals instead (`_aval_alike`).
_SHAPE_PARAMS = frozenset(
    ["shape", "new_sizes", "dimensions", "broadcast_dimensions", "sharding", "out_sharding"])


def batched_alike(fn: Callable, view_args: tuple, stacked_args: tuple,
                  layer_shapes: Sequence[tuple[int, ...]]) -> bool:
    """Whether ``fn`` on ``stacked_args`` is ``fn`` on ``view_args`` with layer axes added.

    Both are traced (abstractly); the two programs must match operation by operation: the
    same primitives on the same operands, equal literals, constants and non-shape
    parameters, and every value's shape either the same or one of ``layer_shapes`` followed
    by the same (a value of a stacked leaf). Sub-programs (``jit``, ``custom_jvp``) are
    compared the same way. A trace that fails on the stacked tree, with any error (code
    that takes only one layer's shapes), is not alike: the part then runs per layer.
    """
    try:
        stacked = jax.make_jaxpr(fn)(*stacked_args)
    except Exception:  # noqa: BLE001 - code written for one layer's shapes, failing on more
        return False   # (Muon's `scale_by_shape` on a 3-D leaf: an AttributeError)
    layer = jax.make_jaxpr(fn)(*view_args)
    return _closed_alike(layer, stacked, tuple(layer_shapes))


def _closed_alike(a, b, layers) -> bool:
    if len(a.consts) != len(b.consts) or not all(
            np.shape(x) == np.shape(y) and np.array_equal(x, y)
            for x, y in zip(a.consts, b.consts)):
        return False
    return _alike(a.jaxpr, b.jaxpr, layers)


def _aval_alike(x, y, layers) -> bool:
    ax, ay = x.aval, y.aval
    if (getattr(ax, "dtype", None) != getattr(ay, "dtype", None)
            or getattr(ax, "weak_type", False) != getattr(ay, "weak_type", False)):
        return False
    sx, sy = tuple(getattr(ax, "shape", ())), tuple(getattr(ay, "shape", ()))
    return sx == sy or any(sy == lead + sx for lead in layers)


def _param_alike(p, q, layers) -> bool:
    if isinstance(p, jcore.ClosedJaxpr) and isinstance(q, jcore.ClosedJaxpr):
        return _closed_alike(p, q, layers)
    if isinstance(p, jcore.Jaxpr) and isinstance(q, jcore.Jaxpr):
        return _alike(p, q, layers)
    if isinstance(p, tuple | list) and isinstance(q, tuple | list):
        return len(p) == len(q) and all(_param_alike(x, y, layers) for x, y in zip(p, q))
    if isinstance(p, np.ndarray | jax.Array) or isinstance(q, np.ndarray | jax.Array):
        return np.shape(p) == np.shape(q) and bool(np.array_equal(p, q))
    if callable(p) and callable(q):  # a custom_jvp's rule, traced when differentiated
        return True
    return type(p) is type(q) and p == q


def _alike(a, b, layers) -> bool:
    if (len(a.constvars), len(a.invars), len(a.eqns), len(a.outvars)) != (
            len(b.constvars), len(b.invars), len(b.eqns), len(b.outvars)):
        return False
    env: dict[Any, Any] = {}

    def same(x, y) -> bool:
        if isinstance(x, jcore.Literal) or isinstance(y, jcore.Literal):
            return (isinstance(x, jcore.Literal) and isinstance(y, jcore.Literal)
                    and _aval_alike(x, y, ()) and bool(np.array_equal(x.val, y.val)))
        return env.get(x) is y

    def bind(xs, ys) -> bool:
        for x, y in zip(xs, ys):
            if not _aval_alike(x, y, layers):
                return False
            env[x] = y
        return True

    if not bind(a.constvars + a.invars, b.constvars + b.invars):
        return False
    for ea, eb in zip(a.eqns, b.eqns):
        if (ea.primitive is not eb.primitive or len(ea.invars) != len(eb.invars)
                or len(ea.outvars) != len(eb.outvars) or ea.params.keys() != eb.params.keys()
                or not all(same(x, y) for x, y in zip(ea.invars, eb.invars))
                or not all(k in _SHAPE_PARAMS or _param_alike(ea.params[k], eb.params[k], layers)
                           for k in ea.params)
                or not bind(ea.outvars, eb.outvars)):
            return False
    return all(same(x, y) for x, y in zip(a.outvars, b.outvars))
