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
logarithms, with a float32 step per block of scales and a per-layer offset; with
``contract`` a weight of any rank is quantized as the ``(in, out)`` matrix of its
contracted axes by the others.
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

from stackwise._core import checks
from stackwise._core.served import stacked_only
from stackwise._finetune.targets import Targets, check_targets, leaf_paths, select

__all__ = ["DOUBLE_BLOCK", "GAP", "KINDS", "LEVEL", "Quantized", "Scheme", "as_matrix",
           "as_scheme", "block_size_of", "check_block_size", "check_double", "check_float",
           "check_kind", "compute_dtype", "dequantize", "double_rows", "doubled",
           "from_matrix", "is_float_matrix", "is_quantized", "quantize", "quantize_rows",
           "requantize", "take"]

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


def is_float_matrix(path: str, leaf: Any) -> bool:
    """The default target: a floating leaf that is 2-D per layer (3-D stacked)."""
    del path
    return len(np.shape(leaf)) == 3 and jnp.issubdtype(checks.leaf_dtype(leaf), jnp.floating)


def check_float(path: str, leaf: Any, who: str) -> np.dtype:
    """A target leaf's float dtype; refused if it is quantized already or not floating."""
    dtype = checks.leaf_dtype(leaf) if not is_quantized(leaf) else None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        got = "already quantized" if dtype is None else f"of dtype {np.dtype(dtype).name}"
        raise ValueError(
            f"{who}: target leaf {path} is {got}; only float weights are quantized. Leave "
            "it out of `targets`."
        )
    return np.dtype(dtype)


def _no_adapters(params: Any, who: str) -> None:
    """Refuses adapters (alone or attached) in ``params``: they stay float, they train."""
    from stackwise._finetune.lora import Adapted, LoraWeights  # lora imports this module

    node = lambda v: isinstance(v, (Adapted, LoraWeights))  # noqa: E731
    for path, leaf in leaf_paths(params, is_leaf=node):
        if node(leaf):
            raise TypeError(
                f"{who}: `params` holds LoRA adapters at {path}; adapters stay float (they "
                "are what trains). Quantize the base alone, then attach: "
                "`stackwise.lora.attach(stackwise.quant.quantize(base), adapters)`."
            )


@jax.jit
def _finite_layers(w: jax.Array) -> jax.Array:
    """Whether each layer of ``w (n, ...)`` is finite (one fused pass, no temporaries)."""
    return jnp.isfinite(w).all(axis=tuple(range(1, w.ndim)))


def _finite(path: str, leaf: Any, who: str) -> None:
    """Refuses a concrete weight holding NaN or inf: its block's scale would mean nothing."""
    if isinstance(leaf, jax.core.Tracer) or not getattr(leaf, "is_fully_addressable", True):
        return  # inside jit, or other processes' shards: the scales carry it (NaN or inf)
    bad = np.flatnonzero(~np.asarray(_finite_layers(leaf)))
    if bad.size:
        raise non_finite(path, bad.tolist(), who)


def non_finite(path: str, layers: list[int], who: str,
               targets: str = "leave the leaf out of `targets`") -> ValueError:
    """The error for a target leaf whose ``layers`` hold NaN or inf, as :func:`quantize` and
    ``load_checkpoint(quantize=)`` raise it."""
    return ValueError(
        f"{who}: target leaf {path} holds NaN or inf (layers {layers[:8]}); scaled by its "
        "absmax, every weight sharing its scale would be lost. Find where the non-finite "
        f"weights come from, or {targets}."
    )


