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

The layer's state is per row (each leaf has the batch first, as a KV cache does): row i
reads and writes its own rows. The new state comes out of ``vmap`` written with ``scatter``
(vmap's form of a per-row ``dynamic_update_slice``), which the stack's in-place tracking
(:mod:`stackwise._core.inplace`, :mod:`stackwise._core.through`) does not follow: each
step returns the layer's new cache whole (the same values; a copy of the cache per step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from stackwise._finetune.lora import Adapted
from stackwise._finetune.quant import dequantize, is_quantized
from stackwise._finetune.targets import leaf_paths
from stackwise._upstream import jax as jax_ties

__all__ = ["has_rows", "run"]


class _Low(NamedTuple):
    """An adapted weight as the layer uses it: ``value`` (the base's, maybe cast or
    transposed) plus ``scale * a @ b`` for this row (``a``, ``b``: the row's gathered
    factors, or zeros' worth when ``on`` is False)."""

    value: Any
    a: Any
    b: Any
    scale: float
    on: Any
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


def run(block: Callable[..., Any], params: Any, x: Any, state: Any, who: str) -> tuple:
    """``(out, new_state) = block(float_params, x, state)``, row i with adapter ``rows[i]``.

    ``params`` is one layer's slice (:class:`Adapted` nodes holding ``rows (batch,)``);
    every leaf of ``x`` and ``state`` has the batch on its leading axis. Outputs whose
    per-row leading axis is 1 come back with the batch there; others gain it in front.

    Raises:
      ValueError: ``x`` or ``state`` without the batch leading, adapters of one layer
        attached with and without ``rows``, or an adapted weight the layer uses other than
        in a matrix product.
    """
    batch = _batch(params, who)
    _check_batch(x, batch, "x", who)
    _check_batch(state, batch, "state", who)
    factors: list = []  # (leaf index in the float params, a rows, b rows, on, scale, path)

    def weights(node: Any) -> Any:
        if not isinstance(node, Adapted):
            return dequantize(node) if is_quantized(node) else node
        treedef = jax.tree.structure(node.base, is_leaf=is_quantized)
        subs = treedef.flatten_up_to(node.adapters)
        on = (node.rows >= 0) & (node.rows < node.groups)
        pick = jnp.where(on, node.rows, 0)  # (in range: never another adapter's weights)
        out = []
        for (path, leaf), lw in zip(leaf_paths(node.base, is_leaf=is_quantized), subs):
            w = dequantize(leaf)
            if lw is not None:
                factors.append((w, lw.a[pick], lw.b[pick], on, lw.scale, path))
            out.append(w)
        return jax.tree.unflatten(treedef, out)

    float_params = jax.tree.map(weights, params, is_leaf=_is_node)
    w_leaves, w_def = jax.tree.flatten(float_params)
    x_leaves, x_def = jax.tree.flatten(x)
    s_leaves, s_def = jax.tree.flatten(state)
    where = {id(w): k for k, w in enumerate(w_leaves)}
    at = [where[id(f[0])] for f in factors]
    nw, nx = len(w_leaves), len(x_leaves)

    def one_row(*leaves):
        return block(jax.tree.unflatten(w_def, leaves[:nw]),
                     jax.tree.unflatten(x_def, leaves[nw:nw + nx]),
                     jax.tree.unflatten(s_def, leaves[nw + nx:]))

    row = lambda v: jax.ShapeDtypeStruct((1, *jnp.shape(v)[1:]), jnp.result_type(v))  # noqa: E731
    closed, shapes = jax.make_jaxpr(one_row, return_shape=True)(
        *[jax.ShapeDtypeStruct(jnp.shape(w), jnp.result_type(w)) for w in w_leaves],
        *[row(v) for v in x_leaves], *[row(v) for v in s_leaves])

    def per_row(x_row: list, s_row: list, a_rows: list, b_rows: list, on: list) -> list:
        lows = {}
        for k, pos in enumerate(at):
            w = w_leaves[pos]
            lows[id(w)] = _Low(w, a_rows[k], b_rows[k], factors[k][4], on[k], factors[k][5])
        outs = jax_ties.eval_jaxpr(
            closed.jaxpr, closed.consts, [*w_leaves, *x_row, *s_row],
            inline=lambda ins: any(id(v) in lows for v in ins), observe=lambda *_: None,
            instead=lambda name, ins, eqn: _rewrite(name, ins, eqn, lows, who),
            with_params=True)
        for v in outs:
            if id(v) in lows:
                raise _refuse(lows[id(v)].path, "returns it", who)
        return outs

    outs = jax.vmap(per_row)([v[:, None] for v in x_leaves], [v[:, None] for v in s_leaves],
                             [f[1] for f in factors], [f[2] for f in factors],
                             [f[3] for f in factors])
    outs = [o[:, 0] if s.shape[:1] == (1,) else o
            for o, s in zip(outs, jax.tree.leaves(shapes))]
    return jax.tree.unflatten(jax.tree.structure(shapes), outs)


def _refuse(path: str, how: str, who: str) -> ValueError:
    return ValueError(
        f"{who}: with `rows` each row's update is applied as (x @ a) @ b, so the layer may "
        f"use adapted weight {path} only in a matrix product (`x @ w`, `jnp.dot`, "
        f"`jnp.einsum`, `lax.dot_general`, after a cast or `.T`); it {how}. Serve the "
        "adapters as groups (attach without `rows`), one at a time, or merged "
        "(`stackwise.lora.merge`)."
    )


def _rewrite(name: str, ins: list, eqn: Any, lows: dict, who: str) -> list | None:
    """An equation's outputs where an adapted weight flows in; None where none does."""
    hit = [k for k, v in enumerate(ins) if id(v) in lows]
    if not hit:
        return None
    low = lows[id(ins[hit[0]])]
    if name == "convert_element_type":
        out = jax_ties.bind(eqn, ins)[0]
        lows[id(out)] = low._replace(value=out)
        return [out]
    if name == "transpose" and tuple(eqn.params["permutation"]) == (1, 0):
        out = jax_ties.bind(eqn, ins)[0]  # (a @ b).T = b.T @ a.T
        lows[id(out)] = low._replace(value=out, a=low.b.T, b=low.a.T)
        return [out]
    if name != "dot_general" or len(hit) != 1:
        raise _refuse(low.path, f"uses it in `{name}`", who)
    (contract, batch_dims) = eqn.params["dimension_numbers"]
    side = hit[0]  # 0: the weight is the left operand, 1: the right
    w_axes, v_axes = contract[side], contract[1 - side]
    if len(jnp.shape(low.value)) != 2 or len(w_axes) != 1 or any(batch_dims):
        raise _refuse(low.path, f"uses it in a `dot_general` with dimension numbers "
                      f"{eqn.params['dimension_numbers']} (not one axis of a 2-D weight)", who)
    base = jax_ties.bind(eqn, ins)[0]
    k, v = int(w_axes[0]), ins[1 - side]
    kind = jnp.result_type(low.value)
    # W = a @ b, a (in, r), b (r, out): contract v with the factor holding axis k (`near`,
    # at its axis k), then the rank axis with the other (`far`, whose rank axis is also k).
    near, far = (low.a, low.b) if k == 0 else (low.b, low.a)
    near, far = near.astype(kind), far.astype(kind)
    opts = {"precision": eqn.params.get("precision"),
            "preferred_element_type": eqn.params.get("preferred_element_type")}
    if side == 1:
        t = jax.lax.dot_general(v, near, ((tuple(v_axes), (k,)), ((), ())), **opts)
        update = jax.lax.dot_general(t, far.astype(t.dtype), (((t.ndim - 1,), (k,)), ((), ())),
                                     **opts)
    else:
        t = jax.lax.dot_general(near, v, (((k,), tuple(v_axes)), ((), ())), **opts)
        update = jax.lax.dot_general(far.astype(t.dtype), t, (((k,), (0,)), ((), ())), **opts)
    update = update * jnp.asarray(low.scale, update.dtype)
    return [base + jnp.where(low.on, update, 0).astype(base.dtype)]
