"""Stacked params back to a per-layer checkpoint, a group of layers at a time: safetensors
files with Hugging Face's index (:func:`save_safetensors`), or an orbax checkpoint of the
loop's tree (:func:`save_orbax`). Both read the leaves and ``names`` alike, every name and
transform checked before a byte is written (:func:`_rows`), group the layers alike
(:func:`_groups`), and write all or nothing alike: claimed, staged, then moved into place
(:mod:`stackwise._checkpoint.staging`)."""

from __future__ import annotations

import importlib
import json
import os
from typing import Any, NamedTuple

import jax
import numpy as np

from stackwise._checkpoint import hosts, staging
from stackwise._checkpoint.names import (
    Tensor,
    check_layout,
    check_no_finetune_nodes,
    check_not_prng_key,
    check_template,
    is_array,
    lookup,
    resolve_reshape,
)
from stackwise._checkpoint.read import INDEX, SAFETENSORS_DTYPES, need
from stackwise._core import checks, trees
from stackwise._core.served import stacked_only

__all__ = ["save_orbax", "save_safetensors"]

_SAVE = "stackwise.save_safetensors"
_ORBAX = "stackwise.save_orbax"


class _Row(NamedTuple):
    layer: int  # -1: a leaf outside the stack, saved whole
    name: str  # the tensor's name in the checkpoint
    path: str  # the leaf's
    spec: Tensor
    array: Any  # the stacked leaf
    row: int | None  # its row j, or None: the leaf whole


def _stored(plan_spec: Tensor, x: Any) -> Any:
    """One stored tensor from its leaf's row ``x`` (NumPy or jax): the transforms undone
    (checked by :func:`_check_transforms`)."""
    perm = plan_spec.transpose
    if plan_spec.reshape is not None:
        shape = plan_spec.stored_shape
        x = x.reshape(tuple(shape[a] for a in perm) if perm else shape)
    if perm is not None:
        x = x.transpose(tuple(int(a) for a in np.argsort(perm)))
    return x


def _check_transforms(spec: Tensor, inner: tuple, path: str, who: str) -> None:
    """That ``spec``'s transforms undo on a row of the leaf (per-layer shape ``inner``), as
    :func:`_stored` undoes them, before a byte is written."""
    perm, stored = spec.transpose, inner
    if spec.reshape is not None:
        if spec.stored_shape is None:
            raise ValueError(
                f"{who}: leaf {path} is loaded with reshape={spec.reshape}; to save it "
                "back, say the stored per-layer shape: stackwise.Tensor(..., "
                "stored_shape=(...)) (a merge of axes has many inverses)."
            )
        stored = spec.stored_shape
        if resolve_reshape(spec.reshape, int(np.prod(stored))) != tuple(inner):
            raise ValueError(
                f"{who}: leaf {path} has per-layer shape {tuple(inner)}, but its Tensor "
                f"reshapes the stored {stored} (stored_shape) to {spec.reshape}; give the "
                "stored shape whose transposed reshape is the leaf's."
            )
    if perm is not None and sorted(perm) != list(range(len(stored))):
        raise TypeError(
            f"{who}: leaf {path}: `transpose={perm}` is not a permutation of the "
            f"{len(stored)} axes of its stored per-layer shape {tuple(stored)}"
            + (" (a 1-D leaf, a norm or a bias, has nothing to transpose: name it with a "
               "plain str)" if len(stored) == 1 else "")
            + "."
        )


def _check_options(pattern: Any, max_bytes: Any, bytes_arg: str, overwrite: Any,
                   who: str) -> tuple[int | None, int]:
    pattern = None if pattern is None else checks.integer(pattern, who, "pattern", minimum=1)
    max_bytes = checks.integer(max_bytes, who, bytes_arg, minimum=1)
    if not isinstance(overwrite, (bool, np.bool_)):
        raise TypeError(f"{who}: `overwrite` must be True or False, got {overwrite!r}.")
    return pattern, max_bytes


