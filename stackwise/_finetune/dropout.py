"""LoRA dropout as PEFT applies it while training: ``x @ W + scale * (dropout(x) @ a) @ b``.

PEFT drops the adapter's input, not the layer's: its ``lora.Linear`` computes
``base(x) + lora_B(lora_A(dropout(x))) * scaling``, ``x`` cast to the adapters' dtype
first. A wrapped layer is given its weights, not its inputs, so :func:`run` does what
:mod:`.rows` does for multi-LoRA serving:

- the layer is traced once with each dropping adapter's weight as the float base ``W``
  alone (dequantized; in ``dtype`` if given);
- that jaxpr is evaluated equation by equation; where it multiplies by such a weight
  (``dot_general``, as ``@``, ``jnp.dot``, ``jnp.einsum`` emit; after casts, transposes,
  reshapes or slices of it), the product's other operand ``v`` is dropped with the
  adapter's rate p (each element kept with probability 1 - p and scaled by 1 / (1 - p)),
  and the adapter's term on it is added: ``scale * (dropout(v) @ a) @ b``, in the
  adapters' dtype, low rank (the adapted weight is never built). A DoRA adapter adds
  ``dropout(v) @ (V * m / |V| - W)``, ``V = W + scale * a @ b``: PEFT's DoRA in training,
  ``(m / |V| - 1) * (dropout(v) @ W) + m / |V| * scale * (dropout(v) @ a) @ b``, written
  as one weight (its norm held constant for gradients, as there).

Keys: ``attach(..., key=)`` gives each attached node one key per layer (the scan slices
them); in layer i, the node's base leaf j draws the mask of its u-th product from
``fold_in(fold_in(keys[i], j), u)`` (u = 0 for a layer that uses the weight once).

Without keys (evaluation, decoding) nothing is dropped and the layer gets its adapted
weights as without dropout; differentiating adapters that drop, without a key, is refused
(:func:`guard`), since their training would silently differ from PEFT's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from stackwise._finetune.lora import Adapted, LoraWeights, add, dora_scaled, scaled_update
from stackwise._finetune.quant import dequantize, is_quantized
from stackwise._finetune.targets import leaf_paths
from stackwise._upstream import jax as jax_ties

__all__ = ["drop", "guard", "has_keys", "joined", "run"]

#: Equations that move or cast a weight without mixing in anything else: the adapter's
#: term follows the weight through them (replayed on its update ``D``).
STRUCTURAL = ("convert_element_type", "transpose", "reshape", "squeeze", "expand_dims",
              "broadcast_in_dim", "slice", "dynamic_slice", "rev", "copy", "copy_p")


def _is_node(v: Any) -> bool:
    return isinstance(v, Adapted) or is_quantized(v)


def joined(where: str, path: str) -> str:
    """A leaf's path in a layer's params: its node's (``where``) and its own in the node."""
    return (where + ("" if path == "<root>" else path)) or "<root>"


def has_keys(params: Any) -> bool:
    """Whether a layer's params hold attached adapters with dropout keys."""
    return any(isinstance(v, Adapted) and v.keys is not None
               for v in jax.tree.leaves(params, is_leaf=_is_node))


def drop(v: jax.Array, key: jax.Array, rate: float) -> jax.Array:
    """``v`` with each element kept with probability ``1 - rate`` and scaled by
    ``1 / (1 - rate)``, the others 0 (``torch.nn.Dropout`` in training; flax's
    ``nn.Dropout``): ``jax.random.bernoulli(key, 1 - rate, v.shape)`` is the mask."""
    keep = jax.random.bernoulli(key, 1.0 - rate, jnp.shape(v))
    return jnp.where(keep, v / jnp.asarray(1.0 - rate, v.dtype), jnp.zeros((), v.dtype))


# --------------------------------------------------------------------------
# No key while training: refused when the adapters are differentiated.


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _keyless(message: str, factors: tuple) -> tuple:
    return factors


@_keyless.defjvp
def _keyless_jvp(message, primals, tangents):
    raise ValueError(message)


def guard(lw: LoraWeights, path: str, who: str) -> LoraWeights:
    """``lw`` as it is, but refusing to be differentiated when it has a dropout rate: its
    training without a key would silently apply no dropout where PEFT applies it."""
    if not lw.dropout:
        return lw
    message = (
        f"{who}: the adapter at {path} has dropout {lw.dropout} (PEFT's lora_dropout) and is "
        "differentiated without a dropout key, so it would train without the dropout PEFT "
        "trains it with. Give a new key each step: `stackwise.lora.attach(base, adapters, "
        "key=step_key)`, or `stackwise.lora.combine(trainable, frozen, key=step_key)`; to "
        "train without dropout, make the adapters with `dropout=0.0` (`dataclasses.replace("
        "lw, dropout=0.0)` on each `stackwise.lora.LoraWeights`)."
    )
    a, b, m = _keyless(message, (lw.a, lw.b, lw.magnitude))
    return dataclasses.replace(lw, a=a, b=b, magnitude=m)


