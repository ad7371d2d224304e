"""One layer of a batch whose rows each pick an adapter (multi-LoRA serving).

``stackwise.lora.attach(base, batch, rows=idx)`` serves row ``i`` of ``x`` with adapter
``idx[i]`` of a batch of g (-1: the base alone). :func:`run` computes each adapted weight's
use ``x @ W`` as ``x @ W + scale * (x @ a[idx]) @ b[idx]``, per row, without building a
per-row weight:

- the layer is traced once on one row (a batch of 1: ``x[i:i+1]`` and its state's rows);
- that jaxpr is evaluated under ``jax.vmap`` over the rows, the base weights unbatched (so
  ``x @ W`` stays one matmul over the whole batch: the base is read once per token), and
  each row's gathered ``a[idx[i]]``, ``b[idx[i]]`` batched;
- where the jaxpr multiplies by an adapted weight (``dot_general``, as ``@``, ``jnp.dot``,
  ``jnp.einsum`` emit; after a dtype cast or a transpose), the low-rank term is added.
  Any other use of an adapted weight is refused: it would need the weight itself.

The low-rank term takes one of two forms, the same values. With g adapters for at least g
rows, or adapters weighing at most a quarter of their weight, every adapter side by side:
``((x @ A) * keep) @ B`` with ``A (in, g*r)``, ``B (g*r, out)`` and ``keep`` the row's own
adapter's columns (two plain products for the whole batch; the adapters read once). Else
each row's own ``a[idx[i]]`` and ``b[idx[i]]`` gathered, and a batched product per row
(S-LoRA's BGMV): one adapter read per row instead of all g.

The layer's state is per row (each leaf has the batch first, as a KV cache does): row i
reads and writes its own rows. The one-row program is run for every row at once: each
equation under ``jax.vmap``, except a row's ``dynamic_update_slice`` of its own state rows,
which becomes one ``dynamic_update_slice`` of the whole batch's rows in the state's layout
(where ``vmap`` would write a ``scatter``). So the stack's in-place tracking
(:mod:`stackwise._core.inplace`, :mod:`stackwise._core.through`) still finds a KV cache's
update, and a donated stacked cache is written in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from stackwise._finetune.dropout import guard
from stackwise._finetune.lora import Adapted, add, scaled_update
from stackwise._finetune.quant import dequantize, is_quantized
from stackwise._finetune.targets import leaf_paths
from stackwise._upstream import jax as jax_ties

__all__ = ["has_rows", "run"]


class _Low(NamedTuple):
    """An adapted weight as the layer uses it: ``value`` (the base's, maybe cast or
    transposed) plus, for each row, ``scale * a @ b`` with ``a (in, R)``, ``b (R, out)``.

    Dense (``rows`` None): ``a``, ``b`` hold every adapter side by side (``R = g * r``,
    adapter j's columns ``j*r:(j+1)*r``) and ``keep (batch, R)`` keeps each row's own
    adapter's columns (none for the base alone). Gathered: ``a``, ``b`` hold each row's
    own factors, ``(batch, in, r)``, ``(batch, r, out)``, and ``keep (batch,)`` is whether
    the row has an adapter.
    """

    value: Any
    a: Any
    b: Any
    keep: Any
    dense: bool
    scale: float
    path: str


def _is_node(v: Any) -> bool:
    return isinstance(v, Adapted) or is_quantized(v)


def has_rows(params: Any) -> bool:
    """Whether the layer's params hold adapters attached with ``rows``."""
    return any(isinstance(v, Adapted) and v.rows is not None
               for v in jax.tree.leaves(params, is_leaf=_is_node))


def _batch(params: Any, who: str) -> int:
    nodes = [v for v in jax.tree.leaves(params, is_leaf=_is_node) if isinstance(v, Adapted)]
    sizes = {None if v.rows is None else v.rows.shape[-1] for v in nodes}
    if None in sizes or len(sizes) > 1:
        raise ValueError(
            f"{who}: the layer's params mix adapters attached with `rows` and without, or "
            f"with `rows` of different lengths ({sorted(sizes, key=str)}; None: without); "
            "attach every adapter of a layer in one call, "
            "`stackwise.lora.attach(base, batch, rows=rows)`."
        )
    return sizes.pop()


def _check_batch(tree: Any, batch: int, arg: str, who: str) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        shape = tuple(jnp.shape(leaf))
        if not shape or shape[0] != batch:
            raise ValueError(
                f"{who}: the adapters were attached with `rows` for {batch} rows (one "
                f"adapter index per row), but `{arg}`{jax.tree_util.keystr(path)} has shape "
                f"{shape}: every leaf of `{arg}` needs the batch of {batch} rows on its "
                "leading axis" + (" (a KV cache of shape (batch, ...) per layer)."
                                  if arg == "state" else ".")
            )


def run(block: Callable[..., Any], params: Any, x: Any, state: Any, who: str,
        shared: bool = False) -> tuple:
    """``(out, new_state) = block(float_params, x, state)``, row i with adapter ``rows[i]``.

    ``params`` is one layer's slice (:class:`Adapted` nodes holding ``rows (batch,)``);
    every leaf of ``x`` and ``state`` has the batch on its leading axis. Outputs whose
    per-row leading axis is 1 come back with the batch there; others gain it in front.
    ``shared``: ``new_state`` is one for all rows (a framework's state, reaching ``block``
    by closure), refused where it differs by row.

    Raises:
      ValueError: ``x`` or ``state`` without the batch leading, adapters of one layer
        attached with and without ``rows``, an adapted weight the layer uses other than
        in a matrix product, or (``shared``) a new state that differs by row.
    """
    batch = _batch(params, who)
    _check_batch(x, batch, "x", who)
    _check_batch(state, batch, "state", who)
    if not (jax_ties.holds(jax_ties.EVAL_LOOP) and jax_ties.holds(jax_ties.UPDATE_SLICE)):
        return _each_row_merged(block, params, x, state, shared, who)
    lows: dict = {}  # id(base weight) -> _Low

    def weights(node: Any) -> Any:
        if not isinstance(node, Adapted):
            return dequantize(node) if is_quantized(node) else node
        treedef = jax.tree.structure(node.base, is_leaf=is_quantized)
        subs = treedef.flatten_up_to(node.adapters)
        g = node.groups
        on = (node.rows >= 0) & (node.rows < g)
        pick = jnp.where(on, node.rows, 0)  # (in range: never another adapter's weights)
        out = []
        for (path, leaf), lw in zip(leaf_paths(node.base, is_leaf=is_quantized), subs):
            w = dequantize(leaf)
            if lw is not None:
                lw = guard(lw, path, who)  # (no dropout here: refused when differentiated)
                g, d_in, r = lw.a.shape
                # Side by side, the g adapters are read once for the batch (and run as two
                # plain products); gathered, one per row (a batched product per row). Side
                # by side when that reads less, or the adapters weigh little beside W.
                d_out = lw.b.shape[-1]
                if g <= batch or 4 * g * r * (d_in + d_out) <= d_in * d_out:
                    keep = jax.nn.one_hot(jnp.where(on, pick, -1), g, dtype=lw.a.dtype)
                    lows[id(w)] = _Low(
                        w, jnp.moveaxis(lw.a, 0, 1).reshape(d_in, g * r),
                        lw.b.reshape(g * r, lw.b.shape[-1]), jnp.repeat(keep, r, axis=1),
                        True, lw.scale, path)
                else:
                    lows[id(w)] = _Low(w, lw.a[pick], lw.b[pick], on, False, lw.scale, path)
            out.append(w)
        return jax.tree.unflatten(treedef, out)

    float_params = jax.tree.map(weights, params, is_leaf=_is_node)
    w_leaves, w_def = jax.tree.flatten(float_params)
    x_leaves, x_def = jax.tree.flatten(x)
    s_leaves, s_def = jax.tree.flatten(state)
    nw, nx = len(w_leaves), len(x_leaves)

    def one_row(*leaves):
        return block(jax.tree.unflatten(w_def, leaves[:nw]),
                     jax.tree.unflatten(x_def, leaves[nw:nw + nx]),
                     jax.tree.unflatten(s_def, leaves[nw + nx:]))

    row = lambda v: jax.ShapeDtypeStruct((1, *jnp.shape(v)[1:]), jnp.result_type(v))  # noqa: E731
    closed, shapes = jax.make_jaxpr(one_row, return_shape=True)(
        *[jax.ShapeDtypeStruct(jnp.shape(w), jnp.result_type(w)) for w in w_leaves],
        *[row(v) for v in x_leaves], *[row(v) for v in s_leaves])
    outs = jax_ties.eval_jaxpr(
        closed.jaxpr, closed.consts,
        [*w_leaves, *[_Rows(v, True) for v in (*x_leaves, *s_leaves)]],
        inline=lambda ins: any(isinstance(v, _Rows) or id(v) in lows for v in ins),
        observe=lambda *_: None,
        instead=lambda name, ins, eqn: _step(name, ins, eqn, lows, batch, who),
        with_params=True)
    n_out = len(jax.tree.leaves(shapes[0])) if shared else len(outs)  # (shared: a pair)
    flat = []
    for j, (v, shape) in enumerate(zip(outs, jax.tree.leaves(shapes))):
        if id(v) in lows:
            raise _refuse(lows[id(v)].path, "returns it", who)
        if j >= n_out and shared:
            if isinstance(v, _Rows):
                path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(
                    shapes[1])[0][j - n_out][0])
                raise ValueError(
                    f"{who}: with `rows` the layer's new state{path} comes out different "
                    "for each row, and this Stack holds one state for all rows (it reaches "
                    "the layer as an argument). Keep per-row state, such as a KV cache, in "
                    "a core stack's state: `stackwise.lora.stack(apply, n, with_state=True)`"
                    " with each state leaf (batch, ...), or run without updating it."
                )
            flat.append(v)
        elif isinstance(v, _Rows):
            flat.append(v.full)
        else:  # the same for every row
            lead = (batch, *shape.shape[1:]) if shape.shape[:1] == (1,) else (batch, *shape.shape)
            flat.append(jnp.broadcast_to(v, lead))
    return jax.tree.unflatten(jax.tree.structure(shapes), flat)


