"""Stacked weights stored in 8 or 4 bits, with per-layer, per-output-channel scales.

A float leaf of shape ``(n, in, out)`` becomes a :class:`Quantized` node: integer codes and a
float ``scale`` of shape ``(n, 1, out)``, one per layer and output channel, so the layer axis
is never a weight axis; with ``block_size=B`` (QLoRA's nf4 takes 64) one per layer, output
channel and block of B inputs: ``(n, in / B, out)``. 4-bit codes (``"int4"``, ``"nf4"``) are
packed two to a byte along ``in`` (``uint8 (n, ceil(in / 2), out)``) and stay packed until a
layer unpacks its own slice.
The node's leaves keep the leading layer axis, so ``Stacked.apply`` slices them per layer
like any params; :func:`dequantize` gives back floats (of one layer inside the scan).
"""

from __future__ import annotations

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

__all__ = ["DOUBLE_BLOCK", "GAP", "KINDS", "LEVEL", "Quantized", "Scheme", "as_scheme", "block_size_of",
           "check_block_size", "check_double", "check_float", "check_kind", "compute_dtype",
           "dequantize", "double_rows", "doubled", "is_float_matrix", "is_quantized",
           "quantize", "quantize_rows", "requantize"]

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
        ``scale`` holds ``int8`` codes and a scale is ``code * step + scale_offset``.
        None without double quantization.
      scale_offset: with double quantization, each layer's mean scale, ``float32 (...,)``,
        subtracted before the scales are quantized; None without.
      double: k, the scales per second-level block (static; 0: scales stored as float32).
    """

    codes: jax.Array
    scale: jax.Array
    kind: str = ""
    dtype: str = "float32"
    rows: int = 0
    scale_step: jax.Array | None = None
    scale_offset: jax.Array | None = None
    double: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's shape: ``(..., in, out)``."""
        return (*self.codes.shape[:-2], self.rows, self.codes.shape[-1])

    @property
    def block_size(self) -> int:
        """How many inputs (rows) share a scale: ``in`` unless quantized in blocks."""
        return self.rows // self.scale.shape[-2]

    @property
    def float_scale(self) -> jax.Array:
        """The first-level scales as float32, ``(..., in / block_size, out)``: ``scale`` itself,
        or, double-quantized, decoded from its int8 codes (``code * step + offset``)."""
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
    meta_fields=["kind", "dtype", "rows", "double"],
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


@functools.partial(jax.jit, static_argnums=(1, 2))
def quantize_rows(w: jax.Array, kind: str, block: int) -> tuple[jax.Array, jax.Array]:
    """Stacked ``(n, in, out)`` floats -> ``(codes, scale)`` as :class:`Quantized` holds them
    (4-bit codes packed), one layer at a time (:func:`jax.lax.map`: float32 temporaries of
    one layer; each device its own layers where they are split over devices). The one
    quantizer of :func:`quantize` and of ``load_checkpoint(quantize=)``,
    so a layer quantized alone or in its stack gives the same bits."""
    one = lambda layer: _quantize_layer(layer, kind, block)  # noqa: E731
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
#: The largest second-level code: the centred scales are int8 codes -127..127.
_DOUBLE_LIMIT = 127


