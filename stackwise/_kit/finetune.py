"""``stackwise.lora`` adapters and ``stackwise.quant`` weights in an adapter's stacked params.

An adapter's params (a Haiku dict, an Equinox module) may hold, in place of a stacked
weight, a :class:`stackwise.lora.Adapted` node (``stackwise.lora.attach(..., per_leaf=True)``)
or a :class:`stackwise.quant.Quantized` one (``stackwise.quant.quantize``). The scan slices
them per layer like any params; each adapter runs its block through :func:`run_layer` on its
layer's slice, so that the block sees float weights built one layer at a time (dequantized,
``W + scale * a @ b``), and a batch of g adapters (``stackwise.lora.stack_adapters``) runs
group j of ``x``'s leading axis with adapter j on the one shared base, as
``stackwise.lora.wrap`` does for the core's layers (the same function).
"""

from __future__ import annotations

from typing import Any

from stackwise._finetune import layer
from stackwise._finetune.layer import run_layer
from stackwise._kit.layered import qwix_dequantized_bytes

__all__ = ["run_layer", "warn_unrematted"]


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