# --------------------------------------------------------------------------
# The layer run with its dropping adapters' terms added at each product.


class _Weight(NamedTuple):
    """A dropping adapter's weight as the layer uses it: ``value`` (the base's, after
    ``ops``, the structural equations applied since, each ``(eqn, inputs)``), the float
    base ``w`` it started from, the adapter, the leaf's key in this layer and its path."""

    value: Any
    w: Any
    lw: LoraWeights
    ops: tuple
    key: Any
    path: str


def run(block: Callable[..., Any], params: Any, args: tuple, *, dtype: Any,
        adapted: Callable[[Any, LoraWeights, Any], Any], who: str) -> Any:
    """``block(float_params, *args)`` with each dropping adapter's input dropped.

    ``params`` is one layer's slice; ``adapted(leaf, lw, dtype)`` builds a weight as the
    layer gets it without dropout (a leaf whose node has no keys, or whose rate is 0).

    Raises:
      ValueError: an adapted weight that drops used other than in a matrix product (after
        casts, transposes, reshapes, slices), or returned; or JAX changed so that its
        jaxprs can no longer be evaluated here (:mod:`stackwise._upstream.jax`).
    """
    if not jax_ties.holds(jax_ties.EVAL_LOOP):
        raise RuntimeError(
            f"{who}: LoRA dropout evaluates the layer's jaxpr (stackwise/_upstream/jax.py), "
            f"which no longer matches jax {jax.__version__}; train with the adapters' "
            "`dropout` 0, or with the jax release stackwise mirrors "
            f"({jax_ties.MIRRORS})."
        )
    tracked: dict = {}  # id(the weight as the layer sees it) -> _Weight

    def weights(where: str, node: Any) -> Any:
        if not isinstance(node, Adapted):
            return dequantize(node, dtype) if is_quantized(node) else node
        treedef = jax.tree.structure(node.base, is_leaf=is_quantized)
        subs = treedef.flatten_up_to(node.adapters)
        out = []
        for j, ((path, leaf), lw) in enumerate(zip(leaf_paths(node.base, is_leaf=is_quantized),
                                                   subs)):
            if lw is None:
                out.append(dequantize(leaf, dtype))
            elif node.keys is None or not lw.dropout:
                out.append(adapted(leaf, guard(lw, joined(where, path), who), dtype))
            else:
                w = dequantize(leaf)
                value = w if dtype is None else w.astype(dtype)
                tracked[id(value)] = _Weight(value, w, lw, (), jax.random.fold_in(node.keys, j),
                                             joined(where, path))
                out.append(value)
        return jax.tree.unflatten(treedef, out)

    float_params = jax.tree_util.tree_map_with_path(
        lambda p, v: weights(jax.tree_util.keystr(p), v), params, is_leaf=_is_node)
    leaves, treedef = jax.tree.flatten(float_params)
    closed, shape = jax.make_jaxpr(
        lambda *ls: block(jax.tree.unflatten(treedef, ls), *args), return_shape=True)(
        *[jax.ShapeDtypeStruct(jnp.shape(v), jnp.result_type(v)) for v in leaves])
    uses: dict = {}
    outs = jax_ties.eval_jaxpr(
        closed.jaxpr, closed.consts, leaves,
        inline=lambda ins: any(id(v) in tracked for v in ins),
        observe=lambda *_: None,
        instead=lambda name, ins, eqn: _step(name, ins, eqn, tracked, uses, who),
        with_params=True)
    for v in outs:
        if id(v) in tracked:
            raise _refuse(tracked[id(v)].path, "returns it", who)
    return jax.tree.unflatten(jax.tree.structure(shape), outs)


def _refuse(path: str, how: str, who: str) -> ValueError:
    return ValueError(
        f"{who}: with LoRA dropout each adapter's term is added at the layer's products with "
        f"its weight, on the product's dropped input, so the layer may use adapted weight "
        f"{path} only in matrix products (`x @ w`, `jnp.dot`, `jnp.einsum`, "
        "`lax.dot_general`; after casts, transposes, reshapes or slices of it); it "
        f"{how}. Train these adapters with `dropout=0.0`, or attach them without `key` "
        "where they run without training."
    )


