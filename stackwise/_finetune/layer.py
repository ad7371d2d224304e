"""A layer's ``apply`` run on adapted and quantized params, one layer at a time.

Inside the scan each layer gets its own slice of the base, the adapters and the quantized
codes; :func:`wrap` turns the slice into the float weights the layer expects (dequantized,
``W + scale * a @ b``) and calls the layer. The adapted weight is one ``jax.custom_vjp``
whose only residuals are ``a`` and ``b``: no remat policy (the default one saves matmul
outputs) keeps a layer's ``a @ b`` or its adapted weight for the backward pass.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from stackwise._core.stack import DEFAULT_REMAT, Stacked, stack
from stackwise._finetune.lora import Adapted, LoraWeights, add, delta
from stackwise._finetune.quant import dequantize, is_quantized

__all__ = ["stack_adapted", "wrap"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def adapted_weight(w: jax.Array, a: jax.Array, b: jax.Array, alpha: float) -> jax.Array:
    """One layer's ``w + (alpha / r) * a @ b`` in ``w``'s dtype (see :func:`lora.add`)."""
    return add(w, delta(LoraWeights(a, b, alpha)))


def _adapted_fwd(w, a, b, alpha):
    return adapted_weight(w, a, b, alpha), (a, b, jnp.zeros((0,), w.dtype))


def _adapted_bwd(alpha, res, g):
    a, b, w_kind = res
    scale = jnp.asarray(alpha / a.shape[-1], a.dtype)
    g_low = g.astype(a.dtype)
    g_a = jnp.matmul(g_low, jnp.swapaxes(b, -1, -2)) * scale
    g_b = jnp.matmul(jnp.swapaxes(a, -1, -2), g_low) * scale
    return g.astype(w_kind.dtype), g_a, g_b


adapted_weight.defvjp(_adapted_fwd, _adapted_bwd)


def is_node(value: Any) -> bool:
    """An :class:`Adapted` or :class:`Quantized` node: one layer's weight once materialised."""
    return isinstance(value, Adapted) or is_quantized(value)


def _layer_weights(base: Any, adapters: Any) -> Any:
    """One layer's float params: each leaf dequantized, then adapted where it has one."""
    treedef = jax.tree.structure(base, is_leaf=is_quantized)
    subs = treedef.flatten_up_to(adapters)
    out = []
    for leaf, lw in zip(jax.tree.leaves(base, is_leaf=is_quantized), subs):
        w = dequantize(leaf)
        out.append(w if lw is None else adapted_weight(w, lw.a, lw.b, lw.alpha))
    return jax.tree.unflatten(treedef, out)


def materialise(params: Any) -> Any:
    """One layer's params as its ``apply`` expects them: floats, adapters merged in."""
    return jax.tree.map(
        lambda v: _layer_weights(v.base, v.adapters) if isinstance(v, Adapted)
        else dequantize(v) if is_quantized(v) else v,
        params,
        is_leaf=is_node,
    )


def _groups(params: Any, who: str) -> int | None:
    found = {v.groups for v in jax.tree.leaves(params, is_leaf=is_node)
             if isinstance(v, Adapted)}
    if len(found) > 1:
        raise ValueError(
            f"{who}: the layer's params hold attached adapters of batch sizes "
            f"{sorted(found, key=str)} (None: one adapter); every `stackwise.lora.attach` "
            "in one layer needs the same batch of adapters."
        )
    return found.pop() if found else None


