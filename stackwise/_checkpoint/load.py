"""Per-layer checkpoints straight into stacked, sharded params, and back, streamed.

The names follow the conversion vocabulary (``docs/conversion.md``): a name
with ``{}`` is a per-layer tensor, ``{}`` standing for the layer index, and
fills a stacked leaf (row j = layer j; with ``pattern=k`` position p's row j
= layer ``p + j*k``); a name without ``{}`` fills a leaf whole (embeddings,
a final norm, or a checkpoint that is already stacked). Every check runs
before a byte is read, so nothing is ever partly loaded, and each device's
shard is built from the slices it needs only, layer by layer, each layer's
slice copied straight into it (a transposed one through a small staging
buffer), in pieces of about 1 MiB that two threads share, whatever the
layout (one device, FSDP, tensor parallel, the layer axis over stages). On
CPU devices a leaf's shards are filled together and become the device
arrays without a copy; on others they go one device at a time. Which
placements ``shardings`` may give is read in :mod:`.placements`. Host
memory beyond the final arrays stays about one layer's tensor (CPU) or one
device's shard of one leaf.
"""

from __future__ import annotations

import concurrent.futures
import difflib
import math
import mmap
import os
import threading
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Sharding, SingleDeviceSharding

from stackwise._checkpoint import quantized
from stackwise._checkpoint.names import (
    Tensor,
    check_layout,
    check_no_finetune_nodes,
    check_not_prng_key,
    check_template,
    is_array,
    layers_of,
    lookup,
    name_leaves,
    resolve_reshape,
)
from stackwise._checkpoint.placements import check_sharding, placements
from stackwise._checkpoint.read import Checkpoint, open_checkpoint
from stackwise._core import checks, trees

__all__ = ["load_checkpoint"]

_LOAD = "stackwise.load_checkpoint"
_THREADS = 2  # threads filling a leaf, sharing each layer (see _layer_by_layer)
_AHEAD = 2  # layers a filling thread may run ahead of the slowest
_PARALLEL_BYTES = 1 << 20  # a layer's tensor below this is filled by one thread
_PIECE_BYTES = 1 << 20  # a layer's slice is filled in pieces of about this size (_pieces)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # see _host


class _Plan(NamedTuple):
    path: str
    spec: Tensor
    shape: tuple
    dtype: np.dtype
    sources: list[str] | None  # one per row (per layer), or None: the tensor `spec.name`
    stored: tuple  # the stored tensor's shape (per layer)
    sharding: Sharding


def _where(ckpt: Checkpoint, name: str) -> str:
    return ckpt.file_of(name) if name in ckpt.tensors else ckpt.where


def _transformed(spec: Tensor, stored: tuple, path: str, name: str, ckpt: Checkpoint,
                 who: str) -> tuple:
    shape = tuple(stored)
    if spec.transpose is not None:
        perm = tuple(spec.transpose)
        if sorted(perm) != list(range(len(shape))):
            raise TypeError(
                f"{who}: leaf {path}: `transpose={perm}` is not a permutation of the "
                f"{len(shape)} axes of tensor {name!r} (shape {shape}) in {_where(ckpt, name)}."
            )
        shape = tuple(shape[a] for a in perm)
    if spec.reshape is not None:
        reshaped = resolve_reshape(spec.reshape, int(np.prod(shape)))
        if reshaped is None:
            raise ValueError(
                f"{who}: leaf {path}: tensor {name!r} in {_where(ckpt, name)} has shape "
                f"{shape} (after the transpose), which cannot be reshaped to {spec.reshape}."
            )
        shape = reshaped
    return shape


