"""Stacked weights stored in 8 or 4 bits, with per-layer, per-output-channel scales.

A float leaf of shape ``(n, in, out)`` becomes a :class:`Quantized` node: integer codes and a
float ``scale`` of shape ``(n, 1, out)``, one per layer and output channel, so the layer axis
is never a weight axis; with ``block_size=B`` (QLoRA's nf4 takes 64) one per layer, output
channel and block of B inputs: ``(n, in / B, out)``. 4-bit codes (``"int4"``, ``"nf4"``) are
packed two to a byte along ``in`` (``uint8 (n, ceil(in / 2), out)``) and stay packed until a
layer unpacks its own slice.
The node's leaves keep the leading layer axis, so ``Stacked.apply`` slices them per layer
like any params; :func:`dequantize` gives back floats (of one layer inside the scan).
With ``double`` (QLoRA's double quantization) the scales are int8 codes of their
logarithms, with a float32 step per block of scales and a per-layer offset. Which leaves are
quantized, and how (:func:`quantize`, :func:`take`): :mod:`.quantizer`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from stackwise._finetune.targets import Targets, check_targets

__all__ = [
    "DOUBLE_BLOCK", "GAP", "KINDS", "LEVEL", "Quantized", "Scheme", "as_matrix", "as_scheme",
    "block_size_of", "check_block_size", "check_double", "check_kind", "compute_dtype",
    "dequantize", "double_rows", "doubled", "from_matrix", "is_quantized", "quantize_rows",
    "requantize",
]

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
      scale: ``float32 (..., in / block_size, out)``: per layer, block of inputs and output
        channel (``(..., 1, out)``: one block, the whole input axis).
      kind: ``"int8"``, ``"int4"`` or ``"nf4"`` (static).
      dtype: the float dtype it was quantized from, which :func:`dequantize` gives back.
      rows: ``in``, the unpacked number of rows (static).
      scale_step: with double quantization (``double=k``), the second-level scales,
        ``float32 (..., ceil(in / block_size * out / k))``: one per k consecutive scales of
        a layer (its ``(in / block_size, out)`` scales flattened in row-major order); then
        ``scale`` holds ``int8`` codes and a scale is ``exp(code * step + scale_offset)``.
        None without double quantization.
      scale_offset: with double quantization, each layer's mean log-scale, ``float32
        (...,)``, subtracted before the log-scales are quantized; None without.
      double: k, the scales per second-level block (static; 0: scales stored as float32).
      axes: the weight's contracted axes (static), counted in its own shape (without the
        layer axis), for a weight quantized with ``contract=``: its axes are moved to
        ``(*axes, *others)`` and flattened to ``(in, out)`` before quantizing (so
        ``rows`` is the product of the contracted lengths), and :func:`dequantize` gives
        the weight back in its own shape. Empty for an ``(in, out)`` weight.
      weight_shape: the weight's own shape (static), with ``axes``; empty without.
    """

    codes: jax.Array
    scale: jax.Array
    kind: str = ""
    dtype: str = "float32"
    rows: int = 0
    scale_step: jax.Array | None = None
    scale_offset: jax.Array | None = None
    double: int = 0
    axes: tuple = ()
    weight_shape: tuple = ()

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's shape: ``(..., in, out)``, or ``(..., *weight_shape)``."""
        if self.axes:
            return (*self.codes.shape[:-2], *self.weight_shape)
        return (*self.codes.shape[:-2], self.rows, self.codes.shape[-1])

    @property
    def block_size(self) -> int:
        """How many inputs (rows) share a scale: ``in`` unless quantized in blocks."""
        return self.rows // self.scale.shape[-2]

    @property
    def float_scale(self) -> jax.Array:
        """The first-level scales as float32, ``(..., in / block_size, out)``: ``scale`` itself,
        or, double-quantized, decoded from its int8 codes (``exp(code * step + offset)``)."""
        if not self.double:
            return self.scale
        return _undouble(self.scale, self.scale_step, self.scale_offset, self.double)

    @property
    def nbytes(self) -> int:
        """Bytes stored: codes, scales and (double-quantized) second-level scales and offsets."""
        return sum(int(v.size) * np.dtype(v.dtype).itemsize
                   for v in (self.codes, self.scale, self.scale_step, self.scale_offset)
                   if v is not None)

    @property
    def nbytes_dequantized(self) -> int:
        """Bytes of the whole float weight this stands for (all layers)."""
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


jax.tree_util.register_dataclass(
    Quantized, data_fields=["codes", "scale", "scale_step", "scale_offset"],
    meta_fields=["kind", "dtype", "rows", "double", "axes", "weight_shape"],
)


def is_quantized(value: Any) -> bool:
    """Whether ``value`` is a :class:`Quantized` node."""
    return isinstance(value, Quantized)