def _each_row_merged(block: Callable[..., Any], params: Any, x: Any, state: Any,
                     shared: bool, who: str) -> tuple:
    """The exact path where the jaxpr evaluation's ties no longer hold: ``jax.vmap`` over
    the rows, each row's weights built as ``W + scale * a[idx] @ b[idx]`` (the same values;
    a weight per row, and the cache written with vmap's scatter)."""
    nodes = [v for v in jax.tree.leaves(params, is_leaf=_is_node) if isinstance(v, Adapted)]
    on = [(v.rows >= 0) & (v.rows < v.groups) for v in nodes]
    picks = [jnp.where(o, v.rows, 0) for o, v in zip(on, nodes)]

    def one(x_row, s_row, picks, on):
        found = iter(zip(picks, on))

        def weights(node):
            if not isinstance(node, Adapted):
                return dequantize(node) if is_quantized(node) else node
            pick, keep = next(found)
            treedef = jax.tree.structure(node.base, is_leaf=is_quantized)
            subs = treedef.flatten_up_to(node.adapters)
            out = []
            for leaf, lw in zip(jax.tree.leaves(node.base, is_leaf=is_quantized), subs):
                w = dequantize(leaf)
                if lw is not None:
                    lw = guard(lw, "", who)
                    d = jnp.where(keep, scaled_update(lw.a[pick], lw.b[pick], lw.scale), 0)
                    w = add(w, d)
                out.append(w)
            return jax.tree.unflatten(treedef, out)

        lead = lambda v: v[None]  # noqa: E731  (the row as a batch of one)
        out, kept = block(jax.tree.map(weights, params, is_leaf=_is_node),
                          jax.tree.map(lead, x_row), jax.tree.map(lead, s_row))
        drop = lambda v: v[0] if jnp.shape(v)[:1] == (1,) else v  # noqa: E731
        return jax.tree.map(drop, out), (kept if shared else jax.tree.map(drop, kept))

    return jax.vmap(one, out_axes=(0, None if shared else 0))(x, state, picks, on)