def quantize(
    params: Any, kind: str = "int8", targets: Targets = None, *, block_size: int | None = None,
    double: bool | int = False, contract: Any = None, stacked: bool = True,
) -> Any:
    """Stacked params with their 2-D weights quantized per layer and output channel.

    Each target leaf ``(n, in, out)`` becomes a :class:`Quantized` node whose scales are
    ``(n, 1, out)``: layer i is quantized as the loop model's layer i would be, alone. The
    other leaves stay as they are. The layers are quantized one at a time
    (:func:`jax.lax.map`), so the float32 temporaries hold one layer. To quantize a
    checkpoint as it loads, without the float model whole in memory, pass ``quantize=`` to
    :func:`stackwise.load_checkpoint` (the same bits as this on its result).

    >>> import jax, jax.numpy as jnp, stackwise
    >>> params = {"w": jax.random.normal(jax.random.key(0), (4, 16, 8)), "b": jnp.zeros((4, 8))}
    >>> q = stackwise.quant.quantize(params, "nf4")
    >>> q["w"].codes.shape, q["w"].codes.dtype, q["w"].scale.shape   # packed along `in`
    ((4, 8, 8), dtype('uint8'), (4, 1, 8))
    >>> q["b"] is params["b"]
    True

    With ``block_size`` each block of that many inputs has its own scale per layer and
    output channel (QLoRA quantizes nf4 in blocks of 64):

    >>> q = stackwise.quant.quantize(params, "nf4", block_size=4)
    >>> q["w"].scale.shape, q["w"].block_size
    ((4, 4, 8), 4)

    With ``double=True`` (QLoRA's double quantization) the scales are stored in 8 bits too:
    ``scale`` holds int8 codes of the scales' logarithms, each layer's mean log-scale is
    ``scale_offset`` and each block of 256 of its centred log-scales (here 32 a block) has
    a float32 ``scale_step``; each scale is within a factor ``exp(step / 2)`` of its own:

    >>> d = stackwise.quant.quantize(params, "nf4", block_size=4, double=32)
    >>> d["w"].scale.dtype, d["w"].scale_step.shape, d["w"].scale_offset.shape
    (dtype('int8'), (4, 1), (4,))
    >>> err = abs(jnp.log(d["w"].float_scale / q["w"].scale)).max() / d["w"].scale_step.max()
    >>> bool(err <= 0.5 + 1e-4)                           # half a second-level step
    True

    A fused projection ``(n, E, H, D)`` contracted along E is its ``(n, E, H * D)``
    reshape, quantized, without reshaping by hand:

    >>> qkv = {"p": jax.random.normal(jax.random.key(1), (4, 16, 2, 3))}
    >>> p = stackwise.quant.quantize(qkv, "nf4", contract=0, block_size=8)["p"]
    >>> p.shape, p.codes.shape
    ((4, 16, 2, 3), (4, 8, 6))
    >>> by_hand = stackwise.quant.quantize({"p": qkv["p"].reshape(4, 16, 6)}, "nf4",
    ...                                    block_size=8)["p"]
    >>> bool((stackwise.quant.dequantize(p).reshape(4, 16, 6)
    ...       == stackwise.quant.dequantize(by_hand)).all())
    True

    Args:
      params: stacked params (leading layer axis on every leaf), e.g. ``Stacked.init``'s.
        For a pattern, quantize each position's tree.
      kind: ``"int8"`` (codes -127..127, scale ``absmax / 127``), ``"int4"`` (-7..7, scale
        ``absmax / 7``) or ``"nf4"`` (QLoRA's NormalFloat codes, scale ``absmax``).
      targets: which leaves: a predicate ``(path, per_layer_shape) -> bool``, leaf paths
        (``"['attn']['q']"``), or None for every floating leaf that is 2-D per layer.
      block_size: None for one scale per layer and output channel (the absmax of the whole
        input axis), or B: one per layer, output channel and B consecutive inputs (scales
        ``(n, in / B, out)``). B must divide every target's ``in``; nothing is padded.
      double: double quantization (QLoRA's, Dettmers et al. 2023, section 3): False (float32
        scales), True (k = 256) or an int k. Each layer's scales (positive), as logarithms
        and flattened row-major, have their mean subtracted (``scale_offset``, float32), and
        each k consecutive centred log-scales (the layer's last block may be shorter) are
        stored as int8 codes -127..127 with a float32 step ``absmax / 127`` of the block
        (``scale_step``); a scale decodes as ``exp(code * step + offset)``. Int8 codes of
        the logarithms rather than QLoRA's FP8 codes of the centred scales: the same 8 bits
        and memory, an error bound of one number per block, and a relative precision that
        an outlier does not spoil. (Of the scales themselves, a uniform step would let one
        outlier scale coarsen its 255 neighbours: measured, 1024 x 1024 normal weights in
        blocks of 64 with one weight of 200, its block's scales within 42%; of their
        logarithms, within 1.7%, and 0.28% without the outlier.) bitsandbytes' double
        quantization is likewise an 8-bit blockwise code with an fp32 scale per 256 and
        the mean offset, of a dynamic (exponent-like) map.
        Each decoded scale is within a factor ``exp(step / 2)`` of the float32 one
        (``|s' - s| <= s * (exp(step / 2) - 1)``, plus float32 rounding of the log and the
        exp), so a weight is within ``c * s * (exp(step / 2) - 1)`` of its singly-quantized
        value, ``c`` the largest level: 1 for nf4, 7 for int4, 127 for int8. Memory, nf4
        in blocks of 64: ``4 + 8 / 64 + 32 / (64 * 256) = 4.127`` bits per weight, against
        ``4 + 32 / 64 = 4.5`` (plus one float32 offset per layer). A weight that is NaN or
        inf (under ``jit``) makes its layer's offset, so the whole layer, dequantize to
        non-finite numbers (not its column only).
      contract: which axes of each weight (its own shape, without the layer axis) inputs
        are multiplied along: None (each target a 2-D ``(in, out)`` weight, contracted
        along ``in``), an axis or a tuple of axes for every target, or a dict of leaf
        paths to axes. A weight of any rank is quantized as the ``(in, out)`` matrix of
        its contracted axes (flattened, in their order) by the others: blocks of
        ``block_size`` run along the flattened contracted axes, and :func:`dequantize`
        gives it back in its own shape, as quantizing its reshape by hand would (an
        ``(E, H, D)`` projection with ``contract=0`` is its ``(E, H * D)`` reshape). A
        ``(V, D)`` embedding table with ``contract=1`` has each token's row scaled along
        D, so :func:`take` dequantizes the looked-up rows only. With ``contract``, the
        default targets are every float leaf of rank 2 or more per weight (one tuple for
        all) or the leaves a dict names. LoRA adapters go on 2-D weights only.
      stacked: True (every leaf has the layer axis first), or False: each target is one
        weight without a layer axis, e.g. an embedding table or a head outside the stack
        (its node's leaves have no layer axis either).

    Returns:
      The params, each target leaf a :class:`Quantized` node.

    Raises:
      ValueError: an unknown ``kind``, a target that is not 2-D per layer, not floating,
        already quantized, holding NaN or inf (eager; under ``jit`` its block's scale is
        non-finite), or no target at all; a ``block_size`` below 1 or not dividing a
        target's ``in``; ``double`` below 1; a target of rank other than 2 without
        ``contract``, or ``contract`` axes out of range, repeated or leaving no output axis.
      TypeError: a ``block_size`` that is not an int, ``double`` neither a bool nor an
        int, ``contract`` neither axes nor a dict of paths to axes, ``stacked`` not a
        bool, ``targets`` of another type (an int given as the third argument), or
        adapters in ``params`` (quantize the base alone).
    """
    who = "stackwise.quant.quantize"
    stacked_only(who, params=params)
    check_kind(kind, who)
    block_size = check_block_size(block_size, who)
    double = check_double(double, who)
    stacked = _check_stacked(stacked, who)
    contract_of = _check_contract(contract, who)
    _no_adapters(params, who)
    leaves = leaf_paths(params, is_leaf=is_quantized)
    lead = 1 if stacked else 0

    def default(path, leaf):
        # 2-D float weights; with `contract`, the leaves it names (a dict) or every float
        # leaf of rank 2 or more (one tuple of axes for all).
        rank = len(np.shape(leaf)) - lead
        named = path in contract if isinstance(contract, dict) else (
            contract is not None and rank >= 2)
        return (named or rank == 2) and not is_quantized(leaf) and \
            jnp.issubdtype(checks.leaf_dtype(leaf), jnp.floating)

    chosen = select(leaves, targets, who, default, matrix=False)
    plans = [_plan(path, tuple(np.shape(leaf))[lead:], contract_of(path), block_size,
                   stacked, who) if take else None
             for (path, leaf), take in zip(leaves, chosen)]
    out = []
    for (path, leaf), plan in zip(leaves, plans):
        if plan is None:
            out.append(leaf)
            continue
        axes, rows, block = plan
        dtype = check_float(path, leaf, who)
        w = jnp.asarray(leaf) if stacked else jnp.asarray(leaf)[None]
        _finite(path, w, who)
        codes, scale = quantize_rows(w, kind, block, axes)
        node = doubled(Quantized(codes, scale, kind, dtype.name, rows, axes=axes,
                                 weight_shape=w.shape[1:] if axes else ()), double)
        out.append(node if stacked else jax.tree.map(lambda v: v[0], node))
    treedef = jax.tree.structure(params, is_leaf=is_quantized)
    return jax.tree.unflatten(treedef, out)