def _rows(params: Any, names: Any, pattern: int | None, who: str,
          dtypes: set[str] | None = None) -> list[_Row]:
    """Every tensor to save, by layer (the leaves outside the stack first), each name once;
    every leaf's name, layout, transforms and dtype (one of ``dtypes``) checked."""
    check_no_finetune_nodes(params, "params", who)
    rows, tensors = [], {}
    flat = [(jax.tree_util.keystr(p) or "<root>", p, a)
            for p, a in jax.tree_util.tree_leaves_with_path(params) if is_array(a)]
    for path, keys, a in flat:
        if trees.is_abstract(a):
            raise TypeError(
                f"{who}: leaf {path} is abstract ({a}, as `jax.eval_shape` gives): it has "
                "no values to save. Pass the params themselves (e.g. as `load_checkpoint` "
                "returns them)."
            )
        check_not_prng_key(a, path, who)
        if dtypes is not None and np.dtype(a.dtype).name not in dtypes:
            raise TypeError(
                f"{who}: leaf {path} is {np.dtype(a.dtype).name}, which safetensors files do "
                f"not hold (they hold {', '.join(sorted(dtypes))}). Cast it on purpose "
                "first, or save with stackwise.save_orbax."
            )
        spec = lookup(names, [trees.key_text(k) for k in keys], path, who)
        check_template(spec, path, who)
        shape = checks.leaf_shape(a, who, path)
        check_layout(spec, shape, pattern, path, who)
        _check_transforms(spec, shape[1:] if spec.per_layer else shape, path, who)
        if spec.per_layer:
            p, step = spec.position or 0, pattern or 1
            for j in range(a.shape[0]):
                rows.append(_Row(p + j * step, spec.name.format(p + j * step), path, spec, a, j))
        else:
            rows.append(_Row(-1, spec.name, path, spec, a, None))
    for r in rows:
        if r.name in tensors:
            raise ValueError(f"{who}: leaves {tensors[r.name]} and {r.path} both save {r.name!r}.")
        tensors[r.name] = r.path
    return sorted(rows, key=lambda r: r.layer)


def _groups(rows: list[_Row], max_bytes: int) -> list[list[_Row]]:
    """Consecutive layers, each group at most ``max_bytes`` (a bigger layer on its own)."""
    nbytes: dict[int, int] = {}
    for r in rows:
        shape = r.array.shape[1:] if r.row is not None else r.array.shape
        nbytes[r.layer] = nbytes.get(r.layer, 0) + int(np.prod(shape)) * np.dtype(
            r.array.dtype).itemsize
    groups, size, current = [[]], 0, None
    for r in rows:
        if r.layer != current:  # a new layer: start a new group if it would not fit
            current = r.layer
            if groups[-1] and size + nbytes[current] > max_bytes:
                groups.append([])
                size = 0
            size += nbytes[current]
        groups[-1].append(r)
    return groups