def _plan_leaf(ckpt, path, leaf, spec, k, sharding, who) -> _Plan:
    check_template(spec, path, who)
    check_not_prng_key(leaf, path, who)
    checks.exact_dtype(leaf, who, f"leaf {path}")
    shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
    check_layout(spec, shape, k, path, who)
    if spec.per_layer:
        p, step = spec.position or 0, k or 1
        layers = [p + j * step for j in range(shape[0])]
        found = layers_of(spec.name, list(ckpt.tensors))
        missing = [i for i in layers if i not in found]
        if missing:
            i = missing[0]
            have = (
                f"it has layers {_ranges(sorted(found))} of it"
                if found
                else f"no tensor matches it at all{_closest(spec.name.format(i), ckpt)}"
            )
            raise ValueError(
                f"{who}: layer {i}'s tensor {spec.name.format(i)!r} for leaf {path} is not "
                f"in {ckpt.where} ({len(missing)} of the target's {len(layers)} layers "
                f"missing; {have}). Check the name template and the depth: the target has "
                f"{shape[0]} rows of {spec.name!r}"
                + (f" at pattern position {p} of {k}" if k else "") + "."
            )
        sources = [found[i] for i in layers]
        stored = tuple(ckpt.tensors[sources[0]].shape)
        stored_dtype = np.dtype(ckpt.tensors[sources[0]].dtype)
        for i, name in zip(layers, sources):
            s = ckpt.tensors[name]
            if tuple(s.shape) != stored or np.dtype(s.dtype) != stored_dtype:
                raise ValueError(
                    f"{who}: leaf {path}: layer {i}'s tensor {name!r} in {ckpt.file_of(name)} "
                    f"is {_desc(s)}, layer {layers[0]}'s {_desc(ckpt.tensors[sources[0]])}; "
                    "every layer's tensor must have one shape and dtype to be stacked."
                )
        first, inner = sources[0], shape[1:]
    else:
        if spec.name not in ckpt.tensors:
            raise ValueError(
                f"{who}: tensor {spec.name!r} for leaf {path} is not in {ckpt.where}"
                f"{_closest(spec.name, ckpt)}. Check the name; a per-layer tensor needs "
                "`{}` where the layer index goes."
            )
        sources, first, inner = None, spec.name, shape
        stored = tuple(ckpt.tensors[first].shape)
    file = ckpt.file_of(first)
    got = _transformed(spec, stored, path, first, ckpt, who)
    if got != inner:
        hint = ""
        if len(stored) == 2 and stored[::-1] == tuple(inner) and spec.transpose is None:
            hint = (" Torch's Linear stores (out, in): pass "
                    f"stackwise.Tensor({spec.name!r}, transpose=(1, 0)).")
        elif int(np.prod(got)) == int(np.prod(inner)):
            hint = f" To split or merge axes, pass stackwise.Tensor(..., reshape={tuple(inner)})."
        where = "per layer " if spec.per_layer else ""
        which = f"layer {_first_layer(spec)}'s tensor" if spec.per_layer else "tensor"
        raise ValueError(
            f"{who}: leaf {path} has shape {shape} ({where}{tuple(inner)}) but {which} "
            f"{first!r} in {file} is {list(stored)}"
            + (f", {list(got)} after the transforms" if got != stored else "")
            + f".{hint}"
        )
    src_dtype = np.dtype(ckpt.tensors[first].dtype)
    if spec.dtype is None and src_dtype != dtype:
        which = f"layer {_first_layer(spec)}'s tensor" if spec.per_layer else "tensor"
        raise TypeError(
            f"{who}: leaf {path} is {dtype.name} but {which} {first!r} in {file} is "
            f"{src_dtype.name}; stackwise never casts implicitly. Cast on purpose with "
            f"stackwise.Tensor({spec.name!r}, dtype=jnp.{dtype.name}), or make the model "
            f"{src_dtype.name}."
        )
    if spec.dtype is not None and np.dtype(spec.dtype) != dtype:
        raise TypeError(
            f"{who}: leaf {path} is {dtype.name}, but its Tensor casts tensor {first!r} to "
            f"{np.dtype(spec.dtype).name}; pass dtype=jnp.{dtype.name}."
        )
    check_sharding(sharding, shape, path, who)
    return _Plan(path, spec, shape, dtype, sources, stored, sharding)


def _first_layer(spec: Tensor) -> int:
    """The first layer a per-layer leaf holds (its pattern position)."""
    return spec.position or 0