def wrap(apply: Callable[..., Any], *, with_state: bool = False) -> Callable[..., Any]:
    """A layer's ``apply`` that takes adapted and quantized params, for ``stackwise.stack``.

    The wrapped layer gets its own slice of the params (:func:`stackwise.lora.attach`'s
    base and adapters, :class:`stackwise.quant.Quantized` codes) and calls ``apply`` with
    float weights: ``dequantize(W) + scale * a @ b`` per target, one layer at a time. Use
    it in ``stackwise.stack(None, wrap(apply), n, ...)`` with any remat, unroll, pattern
    (wrap each position's apply) or state; :func:`stackwise.lora.stack` does that and
    warns about ``remat=False`` on a quantized base.

    The loop it replaces, then the stacked call:

    >>> import jax, jax.numpy as jnp, stackwise
    >>> apply = lambda p, x: jnp.tanh(x @ p["w"])
    >>> base = {"w": jax.random.normal(jax.random.key(0), (3, 4, 4))}
    >>> adapters = stackwise.lora.init(jax.random.key(1), base, rank=2)
    >>> adapters = jax.tree.map(lambda v: v + 0.1, adapters)      # as if trained
    >>> x = y = jnp.ones((2, 4))
    >>> for i in range(3):
    ...     a, b = adapters["w"].a[i], adapters["w"].b[i]
    ...     y = apply({"w": base["w"][i] + a @ b}, y)
    >>> layers = stackwise.stack(None, stackwise.lora.wrap(apply), 3)
    >>> out = layers.apply(stackwise.lora.attach(base, adapters), x)
    >>> bool(jnp.allclose(out, y, atol=1e-6))
    True

    A batch of g adapters (:func:`stackwise.lora.stack_adapters`) runs in one call: ``x``
    has g on its leading axis and group j uses adapter j (the other arguments reach every
    group whole). Each layer then builds g adapted weights at a time.

    Args:
      apply: ``apply(layer_params, x, *args, **kwargs)`` of one layer (with
        ``with_state``: ``apply(layer_params, state, x, ...)``).
      with_state: the layer takes and returns state (as ``stackwise.stack``'s flag).

    Raises:
      TypeError: ``apply`` is not callable.
      ValueError (when the layer runs): a batch of adapters with ``with_state``, or
        attached adapters of two batch sizes in one layer.
    """
    who = "stackwise.lora.wrap"
    if not callable(apply):
        raise TypeError(f"{who}: `apply` must be a layer's apply function, got "
                        f"{type(apply).__name__}.")

    def wrapped(params, *args, **kwargs):
        groups = _groups(params, who)
        if groups is None:
            return apply(materialise(params), *args, **kwargs)
        if with_state:
            raise ValueError(
                f"{who}: a batch of {groups} adapters runs each group's layer on its own "
                "rows, which a layer with state (one state for the whole batch) cannot "
                "do; run the adapters one at a time, or merge each into a base "
                "(`stackwise.lora.merge`)."
            )
        x, rest = args[0], args[1:]
        axes = jax.tree.map(
            lambda v: Adapted(None, 0, v.groups) if isinstance(v, Adapted) else None,
            params, is_leaf=is_node,
        )
        return jax.vmap(lambda p, x: apply(materialise(p), x, *rest, **kwargs),
                        in_axes=(axes, 0))(params, x)

    return functools.wraps(apply)(wrapped)


def dequantized_bytes(params: Any) -> int:
    """The bytes of the params' :class:`stackwise.quant.Quantized` weights once dequantized."""
    return sum(v.nbytes_dequantized for v in jax.tree.leaves(params, is_leaf=is_quantized)
               if is_quantized(v))


def warn_unrematted(
    params: Any, remat: Any, who: str, count: Callable[[Any], int] = dequantized_bytes,
    stacklevel: int = 3,
) -> None:
    """Warns when ``remat=False`` would keep every layer's dequantized weights, giving bytes.

    ``count(params)``: the bytes of the params' weights once dequantized (by default those
    of :class:`stackwise.quant.Quantized` nodes; the adapter kit adds qwix's).
    ``stacklevel``: as ``warnings.warn``'s, counted from here (3: the stack's caller).
    """
    if remat is not False:
        return
    held = count(params)
    if held:
        warnings.warn(
            f"{who}: remat=False with a quantized base keeps every "
            f"layer's dequantized weights for the backward pass when differentiated: "
            f"{held / 2**20:.1f} MiB ({held} bytes), as much as the float model. "
            "Keep the default remat (or any policy) to hold one layer at a time; "
            "without gradients (decoding) remat changes nothing, so keep it there too.",
            stacklevel=stacklevel,
        )


def stack_adapted(
    apply: Callable[..., Any] | Sequence[Callable[..., Any]],
    n: int,
    **options: Any,
) -> Stacked:
    """``stackwise.stack(None, wrap(apply), n, **options)``, warning of ``remat=False``.

    A quantized base is small only while each layer dequantizes its own slice and drops
    it; with ``remat=False`` the backward pass keeps every layer's float weights, as
    large as the unquantized model. The stack warns then, giving the bytes.

    >>> import jax, jax.numpy as jnp, stackwise
    >>> base = stackwise.quant.quantize({"w": jnp.ones((3, 4, 4))}, "int8")
    >>> layers = stackwise.lora.stack(lambda p, x: x @ p["w"], 3)
    >>> layers.apply(base, jnp.ones((1, 4)))
    Array([[64., 64., 64., 64.]], dtype=float32)

    Args:
      apply: one layer's apply, or a pattern's applies (each wrapped).
      n: the number of layers.
      **options: ``stackwise.stack``'s options (``remat``, ``unroll``, ``with_state``, ...).

    Returns:
      A :class:`stackwise.Stacked` without ``init`` (the params come from the base).
    """
    with_state = options.get("with_state", False)
    if callable(apply):
        applies: Any = wrap(apply, with_state=with_state)
    else:
        applies = [wrap(f, with_state=with_state) for f in apply]
    inits = None if callable(apply) else [None] * len(applies)
    layers = stack(inits, applies, n, **options)
    remat = options.get("remat", DEFAULT_REMAT)

    def checked_apply(*args, **kwargs):
        warn_unrematted(args[0], remat, "stackwise.lora.stack")
        return layers.apply(*args, **kwargs)

    return Stacked(layers.init, checked_apply, n)