def _double_layer(scale: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's float32 scales ``(blocks, out)`` -> ``(int8 codes (blocks, out), step
    (ceil(blocks * out / k),), offset ())``: the mean subtracted, then each k consecutive
    centred scales (row-major; the last block may be shorter) rounded to ``code * step``,
    ``step = absmax / 127`` of its block (1 for a block of zeros)."""
    count = scale.size
    blocks = -(-count // k)
    offset = jnp.mean(scale)
    centred = jnp.pad(scale.reshape(count) - offset, (0, blocks * k - count))
    centred = centred.reshape(blocks, k)
    absmax = jnp.max(jnp.abs(centred), axis=-1)
    step = jnp.where(absmax == 0, 1.0, absmax / _DOUBLE_LIMIT)
    codes = jnp.clip(jnp.round(centred / step[:, None]), -_DOUBLE_LIMIT, _DOUBLE_LIMIT)
    codes = codes.astype(jnp.int8).reshape(blocks * k)[:count].reshape(scale.shape)
    return codes, step, offset


def _undouble(codes: jax.Array, step: jax.Array, offset: jax.Array, k: int) -> jax.Array:
    """Inverse of :func:`_double_layer` on any leading axes: float32 scales, each
    ``code * step + offset``."""
    lead, shape = codes.shape[:-2], codes.shape[-2:]
    count = shape[0] * shape[1]
    blocks = step.shape[-1]
    flat = codes.reshape(*lead, count).astype(jnp.float32)
    flat = jnp.pad(flat, [(0, 0)] * len(lead) + [(0, blocks * k - count)])
    flat = (flat.reshape(*lead, blocks, k) * step[..., :, None]).reshape(*lead, blocks * k)
    return (flat[..., :count] + offset[..., None]).reshape(*lead, *shape)


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
    return Quantized(node.codes, codes, node.kind, node.dtype, node.rows, step, offset, k)


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
    return scaled.reshape(*lead, value.rows, cols).astype(dtype or value.dtype)


def requantize(node: Quantized, fn: Any, args: Any) -> Quantized:
    """``node``'s layers mapped to floats and quantized again as ``node`` was (its kind,
    block size and double quantization), one layer at a time (:func:`jax.lax.map`): layer
    i's float weight is ``fn(dequantize(node[i]), args[i])``, ``args`` a tree of leaves
    with the layer axis first."""
    block = node.block_size

    def one(layer_args):
        layer, arg = layer_args
        return _quantize_layer(fn(dequantize(layer), arg), node.kind, block)

    codes, scale = jax.lax.map(one, (node, args))
    codes = codes if node.kind == "int8" else _pack(codes)
    return doubled(Quantized(codes, scale, node.kind, node.dtype, node.rows), node.double)


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
    """Whether each layer of ``w (n, in, out)`` is finite (one fused pass, no temporaries)."""
    return jnp.isfinite(w).all(axis=(-2, -1))


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
    double: bool | int = False,
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
    ``scale`` holds int8 codes, each layer's mean scale is ``scale_offset`` and each block
    of 256 of its centred scales (here 32 a block) has a float32 ``scale_step``:

    >>> d = stackwise.quant.quantize(params, "nf4", block_size=4, double=32)
    >>> d["w"].scale.dtype, d["w"].scale_step.shape, d["w"].scale_offset.shape
    (dtype('int8'), (4, 1), (4,))
    >>> err = abs(d["w"].float_scale - q["w"].scale).max() / d["w"].scale_step.max()
    >>> bool(err <= 0.5 + 1e-4)                           # half a second-level step
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
        scales), True (k = 256) or an int k. Each layer's scales, flattened row-major,
        have their mean subtracted (``scale_offset``, float32), and each k consecutive
        centred scales (the layer's last block may be shorter) are stored as int8 codes
        -127..127 with a float32 step ``absmax / 127`` of the block (``scale_step``). Int8
        codes rather than QLoRA's FP8: the same 8 bits, with a uniform step, so the error
        bound is one number per block; bitsandbytes' own double quantization is also an
        8-bit blockwise code with an fp32 scale per 256 and the mean offset.
        Each decoded scale is within half its block's step of the float32 one
        (``|s' - s| <= step / 2``, plus float32 rounding of ``code * step + offset``), so a
        weight is within ``c * step / 2`` of its singly-quantized value, ``c`` the largest
        code magnitude: 1 for nf4, 7 for int4, 127 for int8 (a step of a block of scales
        that differ by little is small). Memory, nf4 in blocks of 64:
        ``4 + 8 / 64 + 32 / (64 * 256) = 4.127`` bits per weight, against ``4 + 32 / 64 =
        4.5`` (plus one float32 offset per layer). A weight that is NaN or inf (under
        ``jit``) makes its layer's offset, so the whole layer, dequantize to non-finite
        numbers (not its column only).

    Returns:
      The params, each target leaf a :class:`Quantized` node.

    Raises:
      ValueError: an unknown ``kind``, a target that is not 2-D per layer, not floating,
        already quantized, holding NaN or inf (eager; under ``jit`` its block's scale is
        non-finite), or no target at all; a ``block_size`` below 1 or not dividing a
        target's ``in``; ``double`` below 1.
      TypeError: a ``block_size`` that is not an int, ``double`` neither a bool nor an
        int, ``targets`` of another type (an int given as the third argument), or
        adapters in ``params`` (quantize the base alone).
    """
    who = "stackwise.quant.quantize"
    stacked_only(who, params=params)
    check_kind(kind, who)
    block_size = check_block_size(block_size, who)
    double = check_double(double, who)
    _no_adapters(params, who)
    leaves = leaf_paths(params, is_leaf=is_quantized)
    chosen = select(leaves, targets, who, is_float_matrix)
    blocks = [block_size_of(block_size, leaf.shape[-2], path, who) if take else None
              for (path, leaf), take in zip(leaves, chosen)]
    out = []
    for (path, leaf), take, block in zip(leaves, chosen, blocks):
        if not take:
            out.append(leaf)
            continue
        dtype = check_float(path, leaf, who)
        _finite(path, leaf, who)
        codes, scale = quantize_rows(jnp.asarray(leaf), kind, block)
        out.append(doubled(Quantized(codes, scale, kind, dtype.name, leaf.shape[-2]), double))
    treedef = jax.tree.structure(params, is_leaf=is_quantized)
    return jax.tree.unflatten(treedef, out)