def _desc(s: Any) -> str:
    return f"{np.dtype(s.dtype).name}{list(s.shape)}"


def _ranges(xs: list[int]) -> str:
    parts, start = [], None
    for j, x in enumerate(xs):
        start = x if start is None else start
        if j + 1 == len(xs) or xs[j + 1] != x + 1:
            parts.append(f"{start}" if start == x else f"{start}..{x}")
            start = None
    return ", ".join(parts)


def _closest(name: str, ckpt: Checkpoint) -> str:
    close = difflib.get_close_matches(name, list(ckpt.tensors), n=1, cutoff=0.6)
    return f"; the closest name there is {close[0]!r}" if close else ""


def _plans(ckpt, target, names, shardings, pattern, who) -> list[_Plan | None]:
    if pattern is not None:
        pattern = checks.integer(pattern, who, "pattern", minimum=1)
    check_no_finetune_nodes(target, "target", who)
    given = placements(shardings, target, who)
    plans, used, seen = [], set(), {}
    for (keys, leaf), sharding in zip(jax.tree_util.tree_leaves_with_path(target), given):
        if not is_array(leaf):
            plans.append(None)  # functions, static numbers: kept as they are
            continue
        path = jax.tree_util.keystr(keys) or "<root>"
        spec = lookup(names, [trees.key_text(k) for k in keys], path, who)
        used.add("/".join(trees.key_text(k) for k in keys if trees.key_text(k) != "value"))
        if sharding is None:
            sharding = getattr(leaf, "sharding", None)
            if not isinstance(sharding, Sharding):
                sharding = SingleDeviceSharding(jax.devices()[0])
        plan = _plan_leaf(ckpt, path, leaf, spec, pattern, sharding, who)
        for name in plan.sources or [spec.name]:
            if name in seen:
                raise ValueError(
                    f"{who}: tensor {name!r} of {ckpt.file_of(name)} would fill two leaves, "
                    f"{seen[name]} and {path}; a name must match one leaf (for tied weights, "
                    "load it once and share it in the model)."
                )
            seen[name] = path
        plans.append(plan)
    extra = [n for n in name_leaves(names) if n not in used]
    if extra:
        raise ValueError(
            f"{who}: `names` has entries for leaves the target does not have: {extra}; "
            "a misspelt key would leave its tensors behind. Remove them or fix the key."
        )
    # The checkpoint's layers beyond the target's: they would be left behind.
    wanted: dict[str, set[int]] = {}
    for plan in plans:
        if plan is not None and plan.sources is not None:
            found = layers_of(plan.spec.name, plan.sources)
            wanted.setdefault(plan.spec.name, set()).update(found)
    for template, layers in wanted.items():
        found = layers_of(template, list(ckpt.tensors))
        extra_layers = sorted(set(found) - layers)
        if extra_layers:
            i = extra_layers[0]
            raise ValueError(
                f"{who}: {ckpt.file_of(found[i])} has layer {i}'s tensor {found[i]!r} (layers "
                f"{_ranges(extra_layers)} of {template!r}) that the target has no place for: "
                f"the target fills layers {_ranges(sorted(layers))}. Build the model with all "
                f"{1 + max(found)} layers (then stackwise.slice_layers for fewer), or check "
                "`pattern` and the positions."
            )
    return plans


# --------------------------------------------------------------------------
# Loading.


