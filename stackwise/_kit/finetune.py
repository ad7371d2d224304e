"""``stackwise.lora`` adapters and ``stackwise.quant`` weights in an adapter's stacked params.

An adapter's params (a Haiku dict, an Equinox module) may hold, in place of a stacked
weight, a :class:`stackwise.lora.Adapted` node (``stackwise.lora.attach(..., per_leaf=True)``)
or a :class:`stackwise.quant.Quantized` one (``stackwise.quant.quantize``). The scan slices
them per layer like any params; each adapter calls :func:`layer_params` on its layer's slice
right before the block runs, so that the block sees float weights built one layer at a time
(dequantized, ``W + scale * a @ b``), as ``stackwise.lora.wrap`` does for the core's layers.
"""

from __future__ import annotations

from typing import Any

import jax

from stackwise._finetune import layer
from stackwise._finetune.layer import is_node, materialise
from stackwise._finetune.lora import Adapted
from stackwise._kit.layered import qwix_dequantized_bytes

__all__ = ["layer_params", "warn_unrematted"]


def layer_params(params: Any, who: str) -> Any:
    """One layer's params with every LoRA / quantized node made its float weight.

    Params without such nodes come back as they are (the same object).

    Raises:
      ValueError: a batch of adapters (``stackwise.lora.stack_adapters``): a framework's
        block runs one adapter over the whole input.
    """
    nodes = jax.tree.leaves(params, is_leaf=is_node)
    if not any(is_node(v) for v in nodes):
        return params
    for v in nodes:
        if isinstance(v, Adapted) and v.groups is not None:
            raise ValueError(
                f"{who}: the params hold a batch of {v.groups} adapters "
                "(`stackwise.lora.stack_adapters`); a framework's Stack runs one adapter "
                "over the whole input. Attach one adapter at a time "
                "(`jax.tree.map(lambda v: v[j], batch)` takes adapter j), or run the batch "
                "on the core's `stackwise.lora.stack(apply, n)`."
            )
    return materialise(params)


def warn_unrematted(params: Any, remat: Any, who: str, graph: Any = None) -> None:
    """Warns when ``remat=False`` would keep every layer's dequantized weights, giving bytes.

    The core's warning (``stackwise.lora.stack``'s), counting both the core's quantized
    nodes in ``params`` and qwix's quantized weights (``QArray`` s) in ``graph``, or in
    ``params`` when ``graph`` is None: an NNX Stack passes its blocks there, since qwix's
    ``QArray`` s are graph nodes of the module, not leaves of its ``nnx.State``.
    """
    qwix_tree = params if graph is None else graph
    layer.warn_unrematted(
        params, remat, who,
        count=lambda p: layer.dequantized_bytes(p) + qwix_dequantized_bytes(qwix_tree),
        stacklevel=4,  # the caller of the Stack that calls this
    )