def _check_stacked(stacked: Any, who: str) -> bool:
    if not isinstance(stacked, bool):
        raise TypeError(
            f"{who}: `stacked` must be a bool (False: each target is one weight without a "
            f"layer axis, e.g. an embedding table), got {type(stacked).__name__} {stacked!r}."
        )
    return stacked


def _axes(value: Any, who: str, where: str) -> tuple[int, ...]:
    """An int or a sequence of ints as a tuple, else a TypeError naming ``contract``."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return (int(value),)
    if isinstance(value, (tuple, list)) and value and all(
            isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in value):
        return tuple(int(a) for a in value)
    raise TypeError(
        f"{who}: `contract`{where} must be an axis or a tuple of axes of the weight (without "
        "the layer axis) that inputs are multiplied along, e.g. 0 for (in, out), (0, 1) for "
        f"an (H, Dh, D) projection; got {type(value).__name__} {value!r}."
    )


def _check_contract(contract: Any, who: str):
    """``contract`` as a function of a leaf's path: its contracted axes, or None."""
    if contract is None:
        return lambda path: None
    if isinstance(contract, dict):
        checked = {}
        for path, axes in contract.items():
            if not isinstance(path, str):
                raise TypeError(
                    f"{who}: `contract` maps leaf paths (as `jax.tree_util.keystr` writes "
                    f"them, \"['attn']['o']\") to axes; got the key {path!r}."
                )
            checked[path] = _axes(axes, who, f"[{path!r}]")
        return checked.get
    axes = _axes(contract, who, "")
    return lambda path: axes