class _Rows:
    """A value of the one-row program for every row at once: ``full`` holds the rows, first.

    ``merged``: the row value's leading axis (of length 1) is the batch's, so ``full`` has
    the row's shape with the batch there (``x``, the state, what keeps their layout);
    else ``full`` is ``(batch, *row_shape)``, as ``jax.vmap`` stacks it.
    """

    __slots__ = ("full", "merged")

    def __init__(self, full: Any, merged: bool):
        self.full, self.merged = full, merged

    def mapped(self) -> Any:
        """``(batch, *row_shape)``."""
        return self.full[:, None] if self.merged else self.full

    @staticmethod
    def of(mapped: Any, row_shape: tuple) -> _Rows:
        if tuple(row_shape[:1]) == (1,):
            return _Rows(mapped[:, 0], True)
        return _Rows(mapped, False)


def _mapped(fn: Callable[..., list], ins: list, outvars: list) -> list:
    """``fn(*ins)`` of one row, run for every row (``jax.vmap`` over the :class:`_Rows`)."""
    at = [k for k, v in enumerate(ins) if isinstance(v, _Rows)]

    def one(*rows):
        full = list(ins)
        for k, r in zip(at, rows):
            full[k] = r
        return fn(*full)

    outs = jax.vmap(one)(*[ins[k].mapped() for k in at])
    return [_Rows.of(o, v.aval.shape) for o, v in zip(outs, outvars)]


