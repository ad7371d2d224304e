"""Quantized stacked weights (int8, int4, nf4) with per-layer, per-channel (or per-block)
scales, optionally double-quantized as QLoRA's (``double=True``), dequantized inside each
layer by :func:`stackwise.lora.wrap` (see ``docs/finetune.md``). Weights of any rank take
``contract=``, tables and heads without a layer axis ``stacked=False``; :func:`take` looks
rows up in a quantized embedding table.

>>> import jax.numpy as jnp, stackwise
>>> q = stackwise.quant.quantize({"w": jnp.ones((4, 8, 8))}, "int4")
>>> q["w"].codes.shape, q["w"].scale.shape
((4, 4, 8), (4, 1, 8))
"""

from stackwise._finetune.quant import KINDS as KINDS
from stackwise._finetune.quant import Quantized as Quantized
from stackwise._finetune.quant import Scheme as Scheme
from stackwise._finetune.quant import dequantize as dequantize
from stackwise._finetune.quantizer import quantize as quantize
from stackwise._finetune.quantizer import take as take

__all__ = ["KINDS", "Quantized", "Scheme", "dequantize", "quantize", "take"]