def _fill(ckpt: Checkpoint, plan: _Plan, indices: list[tuple]) -> list[np.ndarray]:
    """The host arrays of the shards at ``indices``, filled together, layer by layer: each
    shard's slice of a layer's tensor read straight into its row (in pieces, see
    :func:`_pieces`), then the tensor's pages let go of (mapped once for all the shards)."""
    spec = plan.spec
    perm = tuple(spec.transpose) if spec.transpose is not None else None

    def one(name: str, index: tuple) -> np.ndarray:  # a view or a copy; the caller copies
        if spec.reshape is not None:
            x = ckpt.view(name, ())
            return (x.transpose(perm) if perm else x).reshape(spec.reshape)[index]
        if perm:
            return ckpt.view(name, _source(perm, index)).transpose(perm)
        return ckpt.view(name, index)

    outs = [_host(tuple(len(range(*s.indices(n))) for s, n in zip(index, plan.shape)),
                  plan.dtype) for index in indices]
    direct = perm is None and spec.reshape is None  # (and cast, if asked)
    if plan.sources is None:
        for out, index in zip(outs, indices):
            if direct:
                ckpt.read_into(spec.name, index, out)
            else:
                out[...] = one(spec.name, index)  # and the cast, if asked
        ckpt.release(spec.name)
        return outs
    rows = [range(*index[0].indices(plan.shape[0])) for index in indices]
    # A transposed slice is read into a staging buffer first, then transposed into the shard:
    # a transposed copy straight from the file walks the stored tensor by whole rows (4 KiB
    # apart for a 1024-wide float32 weight), of which the caches hold only a few; the staging
    # buffer's rows are spaced to spread over them (up to four times NumPy's strided copy).
    staged = perm is not None and len(perm) > 1 and spec.reshape is None
    # The axis of a row along which it is filled in pieces: the stored tensor's first (whole
    # stored rows). Only from our safetensors reader, which reads any slice alone (the
    # readers of .npz files and of a dict of arrays read the whole tensor each time).
    axis = (perm.index(0) if staged else 0 if direct else None) if ckpt._threads_ok else None

    def fill(j: int, t: int, threads: int, stages: dict) -> None:  # thread t's part of layer j
        for row, index in _pieces(outs, rows, indices, j, axis, threads)[t::threads]:
            if staged and row.size:
                shape = tuple(row.shape[a] for a in np.argsort(perm))  # as stored
                if shape not in stages:
                    stages[shape] = _staging(shape, ckpt.tensors[plan.sources[j]].dtype)
                ckpt.read_into(plan.sources[j], _source(perm, index), stages[shape])
                row[...] = stages[shape].transpose(perm)  # and the cast, if asked
            elif direct:
                ckpt.read_into(plan.sources[j], index, row)
            else:
                row[...] = one(plan.sources[j], index)

    _layer_by_layer(ckpt, plan, sorted(set().union(*rows)), fill)
    return outs


def _layer_by_layer(ckpt: Checkpoint, plan: _Plan, layers: list[int], fill: Any) -> None:
    """Runs ``fill(j, t, threads, stages)`` for every layer j, by each thread t.

    The reads of our safetensors reader and NumPy's copies let go of the GIL: a leaf with
    layers of ``_PARALLEL_BYTES`` or more is filled by ``_THREADS`` threads at once (a
    Checkpoint of your own is read from one thread), each taking every other piece of each
    layer (:func:`_pieces`), whatever the shards, and going through the layers on its own (a
    barrier at each layer cost 15% of the load): the last to be done with a layer lets go of
    its pages, and none runs more than ``_AHEAD`` layers ahead of the slowest, which bounds
    the pages mapped."""
    big = plan.dtype.itemsize * int(np.prod(plan.shape[1:])) >= _PARALLEL_BYTES
    threads = min(_THREADS, os.cpu_count() or 1) if ckpt._threads_ok and big else 1
    left = dict.fromkeys(layers, threads)  # how many threads are yet to fill each layer
    done, failed = [0], []  # layers every thread has filled; whether a thread raised
    turn = threading.Condition()

    def run(t: int) -> None:
        stages: dict = {}  # this thread's staging buffers, by shape
        try:
            for n, j in enumerate(layers):
                with turn:
                    turn.wait_for(lambda n=n: n < done[0] + _AHEAD or failed)
                if failed:
                    return  # another thread's error is raised
                fill(j, t, threads, stages)
                with turn:
                    left[j] -= 1
                    if not left[j]:
                        ckpt.release(plan.sources[j])  # every shard has its slice of layer j
                        done[0] += 1
                        turn.notify_all()
        except BaseException:
            with turn:
                failed.append(True)
                turn.notify_all()
            raise

    if threads == 1:
        run(0)
    else:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(run, range(threads)))


