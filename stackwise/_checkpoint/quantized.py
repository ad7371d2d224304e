"""Quantizing while loading: ``load_checkpoint(..., quantize=)``.

A target leaf to quantize is read one layer at a time (the loader's own reading, transposes
and casts included), each layer quantized alone by the quantizer of
:func:`stackwise.quant.quantize` and its float values dropped before the next is read, so
the float model never sits whole in memory: the host holds the codes and scales of this
process's shards (the result) and one layer's floats. Each process reads only the region
its shards are made of (:func:`_region`). The codes and scales are then placed as the float leaf
would have been: the same ``NamedSharding`` spec (the scales' input axis split only where
their blocks divide it), the same device, or replicated alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from stackwise._checkpoint.names import is_array
from stackwise._finetune.quant import (
    Quantized,
    as_scheme,
    block_size_of,
    check_double,
    doubled,
    quantize_rows,
)
from stackwise._finetune.quantizer import check_float, is_float_matrix, non_finite
from stackwise._finetune.targets import leaf_paths, select

__all__ = ["Choice", "abstract", "build", "check_placement", "choose"]

#: Per target leaf: None (loaded as floats) or ``(kind, block size, double)`` (double: the
#: scales per second-level block, 0 for float32 scales).
Choice = list[tuple[str, int, int] | None]


def choose(target: Any, quantize: Any, who: str) -> Choice:
    """Which array leaves of ``target`` to quantize, checked before a byte is read."""
    flat = jax.tree_util.tree_leaves(target)
    if quantize is None:
        return [None] * len(flat)
    scheme = as_scheme(quantize, who)
    arrays = [(path, leaf) for path, leaf in leaf_paths(target) if is_array(leaf)]
    chosen = dict(zip([p for p, _ in arrays],
                      select(arrays, scheme.targets, who, is_float_matrix, matrix=False)))
    out: Choice = []
    for path, leaf in leaf_paths(target):
        if not chosen.get(path, False):
            out.append(None)
            continue
        if len(leaf.shape) != 3:
            raise ValueError(
                f"{who}: target leaf {path} has shape {tuple(leaf.shape)}, "
                f"{list(leaf.shape[1:])} per layer; quantizing as it loads takes a 2-D "
                "(in, out) weight per layer (stacked: (n, in, out)). Load a weight of "
                "another rank as floats (leave it out of the scheme's targets) and quantize "
                "it afterwards naming its contracted axes, `stackwise.quant.quantize(params, "
                "kind, targets, contract=...)`."
            )
        check_float(path, leaf, who)
        block = block_size_of(scheme.block_size, leaf.shape[-2], path, who)
        out.append((scheme.kind, block, check_double(scheme.double, who)))
    return out


def check_placement(sharding: Sharding, quantized: Quantized, path: str, who: str) -> None:
    """The float leaf's sharding must place the codes and the scales too."""
    if isinstance(sharding, NamedSharding):
        _spec(sharding, quantized.codes.shape, path, "codes", who)
        return
    if not (isinstance(sharding, SingleDeviceSharding) or sharding.is_fully_replicated):
        raise TypeError(
            f"{who}: leaf {path} is quantized as it loads, and its sharding "
            f"{type(sharding).__name__} splits it in a way that says nothing of its codes "
            "and scales. Give the leaf a NamedSharding(mesh, spec) (the codes take the spec, "
            "the scales too where it divides them), one device, or a replicated sharding."
        )


def _spec(sharding: NamedSharding, shape: tuple, path: str, what: str, who: str,
          strict: bool = True) -> PartitionSpec:
    """The float leaf's spec for an array of ``shape``: an axis it does not divide is
    refused (``strict``, the codes) or left whole (the scales' input axis, of few blocks)."""
    entries = list(sharding.spec)  # (as long as the float leaf's, at most its axes)
    for d, entry in enumerate(entries):
        axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        size = int(np.prod([sharding.mesh.shape[a] for a in axes]))
        if shape[d] % size and strict:
            raise ValueError(
                f"{who}: leaf {path} is quantized as it loads to {what} of shape {shape} (4-bit "
                f"codes pack two rows a byte), whose axis {d} (length {shape[d]}) mesh axes "
                f"{entry!r} of size {size} do not divide (spec {sharding.spec}). Shard another "
                "axis of the leaf, or leave this one unsharded."
            )
        if shape[d] % size:
            entries[d] = None
    return PartitionSpec(*entries)


def _place(host: np.ndarray, origin: tuple, shape: tuple, sharding: Sharding, path: str,
           who: str, strict: bool) -> jax.Array:
    """The array of ``shape`` placed by ``sharding`` (its spec as :func:`_spec` makes it),
    whose part from ``origin`` on is ``host``: every shard this process holds lies there."""
    if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, _spec(sharding, shape, path, "", who, strict))

    def shard(index: tuple) -> np.ndarray:
        return host[tuple(slice(a - o, b - o) for (a, b, _), o in
                          zip((s.indices(d) for s, d in zip(index, shape)), origin))]

    return jax.make_array_from_callback(shape, sharding, shard, dtype=host.dtype)


