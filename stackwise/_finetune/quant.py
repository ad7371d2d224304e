"""Stacked weights stored in 8 or 4 bits, with per-layer, per-output-channel scales.

A float leaf of shape ``(n, in, out)`` becomes a :class:`Quantized` node: integer codes and a
float ``scale`` of shape ``(n, 1, out)``, one per layer and output channel, so the layer axis
is never a weight axis. 4-bit codes (``"int4"``, ``"nf4"``) are packed two to a byte along
``in`` (``uint8 (n, ceil(in / 2), out)``) and stay packed until a layer unpacks its own slice.
The node's leaves keep the leading layer axis, so ``Stacked.apply`` slices them per layer
like any params; :func:`dequantize` gives back floats (of one layer inside the scan).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from stackwise._core import checks
from stackwise._finetune.targets import Targets, leaf_paths, select

__all__ = ["KINDS", "Quantized", "dequantize", "is_quantized", "quantize"]

#: The 16 values of 4-bit NormalFloat (QLoRA, Dettmers et al. 2023; bitsandbytes' table).
NF4 = np.array(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
     -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
     0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
     0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0],
    dtype=np.float32,
)  # fmt: skip

#: The kinds :func:`quantize` makes, and the largest code of each symmetric integer kind.
KINDS = ("int8", "int4", "nf4")
_LIMIT = {"int8": 127, "int4": 7}


@dataclass(frozen=True)
class Quantized:
    """A stacked weight in 8 or 4 bits: ``codes`` and ``scale``, leading layer axis first.

    Attributes:
      codes: ``int8 (..., in, out)`` for ``"int8"``; ``uint8 (..., ceil(in/2), out)`` for
        4-bit kinds, rows ``2j`` and ``2j + 1`` in the low and high nibble of row ``j``.
      scale: ``float32 (..., 1, out)``: per layer and output channel.
      kind: ``"int8"``, ``"int4"`` or ``"nf4"`` (static).
      dtype: the float dtype it was quantized from, which :func:`dequantize` gives back.
      rows: ``in``, the unpacked number of rows (static).
    """

    codes: jax.Array
    scale: jax.Array
    kind: str = ""
    dtype: str = "float32"
    rows: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's shape: ``(..., in, out)``."""
        return (*self.codes.shape[:-2], self.rows, self.codes.shape[-1])

    @property
    def nbytes_dequantized(self) -> int:
        """Bytes of the whole float weight this stands for (all layers)."""
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


jax.tree_util.register_dataclass(
    Quantized, data_fields=["codes", "scale"], meta_fields=["kind", "dtype", "rows"]
)


def is_quantized(value: Any) -> bool:
    """Whether ``value`` is a :class:`Quantized` node."""
    return isinstance(value, Quantized)


def _quantize_layer(w: jax.Array, kind: str) -> tuple[jax.Array, jax.Array]:
    """One layer's ``(in, out)`` float weight -> ``(codes, scale)`` (codes unpacked)."""
    w = w.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(w), axis=-2, keepdims=True)
    if kind == "nf4":
        scale = jnp.where(absmax > 0, absmax, 1.0)
        mids = jnp.asarray((NF4[1:] + NF4[:-1]) / 2)
        return jnp.searchsorted(mids, w / scale).astype(jnp.uint8), scale
    limit = _LIMIT[kind]
    scale = jnp.where(absmax > 0, absmax / limit, 1.0)
    codes = jnp.clip(jnp.round(w / scale), -limit, limit).astype(jnp.int8)
    return (codes if kind == "int8" else (codes + 8).astype(jnp.uint8)), scale


def _pack(codes: jax.Array) -> jax.Array:
    """4-bit codes ``uint8 (..., in, out)`` -> two per byte along ``in``."""
    if codes.shape[-2] % 2:
        codes = jnp.concatenate([codes, jnp.zeros_like(codes[..., :1, :])], axis=-2)
    return codes[..., 0::2, :] | (codes[..., 1::2, :] << 4)


def _unpack(packed: jax.Array, rows: int) -> jax.Array:
    """Inverse of :func:`_pack`: ``uint8 (..., ceil(in/2), out)`` -> ``(..., in, out)``."""
    low, high = packed & 0xF, packed >> 4
    both = jnp.stack([low, high], axis=-2)  # (..., in/2, 2, out)
    return both.reshape(*packed.shape[:-2], 2 * packed.shape[-2], packed.shape[-1])[
        ..., :rows, :
    ]