def _step(name: str, ins: list, eqn: Any, lows: dict, batch: int, who: str) -> list | None:
    """An equation of the one-row program for every row: None where no row value and no
    adapted weight flows in (it is bound as it is)."""
    if any(id(v) in lows for v in ins):
        return _rewrite(name, ins, eqn, lows, who)
    if not any(isinstance(v, _Rows) for v in ins):
        return None
    parts = jax_ties.update_slice_parts(name, ins)
    if (parts is not None and isinstance(parts.operand, _Rows) and parts.operand.merged
            and not any(isinstance(v, _Rows) for v in parts.starts)):
        # A row's update of its own rows (a KV cache): one update of the whole batch's
        # rows, in the state's own layout, so that the stack writes it in place. (The
        # row's leading axis has length 1: its start is 0, as the batch's is.)
        update = parts.update
        update = update.full if isinstance(update, _Rows) and update.merged else (
            update.mapped()[:, 0] if isinstance(update, _Rows)
            else jnp.broadcast_to(update, (batch, *jnp.shape(update)[1:])))
        full = parts.operand.full
        out = jax.lax.dynamic_update_slice(full, update.astype(full.dtype),
                                           [jnp.asarray(s) for s in parts.starts])
        return [_Rows(out, True)]
    return _mapped(lambda *a: jax_ties.bind(eqn, list(a)), ins, eqn.outvars)


def _refuse(path: str, how: str, who: str) -> ValueError:
    return ValueError(
        f"{who}: with `rows` each row's update is applied as (x @ a) @ b, so the layer may "
        f"use adapted weight {path} only in a matrix product (`x @ w`, `jnp.dot`, "
        f"`jnp.einsum`, `lax.dot_general`, after a cast or `.T`); it {how}. Serve the "
        "adapters as groups (attach without `rows`), one at a time, or merged "
        "(`stackwise.lora.merge`)."
    )