def _extent(sharding: Sharding, shape: tuple, path: str, who: str,
            strict: bool) -> list[tuple[int, int]] | None:
    """Per axis, ``(start, stop)`` spanning the shards of an array of ``shape`` that this
    process's devices hold, as :func:`_place` shards it; None when they hold none."""
    if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, _spec(sharding, shape, path, "", who, strict))
    indices = list(sharding.addressable_devices_indices_map(shape).values())
    if not indices:
        return None
    spans = [[s.indices(d)[:2] for s, d in zip(tuple(index) + (slice(None),) * len(shape),
                                                shape)] for index in indices]
    return [(min(s[d][0] for s in spans), max(s[d][1] for s in spans))
            for d in range(len(shape))]


def _region(node: Quantized, block: int, sharding: Sharding, path: str,
            who: str) -> tuple | None:
    """The float leaf's slices that this process's shards of the codes and scales are made
    of (None: it holds none). Each column, and each block of ``block`` rows, is quantized on
    its own, so the region keeps the shards' layers and columns, and their rows rounded out
    to whole blocks (whole 4-bit byte pairs too): quantizing it alone gives their bits."""
    codes = _extent(sharding, node.codes.shape, path, who, True)
    scale = _extent(sharding, node.scale.shape, path, who, False)
    if codes is None:
        return None
    pack = 1 if node.kind == "int8" else 2
    rows = (min(codes[1][0] * pack, scale[1][0] * block),
            max(codes[1][1] * pack, scale[1][1] * block))
    step = math.lcm(pack, block)
    rows = (rows[0] // step * step, min(-(-rows[1] // step) * step, node.rows))
    return tuple(slice(a, b) for a, b in (
        (min(codes[0][0], scale[0][0]), max(codes[0][1], scale[0][1])), rows,
        (min(codes[2][0], scale[2][0]), max(codes[2][1], scale[2][1]))))


def _aligned(shape: tuple, dtype: Any) -> np.ndarray:
    """``np.empty(shape, dtype)`` starting at a multiple of 64 bytes, which jax's CPU client
    takes as a device buffer without a copy (so the codes are not held twice)."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def abstract(kind: str, block: int, double: int, shape: tuple, dtype: Any) -> Quantized:
    """The :class:`Quantized` node's shapes for a float leaf of ``shape``, without data (the
    quantizer's own, traced); its ``scale`` is the first level's, float32, whatever
    ``double`` (the double quantization runs on the placed scales: :func:`build`)."""
    del double
    floats = jax.ShapeDtypeStruct(shape, dtype)
    codes, scale = jax.eval_shape(lambda w: quantize_rows(w, kind, block), floats)
    return Quantized(codes, scale, kind, np.dtype(dtype).name, shape[-2])


def build(read: Callable[[tuple], np.ndarray], kind: str, block: int, double: int,
          shape: tuple, dtype: Any, sharding: Sharding, path: str, who: str) -> Quantized:
    """The :class:`Quantized` leaf, ``read(index)`` giving the float leaf's slices at
    ``index`` (one layer at a time). Only the region this process's shards are made of is
    read (:func:`_region`): on several hosts each reads and quantizes its own layers,
    columns and blocks of rows. A layer holding NaN or inf is refused as
    :func:`stackwise.quant.quantize` refuses it (its blocks' scales tell). With ``double``
    the placed float32 scales are then double-quantized by the quantizer's own jitted
    function (:func:`stackwise._finetune.quant.doubled`: each layer's mean needs all of its
    scales, which XLA gathers where they are split over devices or processes)."""
    node = abstract(kind, block, double, shape, dtype)
    region = _region(node, block, sharding, path, who)
    pack = 1 if kind == "int8" else 2
    if region is None:  # none of this process's devices holds a shard
        region = (slice(0, 0),) * 3
    layers, rows, cols = region
    corner = ((layers.start, rows.start // pack, cols.start),
              (layers.start, rows.start // block, cols.start))
    sizes = (layers.stop - layers.start, cols.stop - cols.start)
    codes = _aligned((sizes[0], -(-(rows.stop - rows.start) // pack), sizes[1]),
                     node.codes.dtype)
    scale = _aligned((sizes[0], (rows.stop - rows.start) // block, sizes[1]), node.scale.dtype)
    for j in range(layers.start, layers.stop):
        floats = read((slice(j, j + 1), rows, cols))
        c, s = quantize_rows(floats, kind, block)
        del floats  # the next layer is read once this one's floats are gone
        if not np.isfinite(s).all():  # a NaN or inf weight gives its block that scale
            raise non_finite(path, [j], who, "load it as floats: leave it out of the "
                             "scheme's targets, `quantize=stackwise.quant.Scheme(kind, "
                             "targets)`")
        codes[j - layers.start], scale[j - layers.start] = np.asarray(c)[0], np.asarray(s)[0]
    return doubled(Quantized(
        _place(codes, corner[0], node.codes.shape, sharding, path, who, True),
        _place(scale, corner[1], node.scale.shape, sharding, path, who, False),
        kind, node.dtype, node.rows), double)