def save_safetensors(
    params: Any,
    names: Any,
    directory: str | os.PathLike,
    *,
    pattern: int | None = None,
    max_file_bytes: int = 4 << 30,
    overwrite: bool = False,
) -> list[str]:
    """Saves stacked params as a per-layer safetensors checkpoint, a group of layers at a time.

    The inverse of :func:`load_checkpoint` with the same ``names``: each
    stacked leaf's row j is saved as its per-layer name (the transforms
    undone), the others whole. Layers go to files in order, each file at
    most ``max_file_bytes`` (a layer is never split), with a
    ``model.safetensors.index.json`` when there are several; only one file's
    tensors are on the host at a time. The files carry the metadata
    ``{"format": "pt"}``, as ``transformers``' ``save_pretrained`` writes it
    (its readers refuse files without it). A round trip is bitwise (a leaf
    loaded with a cast, ``Tensor(..., dtype=)``, is saved in its own dtype).

    All or nothing: every name, transform and dtype is checked before a
    byte is written. The save claims ``directory`` (the file
    ``<directory>.stackwise-lock`` beside it, holding this writer's host
    and pid: a second save into the same path raises FileExistsError
    naming the first; a claim left by a process of this host that is gone
    is taken over), writes every file into the staging folder
    ``<directory>.stackwise-tmp``, then moves them into place: a new
    ``directory`` is one rename of the whole folder (atomic); into an
    existing folder (one holding a ``config.json``, or ``overwrite=True``)
    the old checkpoint's files are moved aside, then the new ones renamed
    in one by one, the index last (each rename atomic, the whole not: a
    reader meanwhile sees the old checkpoint, an incomplete new one that
    :func:`load_checkpoint` refuses, or the new one, never the two mixed).
    A failure removes what was staged and the claim, and puts back what was
    moved: the old checkpoint stays as it was.

    On several hosts (JAX processes), every process calls it alike: each
    tensor is gathered from the processes' devices, one at a time, and
    process 0 writes the files (``directory`` is process 0's path; host
    memory on process 0 stays about one file's tensors). Process 0's
    findings reach every process: a checkpoint in the way raises
    FileExistsError on each, a write that fails raises its error on process 0
    and RuntimeError on the others, and no process returns before the files
    are in place.

    >>> import jax.numpy as jnp, numpy as np, stackwise, tempfile, os
    >>> params = {"w": jnp.arange(12.0).reshape(3, 2, 2)}
    >>> folder = tempfile.mkdtemp()
    >>> for f in stackwise.save_safetensors(params, {"w": "layers.{}.w"}, folder,
    ...                                     max_file_bytes=32):
    ...     print(os.path.basename(f))
    model-00001-of-00002.safetensors
    model-00002-of-00002.safetensors
    model.safetensors.index.json
    >>> back = stackwise.load_checkpoint(folder, params, {"w": "layers.{}.w"})
    >>> bool((back["w"] == params["w"]).all())
    True

    Args:
      params: the stacked params (sharded or not), as ``load_checkpoint``
        returns them; on several hosts, global ``jax.Array`` s (a NumPy or
        host-local leaf is process 0's own).
      names: the names tree, as for :func:`load_checkpoint`.
      directory: where to write (created if missing).
      pattern: as for :func:`load_checkpoint`.
      max_file_bytes: the most bytes per file (a bigger layer gets a file
        of its own).
      overwrite: replace the checkpoint in ``directory`` (its safetensors
        files and index, all of them); without it, any is an error and
        nothing is written.

    Returns:
      The paths written, the index last.

    Raises:
      FileExistsError: ``directory`` already holds safetensors files or an
        index, or is a file, and ``overwrite`` is False; or another save is
        writing it (its claim named).
      TypeError: an abstract leaf (``jax.ShapeDtypeStruct``: nothing to
        save), a PRNG key leaf (save ``jax.random.key_data(key)``), a dtype
        safetensors does not hold, a ``transpose`` that is not a permutation
        of the leaf's axes, or ``pattern``, ``max_file_bytes`` or
        ``overwrite`` of the wrong type.
      ValueError: as :func:`load_checkpoint` for names that do not fit; on
        several hosts, a leaf on other processes' devices alone (process 0
        cannot read it).
      OSError: a write that fails (on several hosts, on process 0).
      RuntimeError: on several hosts, on the other processes when process
        0's write failed.
    """
    stacked_only(_SAVE, params=params)
    pattern, max_file_bytes = _check_options(pattern, max_file_bytes, "max_file_bytes",
                                             overwrite, _SAVE)
    safetensors_numpy = need("safetensors.numpy", "safetensors", _SAVE)
    directory = os.path.abspath(os.fspath(directory))
    rows = _rows(params, names, pattern, _SAVE, set(SAFETENSORS_DTYPES.values()))
    groups = _groups(rows, max_file_bytes)
    files = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{g + 1:05d}-of-{len(groups):05d}.safetensors" for g in range(len(groups))]
    )
    files += [INDEX] if len(files) > 1 else []
    writer, stage = hosts.Writer(_SAVE, directory), staging.Stage(directory, _SAVE)
    done = False
    try:
        writer.run(stage.take)  # process 0 claims the folder and stages next to it
        writer.settle()
        there = _in_the_way(directory, overwrite, _SAVE, _checkpoint_files)
        weight_map, total = {}, 0
        for file, group in zip(files, groups):  # every process, every row, in the same order
            arrays = {}
            for _, name, path, spec, a, j in group:
                weight_map[name] = file
                x = hosts.host_row(a, j, writer, path)  # None but on process 0
                if x is not None:
                    x = _stored(spec, x)  # (np.ascontiguousarray makes a scalar 1-D)
                    arrays[name] = np.require(x, requirements="C").reshape(x.shape)
                    total += arrays[name].nbytes
            writer.run(_stage, safetensors_numpy.save_file, arrays,
                       os.path.join(stage.new, file), metadata={"format": "pt"})
            del arrays
        if INDEX in files:
            writer.run(_stage, _write_json, {"metadata": {"total_size": total},
                                             "weight_map": weight_map},
                       os.path.join(stage.new, INDEX))
        writer.settle()  # every file staged, on every process's word, before any goes into place
        if os.path.isdir(directory):  # (process 0's view; the others do not write)
            writer.run(stage.replace_files, files, there)
        else:
            writer.run(stage.replace_whole)
        writer.settle()  # and in place before any process returns
        done = True
    finally:
        writer.always(stage.release if done else stage.abandon)
    return [os.path.join(directory, f) for f in files]