def _step(name: str, ins: list, eqn: Any, tracked: dict, uses: dict, who: str) -> list | None:
    """An equation's outputs where a dropping adapter's weight flows in; None elsewhere (it
    is bound as it is)."""
    hit = [k for k, v in enumerate(ins) if id(v) in tracked]
    if not hit:
        return None
    weight = tracked[id(ins[hit[0]])]
    if name in STRUCTURAL and hit == [0]:
        out = jax_ties.bind(eqn, ins)[0]
        tracked[id(out)] = weight._replace(value=out, ops=(*weight.ops, (eqn, ins)))
        return [out]
    if name == "dot_general" and len(hit) == 1:
        u = uses.get(weight.path, 0)
        uses[weight.path] = u + 1
        return [_product(eqn, ins, hit[0], weight, jax.random.fold_in(weight.key, u))]
    what = "itself" if len(hit) > 1 else f"`{name}`"
    raise _refuse(weight.path, f"uses it in {what}" if name != "dot_general" else
                  "multiplies it by itself", who)


def _low_rank(weight: _Weight, eqn: Any, side: int) -> bool:
    """Whether the product takes the adapter's two factors (plain LoRA, a 2-D weight only
    cast or transposed, one axis contracted, no batch axes); else its update ``D``."""
    (contract, batch) = eqn.params["dimension_numbers"]
    return (not weight.lw.dora and jnp.ndim(weight.value) == 2 and len(contract[side]) == 1
            and not any(batch) and all(e.primitive.name in ("convert_element_type", "transpose")
                                       for e, _ in weight.ops))


def _product(eqn: Any, ins: list, side: int, weight: _Weight, key: jax.Array) -> Any:
    """``v @ W`` as the layer asked, plus the adapter's term on ``dropout(v)``."""
    out = jax_ties.bind(eqn, ins)[0]
    lw, v = weight.lw, ins[1 - side]
    (contract, _) = eqn.params["dimension_numbers"]
    precision = eqn.params.get("precision")
    if _low_rank(weight, eqn, side):
        kind = lw.a.dtype  # PEFT casts the input to the adapters' dtype
        dropped = drop(v.astype(kind), key, lw.dropout)
        flipped = sum(e.primitive.name == "transpose" and tuple(e.params["permutation"]) == (1, 0)
                      for e, _ in weight.ops) % 2
        # The weight's contracted axis, in the adapter's (in, out) terms: `near` holds it
        # (contracted, r), `far` the rest (r, free).
        a, b = lw.a.astype(kind), lw.b.astype(kind)
        near, far = (a, b) if (contract[side][0] ^ flipped) == 0 else (b.T, a.T)
        v_axes = tuple(contract[1 - side])
        if side == 1:  # v @ W: (v's free axes..., W's free axis)
            t = jax.lax.dot_general(dropped, near, ((v_axes, (0,)), ((), ())),
                                    precision=precision)
            low = jax.lax.dot_general(t, far, (((t.ndim - 1,), (0,)), ((), ())),
                                      precision=precision)
        else:  # W @ v: (W's free axis, v's free axes...)
            t = jax.lax.dot_general(near, dropped, (((0,), v_axes), ((), ())),
                                    precision=precision)
            low = jax.lax.dot_general(far, t, (((0,), (0,)), ((), ())), precision=precision)
        low = low * jnp.asarray(lw.scale, low.dtype)
    else:
        d = _update(weight)
        for e, e_ins in weight.ops:  # the layer's moves of W, made on D
            if e.primitive.name != "convert_element_type":
                d = jax_ties.bind(e, [d, *e_ins[1:]])[0]
        dropped = drop(v.astype(d.dtype), key, lw.dropout)
        low = jax.lax.dot_general(*((dropped, d) if side == 1 else (d, dropped)),
                                  eqn.params["dimension_numbers"], precision=precision)
    common = jnp.promote_types(out.dtype, low.dtype)
    return (out.astype(common) + low.astype(common)).astype(out.dtype)


def _update(weight: _Weight) -> jax.Array:
    """The adapter's update of the float base ``W`` as a weight, ``(in, out)``: ``scale *
    a @ b``, or DoRA's ``V * m / |V| - W`` (``V = W + scale * a @ b``), in the adapters'
    and the base's common dtype."""
    lw, w = weight.lw, weight.w
    kind = jnp.promote_types(lw.a.dtype, w.dtype)
    d = scaled_update(lw.a.astype(kind), lw.b.astype(kind), lw.scale)
    if not lw.dora:
        return d
    w = w.astype(kind)
    return dora_scaled(add(w, d), lw.magnitude) - w
