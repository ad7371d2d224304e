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
from stackwise._finetune import dropout, rows
from stackwise._finetune.lora import Adapted, LoraWeights, add, dora_scaled, scaled_update
from stackwise._finetune.quant import compute_dtype, dequantize, is_quantized
from stackwise._finetune.targets import leaf_paths
from stackwise._upstream import jax as jax_ties

__all__ = ["materialise", "run_layer", "stack_adapted", "wrap"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def adapted_weight(w: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """One layer's ``w + scale * a @ b`` in ``w``'s dtype (see :func:`lora.add`);
    ``scale`` is the adapter's (``LoraWeights.scale``: ``alpha / r``, or rsLoRA's)."""
    return add(w, scaled_update(a, b, scale))


def _adapted_fwd(w, a, b, scale):
    return adapted_weight(w, a, b, scale), (a, b, jnp.zeros((0,), w.dtype))


def _adapted_bwd(scale, res, g):
    a, b, w_kind = res
    scale = jnp.asarray(scale, a.dtype)
    g_low = g.astype(a.dtype)
    g_a = jnp.matmul(g_low, jnp.swapaxes(b, -1, -2)) * scale
    g_b = jnp.matmul(jnp.swapaxes(a, -1, -2), g_low) * scale
    return g.astype(w_kind.dtype), g_a, g_b


adapted_weight.defvjp(_adapted_fwd, _adapted_bwd)


def is_node(value: Any) -> bool:
    """An :class:`Adapted` or :class:`Quantized` node: one layer's weight once materialised."""
    return isinstance(value, Adapted) or is_quantized(value)


def adapted_leaf(leaf: Any, lw: LoraWeights, dtype: Any = None) -> jax.Array:
    """One layer's adapted weight from its base leaf (float or quantized): ``dequantize(W) +
    scale * a @ b`` (DoRA's rescaled), in ``dtype`` if given."""
    w = adapted_weight(dequantize(leaf), lw.a, lw.b, lw.scale)
    if lw.dora:
        w = dora_scaled(w, lw.magnitude)
    return w if dtype is None else w.astype(dtype)


def _layer_weights(base: Any, adapters: Any, dtype: Any = None, where: str = "",
                   who: str = "stackwise.lora.wrap") -> Any:
    """One layer's float params: each leaf dequantized, then adapted where it has one; with
    ``dtype``, each quantized or adapted weight in it. An adapter with a dropout rate refuses
    to be differentiated (here it has no key: :func:`dropout.guard`)."""
    treedef = jax.tree.structure(base, is_leaf=is_quantized)
    subs = treedef.flatten_up_to(adapters)
    out = []
    for (path, leaf), lw in zip(leaf_paths(base, is_leaf=is_quantized), subs):
        out.append(dequantize(leaf, dtype) if lw is None else
                   adapted_leaf(leaf, dropout.guard(lw, dropout.joined(where, path), who), dtype))
    return jax.tree.unflatten(treedef, out)


def materialise(params: Any, dtype: Any = None, who: str = "stackwise.lora.wrap") -> Any:
    """One layer's params as its ``apply`` expects them: floats, adapters merged in.

    Params without an adapted or quantized node come back as they are (the same object).
    With ``dtype`` (checked by the caller), every dequantized or adapted weight is in it.
    """
    if not any(is_node(v) for v in jax.tree.leaves(params, is_leaf=is_node)):
        return params
    return jax.tree_util.tree_map_with_path(
        lambda p, v: _layer_weights(v.base, v.adapters, dtype, jax.tree_util.keystr(p), who)
        if isinstance(v, Adapted) else dequantize(v, dtype) if is_quantized(v) else v,
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


def _check_rows(x: Any, groups: int, who: str) -> None:
    """Every leaf of ``x`` has the batch's g on its leading axis."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(x):
        shape = tuple(jnp.shape(leaf))
        if not shape or shape[0] != groups:
            raise ValueError(
                f"{who}: the params hold a batch of {groups} adapters "
                "(`stackwise.lora.stack_adapters`), which runs group j of `x` (its leading "
                f"axis) with adapter j, but `x`{jax.tree_util.keystr(path)} has shape "
                f"{shape}. Give `x` with g={groups} first (rows grouped in order: "
                f"`x.reshape({groups}, -1, *x.shape[1:])`), or attach one adapter "
                "(`jax.tree.map(lambda v: v[j], batch)` takes adapter j)."
            )


def _refuse_kept(path: str, groups: int, who: str) -> ValueError:
    return ValueError(
        f"{who}: with a batch of {groups} adapters the layer's new state{path} comes out "
        "different for each group: it is updated from a group's rows (batch statistics, "
        "a KV cache, sown intermediates), and a layer holds one state for all groups. For "
        "a KV cache, pick an adapter per row instead: `stackwise.lora.attach(base, batch, "
        "rows=rows)` with `rows` an int array (batch,) and the cache per row. Else run "
        "without updating it (e.g. `use_running_average=True`, no mutable collections), "
        "run the adapters one at a time (`jax.tree.map(lambda v: v[j], batch)` takes "
        "adapter j), or merge each into a base (`stackwise.lora.merge`)."
    )


def run_layer(block: Callable[..., Any], params: Any, x: Any, *args: Any, who: str,
              dtype: Any = None) -> Any:
    """``(out, kept) = block(float_params, x, *args)`` on one layer's adapted params.

    ``params`` is the layer's slice (:class:`Adapted` and quantized nodes anywhere in it);
    ``block`` gets it as float weights (:func:`materialise`). With a batch of g adapters
    (:func:`stackwise.lora.stack_adapters`), ``block`` runs under ``jax.vmap`` over the
    groups: the adapters' ``a`` and ``b`` and ``x``'s leaves on their leading axis, the
    base, the rest of ``params`` and ``args`` unbatched, so the base is shared, never
    copied per group (each group builds its own adapted weight); ``out`` has g leading.
    ``kept`` (the layer's new state) is the one value every group gives: state that a
    group updates from its own rows is refused. Random keys in ``params`` or ``args``
    reach every group alike. With adapters attached with ``rows``
    (:func:`stackwise.lora.attach`), row i of ``x`` runs with adapter ``rows[i]``
    (:mod:`.rows`), and ``kept`` is refused where it differs by row. With dropout keys
    (``attach(..., key=)``), ``block`` gets the float base where an adapter drops its input,
    and each of its products with that weight gets the adapter's term on the product's
    dropped input (:mod:`.dropout`).

    Raises:
      ValueError: adapters of two batch sizes in one layer, ``x`` without g (or the
        rows) on every leaf's leading axis, or a ``kept`` leaf that differs by group (or
        row).
    """
    if rows.has_rows(params):
        return rows.run(lambda p, x, _: block(p, x, *args), params, x, (), who, shared=True)
    groups = _groups(params, who)
    if dropout.has_keys(params):  # training with LoRA dropout: the term added at each product
        def call(p, x):
            return dropout.run(block, p, (x, *args), dtype=dtype, adapted=adapted_leaf, who=who)
    else:
        def call(p, x):
            return block(materialise(p, dtype, who), x, *args)
    if groups is None:
        return call(params, x)
    _check_rows(x, groups, who)
    axes = jax.tree.map(
        lambda v: Adapted(None, 0, v.groups, None, None) if isinstance(v, Adapted) else None,
        params, is_leaf=is_node,
    )
    each = jax.vmap(call, in_axes=(axes, 0), out_axes=(0, None))
    try:
        return each(params, x)
    except ValueError as e:
        path = jax_ties.unbatched_output_path(e)
        if path is None or not path.startswith("[1]"):
            raise
        raise _refuse_kept(path[3:], groups, who) from None


def wrap(apply: Callable[..., Any], *, with_state: bool = False,
         dtype: Any = None) -> Callable[..., Any]:
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
    group whole; a ``has_aux`` aux gains g after the layer axis). Each layer then builds g
    adapted weights at a time from one base.

    >>> other = jax.tree.map(lambda v: -v, adapters)
    >>> batch = stackwise.lora.stack_adapters([adapters, other])
    >>> out = layers.apply(stackwise.lora.attach(base, batch), jnp.stack([x, x]))
    >>> alone = layers.apply(stackwise.lora.attach(base, other), x)
    >>> out.shape, bool(jnp.allclose(out[1], alone, atol=1e-6))
    ((2, 2, 4), True)

    With ``attach(base, batch, rows=rows)`` row i of ``x`` runs with adapter ``rows[i]``
    (-1: the base alone), each adapted weight used as ``x @ W + scale * (x @ a) @ b`` per
    row (no per-row weight is built: the layer must use adapted weights in matrix products
    only), and the state is per row: every state leaf has the batch first (a KV cache),
    so a decode step runs with the cache donated and written in place.

    >>> with jax.default_matmul_precision("highest"):  # float32 products on any backend
    ...     y = layers.apply(stackwise.lora.attach(base, batch, rows=[1, -1]), x)
    ...     alone = layers.apply(stackwise.lora.attach(base, other), x)
    >>> bool(jnp.allclose(y[0], alone[0], atol=1e-6))
    True

    (Compared at ``'highest'``: at a TPU's default bfloat16 products, a row's ``x @ W +
    scale * (x @ a) @ b`` and the attached ``x @ (W + scale * a @ b)`` round apart.)

    Adapters with a ``dropout`` rate attached with a key (``attach(..., key=)``, a new one
    each training step) drop their input as PEFT does while it trains: each product ``x @ W``
    of an adapted weight becomes ``x @ W + scale * (dropout(x) @ a) @ b``
    (:mod:`stackwise._finetune.dropout`; the layer must use the weight in products only).
    Without a key they run as above, and differentiating them is refused.

    With ``dtype=jnp.bfloat16`` (QLoRA's compute dtype) each quantized or adapted weight
    reaches ``apply`` in bfloat16: dequantized and adapted in float32 (``dequantize(W) +
    scale * a @ b``, the update in the adapters' dtype), rounded to bfloat16 once. Give
    ``x`` in bfloat16 too, and the layer's matmul runs in bfloat16:

    >>> bf16 = stackwise.stack(None, stackwise.lora.wrap(apply, dtype=jnp.bfloat16), 3)
    >>> bf16.apply(stackwise.lora.attach(base, adapters), x.astype(jnp.bfloat16)).dtype
    dtype(bfloat16)

    Args:
      apply: ``apply(layer_params, x, *args, **kwargs)`` of one layer (with
        ``with_state``: ``apply(layer_params, state, x, ...)``).
      with_state: the layer takes and returns state (as ``stackwise.stack``'s flag). With
        a batch, the state is one for all groups: a layer that updates it from a group's
        rows is refused (one that leaves it, or updates it alike for every group, runs).
        With ``rows``, the state is per row (its leaves have the batch first).
      dtype: None (each weight in the dtype its base was quantized from, or its float
        base leaf's), or a float dtype every quantized or adapted weight is given to
        ``apply`` in (other leaves as they are). The gradients of float32 adapters stay
        float32 (the weight's cotangent is cast to the adapters' dtype).

    Raises:
      TypeError: ``apply`` is not callable, or ``dtype`` is not a dtype.
      ValueError: ``dtype`` is not a float dtype.
      ValueError (when the layer runs): attached adapters of two batch sizes in one
        layer; ``dtype`` with ``rows``; with a batch, ``x`` without g on its leading
        axis, or state that differs by group; with ``rows``, ``x`` or the state without
        the rows on their leading axis, or an adapted weight used other than in a matrix
        product (so too for an adapter that drops its input, with a key); adapters with a
        dropout rate differentiated without a key.
    """
    who = "stackwise.lora.wrap"
    if not callable(apply):
        raise TypeError(f"{who}: `apply` must be a layer's apply function, got "
                        f"{type(apply).__name__}.")
    if dtype is not None:
        dtype = compute_dtype(dtype, who)

    def wrapped(params, *args, **kwargs):
        if rows.has_rows(params):  # a batch whose rows each pick an adapter
            if dtype is not None:
                raise ValueError(
                    f"{who}: `dtype={jnp.dtype(dtype).name}` gives `apply` each adapted weight "
                    "merged and cast, but `attach(..., rows=)` never builds a weight per row "
                    "(each row's low-rank term is added beside the base product); leave "
                    "`dtype` None for multi-LoRA rows and cast `x` yourself."
                )
            if with_state:
                state, x, *rest = args
                return rows.run(lambda p, x, s: apply(p, s, x, *rest, **kwargs),
                                params, x, state, who)
            x, *rest = args
            return rows.run(lambda p, x, s: (apply(p, x, *rest, **kwargs), ()),
                            params, x, (), who)[0]
        if with_state:
            state, x, *rest = args
            out, state = run_layer(lambda p, x, s: apply(p, s, x, *rest, **kwargs),
                                   params, x, state, who=who, dtype=dtype)
            return out, state
        x, *rest = args
        return run_layer(lambda p, x: (apply(p, x, *rest, **kwargs), ()), params, x, who=who,
                         dtype=dtype)[0]

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
            f"{who}: remat=False with a quantized base can keep every "
            f"layer's dequantized weights for the backward pass when differentiated: "
            f"{held / 2**20:.1f} MiB ({held} bytes), as much as the float model (XLA:CPU "
            "keeps them; XLA:TPU can fuse the dequantization into each dot and keep none: "
            "compare the compiled gradient's memory_analysis()). "
            "Keep the default remat (or any policy) to hold one layer at a time; "
            "without gradients (decoding) remat changes nothing, so keep it there too.",
            stacklevel=stacklevel,
        )


def stack_adapted(
    apply: Callable[..., Any] | Sequence[Callable[..., Any]],
    n: int,
    *,
    dtype: Any = None,
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
      dtype: the compute dtype of the quantized and adapted weights, as :func:`wrap` takes
        it (``jnp.bfloat16``: QLoRA's).
      **options: ``stackwise.stack``'s options (``remat``, ``unroll``, ``with_state``, ...).

    Returns:
      A :class:`stackwise.Stacked` without ``init`` (the params come from the base).
    """
    with_state = options.get("with_state", False)
    if callable(apply):
        applies: Any = wrap(apply, with_state=with_state, dtype=dtype)
    else:
        applies = [wrap(f, with_state=with_state, dtype=dtype) for f in apply]
    inits = None if callable(apply) else [None] * len(applies)
    layers = stack(inits, applies, n, **options)
    remat = options.get("remat", DEFAULT_REMAT)

    def checked_apply(*args, **kwargs):
        warn_unrematted(args[0], remat, "stackwise.lora.stack")
        return layers.apply(*args, **kwargs)

    return Stacked(layers.init, checked_apply, n, layers.decode)