def _source(perm: tuple, index: tuple) -> tuple:
    """The stored tensor's slice that ``index`` (of the leaf's per-layer axes) transposes."""
    inverse = [slice(None)] * len(perm)
    for d, a in enumerate(perm):
        inverse[a] = index[d]
    return tuple(inverse)


def _pieces(outs: list, rows: list, indices: list, j: int, axis: int | None,
            threads: int) -> list[tuple[np.ndarray, tuple]]:
    """Layer j's ``(part of a shard's row, its index)`` to fill: each shard's row of layer j,
    split along the row's ``axis`` (the stored tensor's first: whole stored rows, read in one
    run) into pieces of about ``_PIECE_BYTES``, or whole where ``axis`` is None. A transposed
    piece fits the caches, and its staging buffer with it (a whole 11 MiB layer staged, then
    transposed, cost 1.6x the CPU time of 1 MiB pieces); and every thread gets a share, even
    where one shard holds the layer (one device, or the layer axis over pipeline stages)."""
    holders = [k for k, r in enumerate(rows) if j in r]
    least = threads // math.gcd(len(holders), threads) if holders else 1
    pieces = []
    for k in holders:
        row, index = outs[k][rows[k].index(j), ...], indices[k][1:]  # a view, of a 0-d row too
        if axis is None or not row.ndim or not row.size:
            pieces.append((row, index))
            continue
        start, count = index[axis].start or 0, row.shape[axis]  # a shard's slices: step 1
        n = min(count, max(least, -(-row.nbytes // _PIECE_BYTES)))
        for p in range(n):
            a, b = count * p // n, count * (p + 1) // n
            at = (slice(None),) * axis + (slice(a, b),)
            piece = index[:axis] + (slice(start + a, start + b),) + index[axis + 1:]
            pieces.append((row[at], piece))
    return pieces


def _host(shape: tuple, dtype: np.dtype) -> np.ndarray:
    """``np.empty(shape, dtype)`` in pages of its own (``mmap``): aligned, so jax's CPU client
    makes it the device's buffer as it is, without copying it; in the system's page size
    (NumPy asks for huge pages, which a VM that hands freed memory back to its host backs
    twice as slowly); and populated at once (``MAP_POPULATE``, where the system has it): one
    call backs every page, where a fault at each page's first write cost about twice the CPU
    time (0.55 against 0.28 CPU seconds a GiB on the VM of benchmarks/results; the loads
    onto one device and FSDP over 8 took 15% less CPU and wall time, alternated in one
    process)."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if not nbytes:
        return np.empty(shape, dtype)
    memory = mmap.mmap(-1, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
    return np.frombuffer(memory, dtype).reshape(shape)


def _staging(shape: tuple, dtype: np.dtype) -> np.ndarray:
    """An ``np.empty(shape, dtype)`` whose rows are an odd number of cache lines apart."""
    itemsize = np.dtype(dtype).itemsize
    lines = -(-shape[-1] * itemsize // 64) | 1
    return np.empty((*shape[:-1], lines * 64 // itemsize), dtype)[..., : shape[-1]]


def _zero_copy(devices: Any) -> bool:
    """Whether jax makes an aligned host array these devices' buffer as it is (its CPU client
    does; tests/checkpoint/test_checkpoint_sharded.py checks it)."""
    return all(device.platform == "cpu" for device in devices)


def _build(ckpt: Checkpoint, plan: _Plan) -> jax.Array:
    """The leaf from its distinct shards (one that several devices hold is read once). On CPU
    devices the shards are filled together (:func:`_fill`): their host arrays become the
    device arrays as they are, so they add nothing to the final arrays. On other devices they
    are filled one at a time and copied over, so that the host holds one device's shard of one
    leaf (``jax.make_array_from_callback`` would hold every device's host copy at once)."""
    devices = plan.sharding.addressable_devices_indices_map(plan.shape)
    shards: dict[tuple, tuple] = {}  # the shard's extent -> (its index, its devices)
    for device, index in devices.items():
        index = tuple(index) + (slice(None),) * (len(plan.shape) - len(index))
        key = tuple(s.indices(n) for s, n in zip(index, plan.shape))
        shards.setdefault(key, (index, []))[1].append(device)
    together = _zero_copy(devices)
    groups = [list(shards.values())] if together else [[shard] for shard in shards.values()]
    arrays = {}
    for group in groups:
        hosts = _fill(ckpt, plan, [index for index, _ in group])
        for (_, held), host in zip(group, hosts):
            first = arrays[held[0]] = jax.device_put(host, held[0]).block_until_ready()
            arrays.update({device: jax.device_put(first, device) for device in held[1:]})
        del hosts
    # The dtype, for a process none of whose devices holds a shard (several hosts).
    return jax.make_array_from_single_device_arrays(
        plan.shape, plan.sharding, [arrays[device] for device in devices], dtype=plan.dtype)


def load_checkpoint(
    source: Any,
    target: Any,
    names: Any,
    *,
    shardings: Any = None,
    pattern: int | None = None,
    quantize: Any = None,
) -> Any:
    """Loads a per-layer (or stacked) checkpoint into stacked, sharded params, streamed.

    The plain loop the call replaces reads every layer whole and stacks it
    on the host (two copies of the model in host memory):

    >>> import jax, jax.numpy as jnp, numpy as np, stackwise
    >>> ckpt = {f"model.layers.{i}.mlp.weight": np.full((3, 2), i, np.float32)
    ...         for i in range(4)} | {"lm_head.weight": np.ones((2, 5), np.float32)}
    >>> w = np.stack([ckpt[f"model.layers.{i}.mlp.weight"].T for i in range(4)])
    >>> target = {"blocks": {"w": jax.ShapeDtypeStruct((4, 2, 3), jnp.float32)},
    ...           "head": jax.ShapeDtypeStruct((2, 5), jnp.float32)}
    >>> names = {"blocks": {"w": stackwise.Tensor("model.layers.{}.mlp.weight",
    ...                                           transpose=(1, 0))},
    ...          "head": "lm_head.weight"}
    >>> params = stackwise.load_checkpoint(ckpt, target, names)
    >>> bool((params["blocks"]["w"] == w).all()), params["head"].shape
    (True, (2, 5))

    Nothing is cast unless asked, and every layer must be there:

    >>> try:
    ...     stackwise.load_checkpoint(ckpt, {"w": jax.ShapeDtypeStruct((5, 3, 2), jnp.float32)},
    ...                               {"w": "model.layers.{}.mlp.weight"})
    ... except ValueError as e:
    ...     print(str(e)[:89])
    stackwise.load_checkpoint: layer 4's tensor 'model.layers.4.mlp.weight' for leaf ['w'] is

    With ``quantize``, each layer of the chosen leaves is read, quantized and dropped in turn
    (the float model never whole in memory), giving the bits of
    ``stackwise.quant.quantize(load_checkpoint(...), ...)``:

    >>> q = stackwise.load_checkpoint(ckpt, target, names, quantize="int8")
    >>> q["blocks"]["w"].codes.dtype, q["blocks"]["w"].scale.shape, q["head"].dtype
    (dtype('int8'), (4, 1, 3), dtype('float32'))
    >>> ref = stackwise.quant.quantize(params, "int8")
    >>> bool((q["blocks"]["w"].codes == ref["blocks"]["w"].codes).all())
    True

    Args:
      source: a checkpoint, as :func:`stackwise.open_checkpoint` takes it
        (safetensors files or directory, orbax directory, .npz, dict).
      target: the params to fill: a tree whose array leaves are
        ``jax.ShapeDtypeStruct`` s or arrays (``jax.eval_shape`` of an init,
        any adapter's params, an ``nnx.State``, an Equinox module from
        ``eqx.filter_eval_shape``); leaves that are not arrays are kept.
      names: the target's tree of names, nested by the same keys: a str or
        a :class:`Tensor` per array leaf; ``{}`` marks a per-layer tensor
        and fills a stacked leaf (its leading axis) row by row.
      shardings: None (each leaf's own ``.sharding`` if it has one, else
        the first device), one ``Sharding`` for every leaf, or a tree that
        mirrors the target, of ``Sharding`` s or None (that leaf's default),
        one for a whole subtree allowed (``stackwise.stacked_shardings``,
        ``fsdp_specs``). A ``PartitionSpec`` or a ``Mesh`` alone, a leaf the
        tree misses or a key it has that the target lacks is refused.
      pattern: k for a pattern Stack: the per-layer names then say their
        position (``Tensor(name, position=p)``), whose row j is layer
        ``p + j*k``.
      quantize: None (floats, as stored or cast), a kind (``"int8"``, ``"int4"``,
        ``"nf4"``: every floating leaf that is 2-D per layer), or a
        ``stackwise.quant.Scheme(kind, targets, block_size, double)`` (``targets``,
        ``block_size`` and ``double`` as ``stackwise.quant.quantize`` takes them; the
        double quantization runs on the placed scales, jitted). Each chosen leaf
        becomes a ``stackwise.quant.Quantized``, read and quantized one layer at a
        time: the host holds its codes, scales and one layer's floats. Its codes take
        the float leaf's sharding (a ``NamedSharding`` spec must divide the packed
        4-bit rows too), its scales the same spec, their input axis left whole where
        the blocks do not divide it. Each process reads only what its devices' shards
        are made of: their layers and columns, and whole blocks of rows (all the rows,
        with one scale per column).

    Returns:
      The target with every array leaf loaded, as a ``jax.Array`` with its
      sharding; each device's shard is read from the checkpoint alone. On
      several hosts (JAX processes), every process calls it alike and reads
      its own devices' shards only: together they hold one global array per
      leaf (the first device, without shardings, is process 0's). With
      ``quantize``, each chosen leaf is a ``stackwise.quant.Quantized`` of
      such arrays (codes and scales).

    Raises:
      ValueError: a missing layer or tensor, an extra layer, a shape that
        differs, a template that matches nothing or a tensor that would
        fill two leaves, names for leaves the target lacks, a mesh that does
        not divide a leaf, a ``shardings`` tree that misses a leaf or has
        a key the target lacks, or a truncated or corrupt file; for
        ``quantize``: an unknown kind, a target that is not a floating
        leaf 2-D per layer, a block size that does not divide its inputs,
        or a mesh that does not divide the packed codes. Every check runs
        before anything is read; a target layer holding NaN or inf is
        refused as it is read (scaled by its absmax, its block would be lost).
      TypeError: a dtype that differs without a ``Tensor(..., dtype=)``, a
        bad transform, or ``shardings`` that are not Shardings (a
        ``PartitionSpec`` or a ``Mesh``: ``NamedSharding(mesh, spec)``); a
        ``quantize`` that is neither a kind nor a Scheme, or a quantized
        leaf's sharding that is not named, one device or replicated.
    """
    ckpt = open_checkpoint(source)
    chosen = quantized.choose(target, quantize, _LOAD)
    plans = _plans(ckpt, target, names, shardings, pattern, _LOAD)
    for plan, choice in zip(plans, chosen):
        if plan is not None and choice is not None:
            node = quantized.abstract(*choice, plan.shape, plan.dtype)
            quantized.check_placement(plan.sharding, node, plan.path, _LOAD)
    leaves, treedef = jax.tree_util.tree_flatten(target)
    out = [
        leaf if plan is None
        else _build(ckpt, plan) if choice is None
        else quantized.build(lambda index, plan=plan: _fill(ckpt, plan, [index])[0], *choice,
                             plan.shape, plan.dtype, plan.sharding, plan.path, _LOAD)
        for leaf, plan, choice in zip(leaves, plans, chosen)
    ]
    return jax.tree_util.tree_unflatten(treedef, out)