def _quantize_layer(w: jax.Array, kind: str, block: int) -> tuple[jax.Array, jax.Array]:
    """One layer's ``(in, out)`` float weight -> ``(codes, scale)``, codes unpacked and scales
    ``(in / block, out)``: each block of ``block`` rows scaled by its own absmax."""
    rows, cols = w.shape
    w = w.astype(jnp.float32).reshape(rows // block, block, cols)
    absmax = jnp.max(jnp.abs(w), axis=-2, keepdims=True)
    # A zero block gets scale 1 (its codes 0); a NaN or inf in a block makes its scale NaN
    # or inf, so the block dequantizes to non-finite numbers, never to finite wrong ones.
    if kind == "nf4":
        scale = jnp.where(absmax == 0, 1.0, absmax)
        x = w / scale
        # The nearest NF4 value's index: how many midpoints lie below x (searchsorted's,
        # as 15 compares fused into one pass: no temporaries of 15 per weight).
        codes = sum((x > m).astype(jnp.uint8) for m in (NF4[1:] + NF4[:-1]) / 2)
    else:
        limit = _LIMIT[kind]
        scale = jnp.where(absmax == 0, 1.0, absmax / limit)
        codes = jnp.clip(jnp.round(w / scale), -limit, limit).astype(jnp.int8)
        codes = codes if kind == "int8" else (codes + 8).astype(jnp.uint8)
    return codes.reshape(rows, cols), scale[:, 0, :]


def as_matrix(w: jax.Array, axes: tuple) -> jax.Array:
    """One weight of any shape as the ``(in, out)`` matrix it is quantized as: its ``axes``
    moved first and flattened into ``in``, the others into ``out`` (``w`` itself when
    ``axes`` is empty)."""
    if not axes:
        return w
    others = [a for a in range(w.ndim) if a not in axes]
    rows = math.prod(w.shape[a] for a in axes)
    return jnp.transpose(w, (*axes, *others)).reshape(rows, -1)


def from_matrix(m: jax.Array, axes: tuple, shape: tuple) -> jax.Array:
    """Inverse of :func:`as_matrix` on any leading axes: ``(..., in, out)`` -> ``(...,
    *shape)``."""
    if not axes:
        return m
    others = [a for a in range(len(shape)) if a not in axes]
    lead = m.shape[:-2]
    moved = m.reshape(*lead, *(shape[a] for a in axes), *(shape[a] for a in others))
    order = np.argsort([*axes, *others])
    return jnp.transpose(moved, (*range(len(lead)), *(len(lead) + int(o) for o in order)))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def quantize_rows(w: jax.Array, kind: str, block: int,
                  axes: tuple = ()) -> tuple[jax.Array, jax.Array]:
    """Stacked ``(n, in, out)`` floats -> ``(codes, scale)`` as :class:`Quantized` holds them
    (4-bit codes packed), one layer at a time (:func:`jax.lax.map`: float32 temporaries of
    one layer; each device its own layers where they are split over devices). The one
    quantizer of :func:`quantize` and of ``load_checkpoint(quantize=)``,
    so a layer quantized alone or in its stack gives the same bits. With ``axes``, each
    layer ``(n, *shape)`` is made an ``(in, out)`` matrix first (:func:`as_matrix`)."""
    one = lambda layer: _quantize_layer(as_matrix(layer, axes), kind, block)  # noqa: E731
    spec = getattr(jax.typeof(w).sharding, "spec", ())
    if spec and spec[0] is not None:
        # The layers split over devices (explicit mesh axes), which a scan cannot walk:
        # each device quantizes its own layers at once (its temporaries: its float shard).
        codes, scale = jax.vmap(one)(w)
    else:
        codes, scale = jax.lax.map(one, w)
    return (codes if kind == "int8" else _pack(codes)), scale


#: Scales per second-level block with ``double=True`` (QLoRA's, and bitsandbytes', 256).
DOUBLE_BLOCK = 256
#: The largest second-level code: the centred log-scales are int8 codes -127..127.
_DOUBLE_LIMIT = 127


def _double_layer(scale: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's float32 scales ``(blocks, out)`` (positive) -> ``(int8 codes (blocks,
    out), step (ceil(blocks * out / k),), offset ())``: their logarithms, the mean log
    subtracted, then each k consecutive centred logs (row-major; the last block may be
    shorter) rounded to ``code * step``, ``step = absmax / 127`` of its block (1 for a block
    of zeros)."""
    count = scale.size
    blocks = -(-count // k)
    logs = jnp.log(scale.reshape(count))
    offset = jnp.mean(logs)
    centred = jnp.pad(logs - offset, (0, blocks * k - count))
    centred = centred.reshape(blocks, k)
    absmax = jnp.max(jnp.abs(centred), axis=-1)
    step = jnp.where(absmax == 0, 1.0, absmax / _DOUBLE_LIMIT)
    codes = jnp.clip(jnp.round(centred / step[:, None]), -_DOUBLE_LIMIT, _DOUBLE_LIMIT)
    codes = codes.astype(jnp.int8).reshape(blocks * k)[:count].reshape(scale.shape)
    return codes, step, offset


def _undouble(codes: jax.Array, step: jax.Array, offset: jax.Array, k: int) -> jax.Array:
    """Inverse of :func:`_double_layer` on any leading axes: float32 scales, each
    ``exp(code * step + offset)``."""
    lead, shape = codes.shape[:-2], codes.shape[-2:]
    count = shape[0] * shape[1]
    blocks = step.shape[-1]
    flat = codes.reshape(*lead, count).astype(jnp.float32)
    flat = jnp.pad(flat, [(0, 0)] * len(lead) + [(0, blocks * k - count)])
    flat = (flat.reshape(*lead, blocks, k) * step[..., :, None]).reshape(*lead, blocks * k)
    return jnp.exp(flat[..., :count] + offset[..., None]).reshape(*lead, *shape)


@functools.partial(jax.jit, static_argnums=(1,))
def double_rows(scale: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Stacked float32 scales ``(n, blocks, out)`` -> ``(codes, step, offset)`` as
    :class:`Quantized` holds them double-quantized, one layer at a time (as
    :func:`quantize_rows`): a layer double-quantized alone or in its stack gives the same
    bits."""
    one = lambda layer: _double_layer(layer, k)  # noqa: E731
    spec = getattr(jax.typeof(scale).sharding, "spec", ())
    if spec and spec[0] is not None:
        return jax.vmap(one)(scale)
    return jax.lax.map(one, scale)


