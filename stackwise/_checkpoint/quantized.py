"""Quantizing while loading: ``load_checkpoint(..., quantize=)``.

A target leaf to quantize is read one layer at a time (the loader's own reading, transposes
and casts included), each layer quantized alone by the quantizer of
:func:`stackwise.quant.quantize` and its float values dropped before the next is read, so
the float model never sits whole in memory: the host holds the leaf's codes and scales
(the result) and one layer's floats. The codes and scales are then placed as the float leaf
would have been: the same ``NamedSharding`` spec (the scales' input axis split only where
their blocks divide it), the same device, or replicated alike.
"""

from __future__ import annotations

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
    check_float,
    is_float_matrix,
    quantize_rows,
)
from stackwise._finetune.targets import leaf_paths, select

__all__ = ["Choice", "abstract", "build", "check_placement", "choose"]

#: Per target leaf: None (loaded as floats) or ``(kind, block size)``.
Choice = list[tuple[str, int] | None]


def choose(target: Any, quantize: Any, who: str) -> Choice:
    """Which array leaves of ``target`` to quantize, checked before a byte is read."""
    flat = jax.tree_util.tree_leaves(target)
    if quantize is None:
        return [None] * len(flat)
    scheme = as_scheme(quantize, who)
    arrays = [(path, leaf) for path, leaf in leaf_paths(target) if is_array(leaf)]
    chosen = dict(zip([p for p, _ in arrays],
                      select(arrays, scheme.targets, who, is_float_matrix)))
    out: Choice = []
    for path, leaf in leaf_paths(target):
        if not chosen.get(path, False):
            out.append(None)
            continue
        check_float(path, leaf, who)
        block = block_size_of(scheme.block_size, leaf.shape[-2], path, who)
        out.append((scheme.kind, block))
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


def _place(host: np.ndarray, sharding: Sharding, path: str, who: str,
           strict: bool) -> jax.Array:
    if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, _spec(sharding, host.shape, path, "", who,
                                                      strict))
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _aligned(shape: tuple, dtype: Any) -> np.ndarray:
    """``np.empty(shape, dtype)`` starting at a multiple of 64 bytes, which jax's CPU client
    takes as a device buffer without a copy (so the codes are not held twice)."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def abstract(kind: str, block: int, shape: tuple, dtype: Any) -> Quantized:
    """The :class:`Quantized` node's shapes for a float leaf of ``shape``, without data (the
    quantizer's own, traced)."""
    floats = jax.ShapeDtypeStruct(shape, dtype)
    codes, scale = jax.eval_shape(lambda w: quantize_rows(w, kind, block), floats)
    return Quantized(codes, scale, kind, np.dtype(dtype).name, shape[-2])


def build(layer: Callable[[int], np.ndarray], kind: str, block: int, shape: tuple,
          dtype: Any, sharding: Sharding, path: str, who: str) -> Quantized:
    """The :class:`Quantized` leaf, ``layer(j)`` giving layer j's floats ``(1, in, out)``."""
    node = abstract(kind, block, shape, dtype)
    codes = _aligned(node.codes.shape, node.codes.dtype)
    scale = _aligned(node.scale.shape, node.scale.dtype)
    for j in range(shape[0]):
        floats = layer(j)
        c, s = quantize_rows(floats, kind, block)
        del floats  # the next layer is read once this one's floats are gone
        codes[j], scale[j] = np.asarray(c)[0], np.asarray(s)[0]
    return Quantized(_place(codes, sharding, path, who, True),
                     _place(scale, sharding, path, who, False), kind, node.dtype, node.rows)
