"""The qwix bridge for linen: ``qwix.quantize_params`` for params that a Stack holds stacked.

qwix quantizes a weight as the shape it is given; a stacked ``(n, in, out)`` kernel would
get scales that span the layer axis. :func:`quantize_params` quantizes every stacked
weight one layer at a time (with ``stackwise._kit.map_layers``), so each layer gets the
scales its own block gets in a loop; with ``quant_stats`` (static-range quantization) each
layer's static activation scales come from that layer's own statistics
(``stackwise._kit.map_stats``). qwix is imported when it is called, never before.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
from flax import traverse_util

from stackwise import _kit
from stackwise.flax._convert import refuse_served

__all__ = ["quantize_params"]

_WHO = "stackwise.flax.quantize_params"


def _lookup(tree: Any, path: tuple) -> Any:
    for key in path:
        if not hasattr(tree, "get"):
            return None
        tree = tree.get(key)
    return tree


def quantize_params(
    params: Any,
    abstract_quantized_params: Any,
    quant_stats: Any = None,
    *,
    allow_extra_params: bool = False,
) -> dict:
    """``qwix.quantize_params`` for a linen model with :class:`Stack` s: per layer.

    Quantizes float params for a qwix PTQ (or QLoRA) model as ``qwix.quantize_params``
    does, except that a weight a Stack holds stacked is quantized one layer at a time:
    its scales are per layer (``(n, 1, out)``), as each block of a loop would get them.
    Which leaves are stacked, and how deep, is read from the shapes in
    ``abstract_quantized_params``; leaves outside any Stack are quantized as qwix does.

    >>> import jax, jax.numpy as jnp, flax.linen as nn, qwix, stackwise.flax
    >>> stack = stackwise.flax.Stack(nn.Dense(8), n=3)
    >>> x = jnp.ones((2, 8))
    >>> floats = stack.init(jax.random.key(0), x)["params"]
    >>> ptq = qwix.quantize_model(stack, qwix.PtqProvider(
    ...     [qwix.QtRule(module_path=".*", weight_qtype="int8")]))
    >>> abstract = jax.eval_shape(ptq.init, jax.random.key(0), x)["params"]
    >>> quantized = stackwise.flax.quantize_params(floats, abstract)
    >>> quantized["kernel"].array.qvalue.shape, quantized["kernel"].array.scale.shape
    ((3, 8, 8), (3, 1, 8))
    >>> ptq.apply({"params": quantized}, x).shape
    (2, 8)

    Static-range quantization (SRQ): the QAT model's calibration statistics, which a Stack
    holds stacked (one per layer), become each layer's static activation scale:

    >>> rule = qwix.QtRule(module_path=".*", weight_qtype="int8", act_qtype="int8",
    ...                    act_static_scale=True)
    >>> qat = qwix.quantize_model(stack, qwix.QtProvider([rule]))
    >>> stats = qat.init(jax.random.key(0), x)["quant_stats"]
    >>> for batch in (x, 2 * x):                                   # calibration
    ...     _, new = qat.apply({"params": floats, "quant_stats": stats}, batch,
    ...                        mutable=["quant_stats"])
    ...     stats = new["quant_stats"]
    >>> stats["dot_general0_lhs"]["count"]
    Array([2, 2, 2], dtype=int32)
    >>> srq = qwix.quantize_model(stack, qwix.PtqProvider([rule]))
    >>> abstract = jax.eval_shape(srq.init, jax.random.key(0), x)["params"]
    >>> quantized = stackwise.flax.quantize_params(floats, abstract, stats)
    >>> quantized["dot_general0_lhs_scale"].array.shape               # one per layer
    (3, 1, 1)
    >>> srq.apply({"params": quantized}, x).shape
    (2, 8)

    Args:
      params: the float params (unboxed or boxed), e.g. ``variables["params"]`` of the float
        model.
      abstract_quantized_params: the quantized model's params, abstract or not, e.g.
        ``jax.eval_shape(qmodel.init, key, x)["params"]``.
      quant_stats: for SRQ, the QAT model's ``variables["quant_stats"]`` after calibration
        (stacked per layer inside a Stack): each activation's static scale is computed by
        qwix from each layer's own statistics, as its block's in a loop. On the CPU,
        applying SRQ inside a Stack needs jaxlib >= 0.10.2 (0.10.0's XLA:CPU fails to
        compile qwix's SRQ dot inside any ``lax.scan`` for some shapes).
      allow_extra_params: skip params that the quantized model does not have, as qwix's.

    Returns:
      The params with every weight qwix quantizes replaced by its quantized form
      (stacked weights quantized per layer), the rest unchanged.

    Raises:
      TypeError: ``params`` or ``quant_stats`` in the serving layout (quantize the stacked
        params, then serve them: :func:`stackwise.flax.to_serving`).
      ValueError: a param is not in ``abstract_quantized_params`` (unless
        ``allow_extra_params``), or does not quantize to the shapes given there with 0, 1
        or 2 leading layer axes (params of another model or depth); a ``quant_stats``
        entry is not qwix's statistics, holds an uncalibrated layer (count 0), has no
        static scale in ``abstract_quantized_params`` or is of another depth.
    """
    import qwix  # only now: qwix stays optional

    refuse_served(params, _WHO, "params")
    refuse_served(quant_stats, _WHO, "quant_stats")

    abstract = nn.meta.unbox(abstract_quantized_params)
    out = _kit.map_params(
        traverse_util.flatten_dict(nn.meta.unbox(params)),
        lambda path: _lookup(abstract, path),
        lambda w, a: qwix.quantize_params({"w": w}, {"w": a})["w"],
        _WHO, sep="/", where="`abstract_quantized_params`", allow_extra=allow_extra_params,
    )
    if quant_stats:
        out |= _kit.map_stats(
            traverse_util.flatten_dict(nn.meta.unbox(quant_stats)),
            lambda path: _lookup(abstract, path), qwix.quantize_params,
            _WHO, sep="/", where="`abstract_quantized_params`",
        )
    return traverse_util.unflatten_dict(out)