def dequantize(value: Any) -> Any:
    """The float weight a :class:`Quantized` node stands for (anything else as it is).

    Works on the stacked node and on one layer's slice of it (inside the scan), and on a
    whole tree: each node is replaced by its float weight. A layer run by
    :func:`stackwise.lora.wrap` dequantizes its own slice only.

    >>> import jax.numpy as jnp, stackwise
    >>> w = jnp.array([[[1.0, -2.0], [0.5, 4.0]]])          # 1 layer, (in, out) = (2, 2)
    >>> q = stackwise.quant.quantize({"w": w}, "int8")["w"]
    >>> q.codes.dtype, q.scale.shape
    (dtype('int8'), (1, 1, 2))
    >>> stackwise.quant.dequantize(q)
    Array([[[ 1.      , -2.015748],
            [ 0.503937,  4.      ]]], dtype=float32)
    """
    if not is_quantized(value):
        if any(is_quantized(v) for v in jax.tree.leaves(value, is_leaf=is_quantized)):
            return jax.tree.map(dequantize, value, is_leaf=is_quantized)
        return value
    if value.kind == "int8":
        numbers = value.codes.astype(jnp.float32)
    else:
        codes = _unpack(value.codes, value.rows)
        if value.kind == "int4":
            numbers = codes.astype(jnp.float32) - 8.0
        else:
            numbers = jnp.asarray(NF4)[codes.astype(jnp.int32)]
    return (numbers * value.scale).astype(value.dtype)


def _is_float_matrix(path: str, leaf: Any) -> bool:
    del path
    return len(np.shape(leaf)) == 3 and jnp.issubdtype(checks.leaf_dtype(leaf), jnp.floating)


def quantize(params: Any, kind: str = "int8", targets: Targets = None) -> Any:
    """Stacked params with their 2-D weights quantized per layer and output channel.

    Each target leaf ``(n, in, out)`` becomes a :class:`Quantized` node whose scales are
    ``(n, 1, out)``: layer i is quantized as the loop model's layer i would be, alone. The
    other leaves stay as they are. The layers are quantized one at a time
    (:func:`jax.lax.map`), so the float32 temporaries hold one layer.

    >>> import jax, jax.numpy as jnp, stackwise
    >>> params = {"w": jax.random.normal(jax.random.key(0), (4, 16, 8)), "b": jnp.zeros((4, 8))}
    >>> q = stackwise.quant.quantize(params, "nf4")
    >>> q["w"].codes.shape, q["w"].codes.dtype, q["w"].scale.shape   # packed along `in`
    ((4, 8, 8), dtype('uint8'), (4, 1, 8))
    >>> q["b"] is params["b"]
    True

    Args:
      params: stacked params (leading layer axis on every leaf), e.g. ``Stacked.init``'s.
        For a pattern, quantize each position's tree.
      kind: ``"int8"`` (codes -127..127, scale ``absmax / 127``), ``"int4"`` (-7..7, scale
        ``absmax / 7``) or ``"nf4"`` (QLoRA's NormalFloat codes, scale ``absmax``).
      targets: which leaves: a predicate ``(path, per_layer_shape) -> bool``, leaf paths
        (``"['attn']['q']"``), or None for every floating leaf that is 2-D per layer.

    Returns:
      The params, each target leaf a :class:`Quantized` node.

    Raises:
      ValueError: an unknown ``kind``, a target that is not 2-D per layer, not floating,
        already quantized, or no target at all.
    """
    who = "stackwise.quant.quantize"
    if kind not in KINDS:
        raise ValueError(f"{who}: `kind` must be one of {KINDS}, got {kind!r}.")
    leaves = leaf_paths(params, is_leaf=is_quantized)
    chosen = select(leaves, targets, who, _is_float_matrix)
    out = []
    for (path, leaf), take in zip(leaves, chosen):
        if not take:
            out.append(leaf)
            continue
        dtype = checks.leaf_dtype(leaf) if not is_quantized(leaf) else None
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            got = "already quantized" if dtype is None else f"of dtype {np.dtype(dtype).name}"
            raise ValueError(
                f"{who}: target leaf {path} is {got}; only float weights are quantized. Leave "
                "it out of `targets`."
            )
        codes, scale = jax.jit(jax.lax.map, static_argnums=0)(
            lambda w: _quantize_layer(w, kind), jnp.asarray(leaf)
        )
        if kind != "int8":
            codes = _pack(codes)
        out.append(Quantized(codes, scale, kind, np.dtype(dtype).name, leaf.shape[-2]))
    treedef = jax.tree.structure(params, is_leaf=is_quantized)
    return jax.tree.unflatten(treedef, out)