def _plan(path: str, shape: tuple, axes: tuple | None, block_size: int | None, stacked: bool,
          who: str) -> tuple[tuple, int, int]:
    """A target's ``(axes as stored, rows, block)``: its contracted axes checked against its
    own ``shape`` (``()`` for a 2-D weight contracted along its first axis, the default)."""
    per = "per layer" if stacked else "(a weight without a layer axis: `stacked=False`)"
    if len(shape) < 2:
        raise ValueError(
            f"{who}: target leaf {path} has shape {shape} {per}, not a 2-D (in, out) "
            "weight nor one of higher rank: a vector has no axis to scale along. Leave it "
            "out of `targets`."
        )
    if axes is None:
        if len(shape) != 2:
            raise ValueError(
                f"{who}: target leaf {path} has shape {shape} {per}, not a 2-D (in, out) "
                f"weight; name the axes that inputs are multiplied along: `contract="
                f"{{{path!r}: (0,)}}` (e.g. (0,) for a (D, H, Dh) projection, (0, 1) for an "
                "(H, Dh, D) one), or leave it out of `targets`."
            )
        return (), shape[0], block_size_of(block_size, shape[0], path, who)
    rank = len(shape)
    fixed = tuple(a + rank if -rank <= a < 0 else a for a in axes)
    if any(not 0 <= a < rank for a in fixed) or len(set(fixed)) != len(fixed) or \
            len(fixed) >= rank:
        raise ValueError(
            f"{who}: `contract` gives target leaf {path} the axes {axes}, but its weight has "
            f"shape {shape} {per}: give distinct axes in range({rank}) (negative ones count "
            "from the end), leaving at least one axis uncontracted (the outputs)."
        )
    rows = math.prod(shape[a] for a in fixed)
    block = block_size_of(block_size, rows, path, who)
    return (() if fixed == (0,) and rank == 2 else fixed), rows, block