def _rewrite(name: str, ins: list, eqn: Any, lows: dict, who: str) -> list:
    """An equation's outputs where an adapted weight flows in."""
    hit = [k for k, v in enumerate(ins) if id(v) in lows]
    low = lows[id(ins[hit[0]])]
    if name == "convert_element_type":
        out = jax_ties.bind(eqn, ins)[0]
        lows[id(out)] = low._replace(value=out)
        return [out]
    if name == "transpose" and tuple(eqn.params["permutation"]) == (1, 0):
        out = jax_ties.bind(eqn, ins)[0]  # (a @ b).T = b.T @ a.T
        lows[id(out)] = low._replace(value=out, a=jnp.swapaxes(low.b, -1, -2),
                                     b=jnp.swapaxes(low.a, -1, -2))
        return [out]
    if name != "dot_general" or len(hit) != 1:
        raise _refuse(low.path, f"uses it in `{name}`", who)
    (contract, batch_dims) = eqn.params["dimension_numbers"]
    side = hit[0]  # 0: the weight is the left operand, 1: the right
    w_axes, v_axes = contract[side], contract[1 - side]
    if len(jnp.shape(low.value)) != 2 or len(w_axes) != 1 or any(batch_dims):
        raise _refuse(low.path, f"uses it in a `dot_general` with dimension numbers "
                      f"{eqn.params['dimension_numbers']} (not one axis of a 2-D weight)", who)
    k, v = int(w_axes[0]), ins[1 - side]
    kind = jnp.result_type(low.value)
    opts = {"precision": eqn.params.get("precision"),
            "preferred_element_type": eqn.params.get("preferred_element_type")}

    def update(v, a, b, keep):  # one row's scale * (v @ a) @ b, where W = a @ b
        # Contract v with the factor holding axis k (`near`, at its axis k), then the rank
        # axis with the other (`far`, whose rank axis is also k); side by side, the rank
        # axis first keeps the row's own adapter's columns.
        near, far = (a, b) if k == 0 else (b, a)
        near = near.astype(kind)
        if side == 1:
            t = jax.lax.dot_general(v, near, ((tuple(v_axes), (k,)), ((), ())), **opts)
            t = t * keep.astype(t.dtype).reshape(*[1] * (t.ndim - 1), -1) if low.dense else t
            u = jax.lax.dot_general(t, far.astype(t.dtype), (((t.ndim - 1,), (k,)), ((), ())),
                                    **opts)
        else:
            t = jax.lax.dot_general(near, v, (((k,), tuple(v_axes)), ((), ())), **opts)
            t = t * keep.astype(t.dtype).reshape(-1, *[1] * (t.ndim - 1)) if low.dense else t
            u = jax.lax.dot_general(far.astype(t.dtype), t, (((k,), (0,)), ((), ())), **opts)
        u = u * jnp.asarray(low.scale, u.dtype)
        return u if low.dense else jnp.where(keep, u, 0)

    shape = eqn.outvars[0].aval.shape
    rows = low.keep.shape[0]
    base = _mapped(lambda *a: jax_ties.bind(eqn, list(a)), ins, eqn.outvars)[0] if isinstance(
        v, _Rows) else _Rows.of(jnp.broadcast_to(jax_ties.bind(eqn, ins)[0], (rows, *shape)),
                                shape)
    factors = None if low.dense else 0  # (side by side: one pair for every row)
    per_row = jax.vmap(update, in_axes=(0 if isinstance(v, _Rows) else None, factors,
                                        factors, 0))(
        v.mapped() if isinstance(v, _Rows) else v, low.a, low.b, low.keep)
    return [_Rows.of(base.mapped() + per_row.astype(base.full.dtype), shape)]