def _checkpoint_files(directory: str) -> list[str]:
    """The safetensors files and index in ``directory``, sorted."""
    if not os.path.isdir(directory):
        return []
    return sorted(f for f in os.listdir(directory) if f.endswith(".safetensors") or f == INDEX)


def _held(directory: str) -> list[str]:
    """What is in ``directory``, if it is a folder."""
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def _in_the_way(directory: str, overwrite: bool, who: str, held: Any,
                holds: str = "already holds a checkpoint") -> list[str]:
    """``held(directory)``, what a save would replace there (on process 0; [] on the
    others), once process 0 has found that it may: a file at ``directory``, or anything
    ``held``, is a FileExistsError on every process without ``overwrite``."""
    first = jax.process_index() == 0
    there = held(directory) if first else []
    a_file = first and os.path.lexists(directory) and not os.path.isdir(directory)
    if hosts.agree(a_file and not overwrite):  # process 0's finding, on every process
        raise FileExistsError(
            f"{who}: {directory} is a file, not a folder: a checkpoint is a folder. Pass "
            "the path of a folder (a new one is made), or overwrite=True to replace the file."
        )
    if hosts.agree(bool(there) and not overwrite):
        shown = ", ".join(there[:3]) + (", ..." if len(there) > 3 else "") if there else (
            "as process 0 sees it")
        raise FileExistsError(
            f"{who}: {directory} {holds} ({shown}); stackwise never "
            "overwrites one unless asked: pass overwrite=True, or save to a new directory."
        )
    return there


def _stage(write: Any, value: Any, path: str, **kwargs: Any) -> None:
    """``write(value, path, **kwargs)``, its folder made first."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write(value, path, **kwargs)


def _write_json(value: Any, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)


def _loop_tree(rows: list[_Row], values: list[Any], who: str) -> dict:
    """The loop's tree of ``values``, one per row: each name's parts (split at ".") its keys,
    as orbax's checkpoints name their arrays (and :func:`open_checkpoint` reads them)."""
    tree: dict = {}
    for r, value in zip(rows, values):
        *keys, last = r.name.split(".")
        node = tree
        for k in keys:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                break
        if not isinstance(node, dict) or last in node:
            raise ValueError(
                f"{who}: the tensor {r.name!r} (leaf {r.path}) cannot be a leaf of the loop's "
                "tree (its keys are a name's parts between dots): another name's parts are a "
                "prefix of its own, or its own of another's. Rename one of them."
            )
        node[last] = value
    return tree


