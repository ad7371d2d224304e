"""Adapters merged into their base, and taken back out: :func:`stackwise.lora.merge` and
:func:`stackwise.lora.unmerge` (a quantized base is quantized again, layer by layer)."""

from __future__ import annotations

from typing import Any

import jax

from stackwise._core.served import stacked_only
from stackwise._finetune.lora import (
    LoraWeights,
    add,
    check_shapes,
    delta,
    dora_scaled,
    pairs,
    scaled_update,
)
from stackwise._finetune.quant import is_quantized, requantize

__all__ = ["merge", "unmerge"]


def _merged_layer(w: jax.Array, layer: tuple, lw: LoraWeights) -> jax.Array:
    """One layer's merged weight from its float weight and its ``(a, b, magnitude)``."""
    a, b, magnitude = layer
    merged = add(w, scaled_update(a, b, lw.scale))
    return dora_scaled(merged, magnitude) if lw.dora else merged


def _merged(base: Any, adapters: Any, sign: int, who: str) -> Any:
    stacked_only(who, base=base, adapters=adapters)
    out = []
    for path, leaf, lw in pairs(base, adapters, who):
        if lw is None:
            out.append(leaf)
            continue
        if check_shapes(path, leaf, lw, who) is not None:
            raise ValueError(
                f"{who}: adapter {path} is a batch of {lw.a.shape[0]} adapters; merge one of "
                "them: `jax.tree.map(lambda v: v[j], adapters)` takes adapter j."
            )
        if is_quantized(leaf) and sign < 0:
            raise ValueError(
                f"{who}: base leaf {path} is quantized ({leaf.kind}); `merge` quantized it "
                "again with the update in, so taking the update out would round a second "
                "time and never give the base's codes back. Keep the quantized base (merge "
                "returns a new tree, the base is unchanged), or unmerge from float weights "
                "(`stackwise.lora.merge(stackwise.quant.dequantize(base), adapters)`)."
            )
        if lw.dora and sign < 0:
            raise ValueError(
                f"{who}: adapter {path} is DoRA's: its merged weight is rescaled by the "
                "adapted weight's own column norms, which the merged weight no longer holds, "
                "so the base cannot be taken back out of it. Keep the base (merge returns a "
                "new tree, the base is unchanged)."
            )
        if is_quantized(leaf):
            out.append(requantize(leaf, lambda w, ad, lw=lw: _merged_layer(w, ad, lw),
                                  (lw.a, lw.b, lw.magnitude)))
            continue
        merged = add(leaf, delta(lw), sign)
        out.append(dora_scaled(merged, lw.magnitude) if lw.dora else merged)
    return jax.tree.unflatten(jax.tree.structure(base, is_leaf=is_quantized), out)


def merge(base: Any, adapters: Any) -> Any:
    """The base with each adapter merged in: ``W + scale * a @ b``, layer by layer.

    The result runs without adapters (serving). Each merged layer is bitwise the weight a
    wrapped layer computes for itself from the same base and adapters (the same sum in the
    same dtype; for DoRA, rescaled the same way).

    >>> import jax, jax.numpy as jnp, stackwise
    >>> base = {"w": jnp.ones((3, 4, 4))}
    >>> adapters = stackwise.lora.init(jax.random.key(0), base, rank=2)
    >>> adapters = jax.tree.map(lambda v: v + 0.5, adapters)   # as if trained
    >>> merged = stackwise.lora.merge(base, adapters)
    >>> back = stackwise.lora.unmerge(merged, adapters)
    >>> bool(jnp.allclose(back["w"], base["w"], rtol=0, atol=1e-6))
    True

    Into a quantized leaf (:func:`stackwise.quant.quantize`), for serving a QLoRA model:
    each layer is dequantized, merged (the float weight above, in the dtype the leaf was
    quantized from) and quantized again alike (kind, block size, double quantization),
    one layer at a time. Each weight of the result dequantizes to within half a step of
    the merged float weight ``dequantize(W) + scale * a @ b``: per block, ``g * s' / 2``,
    ``s'`` the block's new scale (its absmax, divided by 127 for int8 and 7 for int4) and
    ``g`` the widest gap between neighbouring levels (1 for int8 and int4; nf4 is not
    uniform, its widest gap is -1 .. -0.6962, ``g = 0.3038``); double-quantized, plus
    ``c * s' * (exp(step / 2) - 1)`` (``step`` the block of scales' second-level step,
    ``c`` the largest level: 127, 7, 1), as :func:`stackwise.quant.quantize` states.

    >>> qbase = stackwise.quant.quantize(base, "nf4")
    >>> qmerged = stackwise.lora.merge(qbase, adapters)
    >>> qmerged["w"].kind, qmerged["w"].codes.shape == qbase["w"].codes.shape
    ('nf4', True)
    >>> want = stackwise.quant.dequantize(qbase["w"]) + adapters["w"].a @ adapters["w"].b
    >>> err = jnp.abs(stackwise.quant.dequantize(qmerged["w"]) - want)
    >>> bool((err <= 0.3038 * qmerged["w"].scale / 2 + 1e-6).all())
    True

    Raises:
      ValueError: the adapters do not fit the base (see :func:`attach`), or are a batch.
    """
    return _merged(base, adapters, 1, "stackwise.lora.merge")


def unmerge(merged: Any, adapters: Any) -> Any:
    """The base back from :func:`merge`'s result: ``W' - scale * a @ b``.

    Exact when the update is zero; otherwise each element is within
    ``eps * (|W| + |d|) * (1 + eps)`` of the original, ``d`` being the update and ``eps``
    the base dtype's machine epsilon (two roundings, one in :func:`merge`, one here).

    Raises:
      ValueError: as :func:`merge`, a DoRA adapter (its merged weight is rescaled by
        norms it no longer holds: keep the base instead), or a quantized leaf (merge
        requantized it: the base's codes cannot be had back).
    """
    return _merged(merged, adapters, -1, "stackwise.lora.unmerge")