def doubled(node: Quantized, k: int) -> Quantized:
    """``node`` with its float32 scales double-quantized, k scales per second-level block
    (``node`` itself when k is 0)."""
    if not k:
        return node
    codes, step, offset = double_rows(node.scale, k)
    return dataclasses.replace(node, scale=codes, scale_step=step, scale_offset=offset,
                               double=k)


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


def dequantize(value: Any, dtype: Any = None) -> Any:
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
    if dtype is not None:
        dtype = compute_dtype(dtype, "stackwise.quant.dequantize")
    if not is_quantized(value):
        if any(is_quantized(v) for v in jax.tree.leaves(value, is_leaf=is_quantized)):
            return jax.tree.map(lambda v: dequantize(v, dtype), value, is_leaf=is_quantized)
        return value
    if value.kind == "int8":
        numbers = value.codes.astype(jnp.float32)
    else:
        codes = _unpack(value.codes, value.rows)
        if value.kind == "int4":
            numbers = codes.astype(jnp.float32) - 8.0
        else:
            numbers = jnp.asarray(NF4)[codes.astype(jnp.int32)]
    blocks, cols = value.scale.shape[-2:]
    lead = numbers.shape[:-2]
    numbers = numbers.reshape(*lead, blocks, value.rows // blocks, cols)
    scaled = numbers * value.float_scale[..., :, None, :]
    scaled = scaled.reshape(*lead, value.rows, cols).astype(dtype or value.dtype)
    return from_matrix(scaled, value.axes, value.weight_shape)


def requantize(node: Quantized, fn: Any, args: Any) -> Quantized:
    """``node``'s layers mapped to floats and quantized again as ``node`` was (its kind,
    block size and double quantization), one layer at a time (:func:`jax.lax.map`): layer
    i's float weight is ``fn(dequantize(node[i]), args[i])``, ``args`` a tree of leaves
    with the layer axis first."""
    block = node.block_size

    def one(layer_args):
        layer, arg = layer_args
        return _quantize_layer(as_matrix(fn(dequantize(layer), arg), node.axes), node.kind,
                               block)

    codes, scale = jax.lax.map(one, (node, args))
    codes = codes if node.kind == "int8" else _pack(codes)
    return doubled(dataclasses.replace(node, codes=codes, scale=scale, scale_step=None,
                                       scale_offset=None, double=0), node.double)


#: Per kind, the widest gap between neighbouring levels in units of the scale: a weight
#: rounds to within half of it times its block's scale (nf4's widest: -1 .. -0.6962, 0.3038).
GAP = {"int8": 1.0, "int4": 1.0, "nf4": float(np.max(np.diff(NF4)))}
#: Per kind, the largest level's magnitude in units of the scale (what a scale multiplies).
LEVEL = {"int8": 127.0, "int4": 7.0, "nf4": 1.0}


def compute_dtype(dtype: Any, who: str, arg: str = "dtype") -> np.dtype:
    """``dtype`` as a NumPy dtype if it is a floating one, else an error naming ``arg``."""
    try:
        kind = np.dtype(jnp.dtype(dtype))
    except TypeError:
        raise TypeError(
            f"{who}: `{arg}` must be a float dtype (jnp.bfloat16, jnp.float32) or None, got "
            f"{type(dtype).__name__} {dtype!r}."
        ) from None
    if not jnp.issubdtype(kind, jnp.floating):
        raise ValueError(
            f"{who}: `{arg}` is {kind.name}; the weights are computed in it, and integers "
            "would truncate them: give a float dtype (jnp.bfloat16 as QLoRA computes, "
            "jnp.float32) or None (the dtype quantized from)."
        )
    return kind


class Scheme(NamedTuple):
    """How to quantize a checkpoint as it loads: :func:`quantize`'s arguments, for
    ``stackwise.load_checkpoint(..., quantize=Scheme(...))`` (a kind alone, ``"nf4"``, is
    ``Scheme("nf4")``: every floating leaf that is 2-D per layer, one scale per channel).

    >>> import stackwise
    >>> stackwise.quant.Scheme("nf4", targets=lambda path, shape: "mlp" in path, block_size=64)
    Scheme(kind='nf4', targets=<function <lambda> at ...>, block_size=64, double=False)

    QLoRA's scheme, nf4 in blocks of 64 with the scales double-quantized:
    ``Scheme("nf4", block_size=64, double=True)``.

    Attributes:
      kind: ``"int8"``, ``"int4"`` or ``"nf4"``.
      targets: which leaves of the target (as :func:`quantize` takes them).
      block_size: rows per scale, or None for one per output channel.
      double: double quantization of the scales, as :func:`quantize` takes it.
    """

    kind: str = "int8"
    targets: Targets = None
    block_size: int | None = None
    double: bool | int = False


def as_scheme(value: Any, who: str) -> Scheme:
    """``quantize=`` as a checked :class:`Scheme`: a kind, or a Scheme."""
    if isinstance(value, str):
        value = Scheme(value)
    if not isinstance(value, Scheme):
        raise TypeError(
            f"{who}: `quantize` must be a kind ({', '.join(map(repr, KINDS))}) or a "
            "stackwise.quant.Scheme(kind, targets, block_size, double), got "
            f"{type(value).__name__} {value!r}."
        )
    check_kind(value.kind, who, "quantize")
    check_targets(value.targets, who)
    check_block_size(value.block_size, who)
    check_double(value.double, who)
    return value


def check_kind(kind: Any, who: str, arg: str = "kind") -> str:
    """``kind`` if it is one of :data:`KINDS`, else a ValueError naming ``arg``."""
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"{who}: `{arg}` must be one of {KINDS}, got {kind!r}.")
    return kind


