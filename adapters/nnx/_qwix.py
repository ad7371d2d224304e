"""The qwix bridge for NNX: ``qwix.quantize_params`` for params that a Stack holds stacked.

As the linen bridge (``stackwise.flax.quantize_params``): every stacked weight is
quantized one layer at a time (``stackwise._kit.map_layers``), so each layer gets the
scales its own block gets in a loop; with ``quant_stats`` (static-range quantization) each
layer's static activation scales come from that layer's own statistics. qwix is imported
when it is called, never before.
"""

from __future__ import annotations

from typing import Any

from flax import nnx, traverse_util

from stackwise import _kit
from stackwise.nnx._convert import refuse_served

__all__ = ["quantize_params"]

_WHO = "stackwise.nnx.quantize_params"


def _lookup(node: Any, path: tuple) -> Any:
    for key in path:
        if isinstance(key, int) and isinstance(node, nnx.List):
            node = node[key] if key < len(node) else None
        else:
            node = getattr(node, str(key), None)
        if node is None:
            return None
    return node.get_raw_value() if isinstance(node, nnx.Variable) else node


def quantize_params(
    params: Any,
    abstract_quantized_model: nnx.Module,
    quant_stats: Any = None,
    *,
    allow_extra_params: bool = False,
) -> dict:
    """``qwix.quantize_params`` for an NNX model with :class:`Stack` s: per layer.

    Quantizes the float params of a model for its qwix PTQ (or QLoRA) twin as
    ``qwix.quantize_params`` does, except that a weight a Stack holds stacked is quantized
    one layer at a time: its scales are per layer (``(n, 1, out)``), as each block of a
    loop would get them. Which leaves are stacked is read from the shapes in the quantized
    model (abstract or not); the result goes into it with ``nnx.update``.

    >>> import jax, jax.numpy as jnp, qwix, stackwise.nnx
    >>> from flax import nnx
    >>> make = lambda: stackwise.nnx.Stack(
    ...     lambda rngs: nnx.Linear(8, 8, rngs=rngs), n=3, rngs=nnx.Rngs(0))
    >>> x = jnp.ones((2, 8))
    >>> provider = qwix.PtqProvider([qwix.QtRule(module_path=".*", weight_qtype="int8")])
    >>> abstract = nnx.eval_shape(lambda: qwix.quantize_model(make(), provider, x))
    >>> floats = nnx.to_pure_dict(nnx.state(make(), nnx.Param))
    >>> quantized = stackwise.nnx.quantize_params(floats, abstract)
    >>> quantized["layers"]["kernel"]["array"]["scale"].shape
    (3, 1, 8)

    Static-range quantization (SRQ): the QAT model's calibration statistics, which a Stack
    holds stacked (one per layer), become each layer's static activation scale:

    >>> rule = qwix.QtRule(module_path=".*", weight_qtype="int8", act_qtype="int8",
    ...                    act_static_scale=True)
    >>> qat = qwix.quantize_model(make(), qwix.QtProvider([rule]), x)
    >>> import warnings
    >>> with warnings.catch_warnings():  # qwix 0.1.8's QAT sets flax's deprecated `.value`
    ...     warnings.simplefilter("ignore", DeprecationWarning)
    ...     for batch in (x, 2 * x):                               # calibration
    ...         _ = qat(batch)
    >>> stats = nnx.to_pure_dict(nnx.state(qat, qwix.QuantStat))
    >>> stats["layers"]["dot_general0_lhs"]["count"]
    Array([2, 2, 2], dtype=int32)
    >>> make_srq = lambda: qwix.quantize_model(make(), qwix.PtqProvider([rule]), x)
    >>> quantized = stackwise.nnx.quantize_params(floats, nnx.eval_shape(make_srq), stats)
    >>> quantized["layers"]["dot_general0_lhs_scale"]["array"].shape   # one per layer
    (3, 1, 1)
    >>> srq = make_srq()
    >>> nnx.update(srq, quantized)
    >>> srq(x).shape
    (2, 8)

    Args:
      params: the float params as a pure dict, ``nnx.to_pure_dict(nnx.state(model,
        nnx.Param))``.
      abstract_quantized_model: the quantized model, abstract (``nnx.eval_shape``) or not.
      quant_stats: for SRQ, the QAT model's calibration statistics as a pure dict,
        ``nnx.to_pure_dict(nnx.state(qat_model, qwix.QuantStat))`` (stacked per layer
        inside a Stack): each activation's static scale is computed by qwix from each
        layer's own statistics, as its block's in a loop. On the CPU,
        applying SRQ inside a Stack needs jaxlib >= 0.10.2 (0.10.0's XLA:CPU fails to
        compile qwix's SRQ dot inside any ``lax.scan`` for some shapes).
      allow_extra_params: skip params the quantized model does not have, as qwix's.

    Returns:
      A pure dict of the quantized params, for ``nnx.update(quantized_model, ...)``.

    Raises:
      TypeError: a state holding a served Stack's variables (``stackwise.nnx.to_serving``).
      ValueError: a param is not in the quantized model (unless ``allow_extra_params``),
        or does not quantize to its shapes there with 0, 1 or 2 leading layer axes (params
        of another model or depth); a ``quant_stats`` entry is not qwix's statistics,
        holds an uncalibrated layer (count 0), has no static scale in the quantized model
        or is of another depth.
    """
    import qwix  # only now: qwix stays optional

    flat = traverse_util.flatten_dict(params)
    refuse_served(flat, _WHO)
    out = _kit.map_params(
        flat,
        lambda path: _lookup(abstract_quantized_model, path),
        lambda w, a: qwix.quantize_params({"w": w}, {"w": a})["w"],
        _WHO, sep=".", where="the quantized model", allow_extra=allow_extra_params,
    )
    if quant_stats:
        out |= _kit.map_stats(
            traverse_util.flatten_dict(quant_stats),
            lambda path: _lookup(abstract_quantized_model, path), qwix.quantize_params,
            _WHO, sep=".", where="the quantized model",
        )
    return traverse_util.unflatten_dict(nnx.to_pure_dict(nnx.state(out)))