def save_orbax(
    params: Any,
    names: Any,
    directory: str | os.PathLike,
    *,
    pattern: int | None = None,
    max_group_bytes: int = 1 << 30,
    overwrite: bool = False,
) -> str:
    """Saves stacked params as an orbax checkpoint in the loop's layout, a group of layers at
    a time.

    The inverse of :func:`load_checkpoint` from an orbax checkpoint, with the
    same ``names``: each tensor's name, split at its dots, is its path in the
    loop's tree (``"layers_{}.up.kernel"``: layer i's leaf at
    ``["layers_i"]["up"]["kernel"]``), row j of each stacked leaf is saved as
    its layer's array (the transforms undone), the other leaves whole. The
    layers are written a group at a time (orbax's partial saves, finalised
    into one checkpoint), each group's slices made on the devices, so no more
    than about ``max_group_bytes`` beyond the params is ever held, on the
    devices or the host. A round trip is bitwise.

    All or nothing, as :func:`save_safetensors`: every name and transform
    is checked before a byte is written, ``directory`` is claimed
    (``<directory>.stackwise-lock``; a second save into it raises
    FileExistsError naming the first), the checkpoint is written into the
    staging folder ``<directory>.stackwise-tmp`` (orbax's partial saves
    included) and renamed into place whole (with ``overwrite=True``, what
    was there is moved aside first and removed after). A failure removes
    the staging folder and the claim and leaves ``directory`` as it was.

    On several hosts (JAX processes), every process calls it alike, with
    the same ``directory`` on a file system they share: orbax writes each
    process's shards, process 0 merges them and renames the checkpoint into
    place, and every process returns once it is there. A checkpoint in the
    way raises FileExistsError on every process.

    >>> import jax, jax.numpy as jnp, stackwise, tempfile, os
    >>> import orbax.checkpoint as ocp
    >>> params = {"up": {"kernel": jnp.arange(12.0).reshape(3, 2, 2)}}
    >>> names = {"up": {"kernel": "layers_{}.up.kernel"}}
    >>> path = stackwise.save_orbax(params, names, os.path.join(tempfile.mkdtemp(), "loop"))
    >>> loop = ocp.StandardCheckpointer().restore(path, jax.eval_shape(
    ...     lambda: {f"layers_{i}": {"up": {"kernel": params["up"]["kernel"][i]}}
    ...              for i in range(3)}))
    >>> loop["layers_2"]["up"]["kernel"].tolist()
    [[8.0, 9.0], [10.0, 11.0]]
    >>> back = stackwise.load_checkpoint(path, params, names)
    >>> bool((back["up"]["kernel"] == params["up"]["kernel"]).all())
    True

    Args:
      params: the stacked params (sharded or not), as ``load_checkpoint``
        returns them.
      names: the names tree, as for :func:`load_checkpoint`; its names'
        parts (between dots) are the loop tree's keys.
      directory: the checkpoint to write (a new folder; its parent is
        created if missing).
      pattern: as for :func:`load_checkpoint`.
      max_group_bytes: the most bytes of layers written at once (a bigger
        layer is written on its own).
      overwrite: replace a checkpoint already at ``directory``; without it,
        an existing ``directory`` that is not empty is an error and nothing
        is written.

    Returns:
      The path of the saved pytree (``directory/state``): what
      :func:`load_checkpoint`, :func:`inspect_checkpoint` and orbax's
      ``StandardCheckpointer().restore`` read.

    Raises:
      FileExistsError: ``directory`` is a file, or a folder that is not
        empty, and ``overwrite`` is False; or another save is writing it
        (its claim named).
      TypeError: an abstract leaf (nothing to save), a PRNG key leaf, a
        ``transpose`` that is not a permutation of the leaf's axes, or
        ``pattern``, ``max_group_bytes`` or ``overwrite`` of the wrong type.
      ValueError: as :func:`load_checkpoint` for names that do not fit, or
        two names of which one's parts are a prefix of the other's.
      ImportError: orbax is missing (``pip install 'stackwise[orbax]'``), or
        too old for partial saves.
      OSError: the final rename fails (on several hosts, on process 0;
        RuntimeError on the others).
    """
    stacked_only(_ORBAX, params=params)
    pattern, max_group_bytes = _check_options(pattern, max_group_bytes, "max_group_bytes",
                                              overwrite, _ORBAX)
    need("orbax.checkpoint", "orbax", _ORBAX)
    try:
        partial = importlib.import_module("orbax.checkpoint.experimental.v1.partial")
    except ImportError:
        raise ImportError(
            f"{_ORBAX} needs orbax's partial saves (orbax.checkpoint.experimental.v1.partial, "
            "in orbax-checkpoint 0.12.8, say), which this orbax-checkpoint lacks: "
            "pip install -U orbax-checkpoint"
        ) from None
    directory = os.path.abspath(os.fspath(directory))
    rows = _rows(params, names, pattern, _ORBAX)
    _loop_tree(rows, rows, _ORBAX)  # every name a leaf of one tree: checked before writing
    groups = _groups(rows, max_group_bytes)
    writer, stage = hosts.Writer(_ORBAX, directory), staging.Stage(directory, _ORBAX)
    done = False
    try:
        writer.run(stage.take)  # process 0 claims the folder and stages next to it
        writer.settle()  # no process writes before the staging folder is there
        _in_the_way(directory, overwrite, _ORBAX, _held, "already exists and is not empty")
        for group in groups:  # on every process: orbax writes each process's shards
            arrays = [_stored(r.spec, hosts.take_row(r.array, r.row)) for r in group]
            partial.save(stage.new, _loop_tree(group, arrays, _ORBAX))
            del arrays
        partial.finalize(stage.new)  # process 0 merges, every process waits for it
        writer.run(stage.replace_whole)
        writer.settle()  # in place before any process returns
        done = True
    finally:
        writer.always(stage.release if done else stage.abandon)
    return os.path.join(directory, "state")