def check_block_size(block_size: Any, who: str) -> int | None:
    """``block_size`` as given if it is None or a positive int, else an error naming it."""
    if block_size is None:
        return None
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise TypeError(
            f"{who}: `block_size` must be an int (rows per scale, e.g. 64 as QLoRA) or None "
            f"(one scale per output channel), got {type(block_size).__name__} {block_size!r}."
        )
    if block_size < 1:
        raise ValueError(f"{who}: `block_size` must be at least 1, got {block_size}.")
    return int(block_size)


def check_double(double: Any, who: str) -> int:
    """``double`` as k, the scales per second-level block: False -> 0 (none), True ->
    :data:`DOUBLE_BLOCK` (256), an int k >= 1 as given; else an error naming it."""
    if isinstance(double, bool):
        return DOUBLE_BLOCK if double else 0
    if not isinstance(double, (int, np.integer)):
        raise TypeError(
            f"{who}: `double` must be a bool (True: QLoRA's double quantization, the scales "
            f"in 8 bits, {DOUBLE_BLOCK} a block) or an int (scales per second-level block), "
            f"got {type(double).__name__} {double!r}."
        )
    if double < 1:
        raise ValueError(
            f"{who}: `double` must be at least 1 scale per second-level block, got {double}; "
            "pass False for float32 scales."
        )
    return int(double)


def block_size_of(block_size: int | None, rows: int, path: str, who: str) -> int:
    """The rows per scale of a target leaf with ``rows`` inputs per layer, checked to divide
    them (a block across the end would be scaled by fewer rows than its neighbours)."""
    if block_size is None:
        return rows
    if rows % block_size:
        raise ValueError(
            f"{who}: target leaf {path} has {rows} inputs (rows) per layer, which "
            f"`block_size={block_size}` does not divide; blocks are never padded. Pass a "
            f"block size that divides {rows} (e.g. {math.gcd(rows, block_size)}), None for "
            "one scale per output channel, or leave the leaf out of `targets`."
        )
    return block_size