def take(node: Quantized, ids: Any) -> jax.Array:
    """The rows ``ids`` of a quantized embedding table, dequantized alone.

    The table ``(V, D)`` is quantized along D (``contract=1``: each token's row has its own
    scales, in blocks of D), so a lookup gathers the codes and scales of its rows only and
    dequantizes those: ``take(q, ids)`` is ``dequantize(q)[ids]``, bitwise (under ``jit``,
    where XLA may fuse the product otherwise, within a float32 rounding), without the rest
    of the table in floats. Stacked tables ``(n, V, D)`` give ``(n, *ids.shape, D)``.

    >>> import jax, jax.numpy as jnp, stackwise
    >>> table = jax.random.normal(jax.random.key(0), (10, 8))           # (V, D)
    >>> q = stackwise.quant.quantize({"e": table}, "nf4", contract=1, stacked=False,
    ...                              block_size=4, double=True)["e"]
    >>> ids = jnp.array([[3, 1], [7, 7]])
    >>> stackwise.quant.take(q, ids).shape
    (2, 2, 8)
    >>> bool((stackwise.quant.take(q, ids) == stackwise.quant.dequantize(q)[ids]).all())
    True

    Raises:
      TypeError: ``node`` is not a :class:`Quantized` node, or ``ids`` not integers.
      ValueError: a table not quantized along its second axis (``contract=1``).
    """
    who = "stackwise.quant.take"
    if not is_quantized(node):
        raise TypeError(f"{who}: `node` must be a stackwise.quant.Quantized table, got "
                        f"{type(node).__name__}.")
    if node.axes != (1,) or len(node.weight_shape) != 2:
        got = f"axes {node.axes}" if node.axes else "its first axis (the default)"
        raise ValueError(
            f"{who}: the table is quantized along {got} of its weight shape "
            f"{node.shape[-2:] if not node.axes else node.weight_shape}; a lookup gathers "
            "rows, which needs each row's own scales: quantize the (V, D) table along D, "
            "`stackwise.quant.quantize(params, kind, targets, contract=1, stacked=False)`."
        )
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{who}: `ids` must be integer token ids, got dtype {ids.dtype}.")
    flat = ids.reshape(-1)
    vocab = node.codes.shape[-1]
    scale = node.scale[..., flat]
    if node.double:  # each gathered scale decoded alone: its own step and the offset
        blocks = node.scale.shape[-2]
        where = jnp.arange(blocks)[:, None] * vocab + flat[None, :]
        step = jnp.take(node.scale_step, where // node.double, axis=-1)
        scale = jnp.exp(scale.astype(jnp.float32) * step + node.scale_offset[..., None, None])
    rows = Quantized(node.codes[..., flat], scale, node.kind, node.dtype, node.rows)
    out = jnp.swapaxes(dequantize(rows), -1, -2)  # (..., k, D)
    return out.reshape(*out.shape[:-2], *ids.shape, out.shape[-1])
