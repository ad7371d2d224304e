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

from stackwise._finetune.layer import run_layer, warn_unrematted

__all__ = ["run_layer", "warn_unrematted"]
