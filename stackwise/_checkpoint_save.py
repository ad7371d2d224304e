"""Stacked params back to a per-layer safetensors checkpoint, a group of layers at a time."""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

from stackwise import _check
from stackwise._checkpoint_names import (
    Tensor,
    _check_layout,
    _check_template,
    _is_array,
    _key,
    _lookup,
)
from stackwise._checkpoint_read import INDEX, need

__all__ = ["save_safetensors"]

_SAVE = "stackwise.save_safetensors"


def _stored(plan_spec: Tensor, x: np.ndarray, path: str) -> np.ndarray:
    if plan_spec.reshape is not None:
        if plan_spec.stored_shape is None:
            raise ValueError(
                f"{_SAVE}: leaf {path} is loaded with reshape={plan_spec.reshape}; to save it "
                "back, say the stored per-layer shape: stackwise.Tensor(..., "
                "stored_shape=(...)) (a merge of axes has many inverses)."
            )
        perm = plan_spec.transpose
        shape = plan_spec.stored_shape
        x = x.reshape(tuple(shape[a] for a in perm) if perm else shape)
    if plan_spec.transpose is not None:
        x = x.transpose(np.argsort(plan_spec.transpose))
    return np.ascontiguousarray(x)


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
    tensors are on the host at a time. A round trip is bitwise (a leaf loaded
    with a cast, ``Tensor(..., dtype=)``, is saved in its own dtype).

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
        returns them.
      names: the names tree, as for :func:`load_checkpoint`.
      directory: where to write (created if missing).
      pattern: as for :func:`load_checkpoint`.
      max_file_bytes: the most bytes per file (a bigger layer gets a file
        of its own).
      overwrite: replace existing checkpoint files in ``directory``;
        without it, any is an error and nothing is written.

    Returns:
      The paths written, the index last.

    Raises:
      FileExistsError: ``directory`` already holds safetensors files or an
        index and ``overwrite`` is False.
      TypeError: an abstract leaf (``jax.ShapeDtypeStruct``: nothing to
        save), or ``pattern``, ``max_file_bytes`` or ``overwrite`` of the
        wrong type.
      ValueError: as :func:`load_checkpoint` for names that do not fit.
    """
    pattern = None if pattern is None else _check.integer(pattern, _SAVE, "pattern", minimum=1)
    max_file_bytes = _check.integer(max_file_bytes, _SAVE, "max_file_bytes", minimum=1)
    if not isinstance(overwrite, (bool, np.bool_)):
        raise TypeError(f"{_SAVE}: `overwrite` must be True or False, got {overwrite!r}.")
    safetensors_numpy = need("safetensors.numpy", "safetensors", _SAVE)
    directory = os.fspath(directory)
    tensors, rows = {}, []
    flat = [(jax.tree_util.keystr(p) or "<root>", p, a)
            for p, a in jax.tree_util.tree_leaves_with_path(params) if _is_array(a)]
    for path, keys, a in flat:
        if _check.is_abstract(a):
            raise TypeError(
                f"{_SAVE}: leaf {path} is abstract ({a}, as `jax.eval_shape` gives): it has "
                "no values to save. Pass the params themselves (e.g. as `load_checkpoint` "
                "returns them)."
            )
        spec = _lookup(names, [_key(k) for k in keys], path, _SAVE)
        _check_template(spec, path, _SAVE)
        _check_layout(spec, _check.leaf_shape(a, _SAVE, path), pattern, path, _SAVE)
        if spec.per_layer:
            p, step = spec.position or 0, pattern or 1
            for j in range(a.shape[0]):
                name = spec.name.format(p + j * step)
                rows.append((p + j * step, name, path, spec, a, j))
        else:
            rows.append((-1, spec.name, path, spec, a, None))
    for _, name, path, *_ in rows:
        if name in tensors:
            raise ValueError(f"{_SAVE}: leaves {tensors[name]} and {path} both save {name!r}.")
        tensors[name] = path
    rows.sort(key=lambda r: r[0])  # the leaves outside the stack first, then layer by layer
    nbytes = {}
    for layer, _, _, _, a, j in rows:
        shape = a.shape[1:] if j is not None else a.shape
        nbytes[layer] = nbytes.get(layer, 0) + int(np.prod(shape)) * np.dtype(a.dtype).itemsize
    groups, size, current = [[]], 0, None
    for r in rows:
        if r[0] != current:  # a new layer: start a new file if it would not fit
            current = r[0]
            if groups[-1] and size + nbytes[current] > max_file_bytes:
                groups.append([])
                size = 0
            size += nbytes[current]
        groups[-1].append(r)
    files = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{g + 1:05d}-of-{len(groups):05d}.safetensors" for g in range(len(groups))]
    )
    if os.path.isdir(directory) and not overwrite:
        there = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors") or f == INDEX)
        if there:
            raise FileExistsError(
                f"{_SAVE}: {directory} already holds a checkpoint ({', '.join(there[:3])}"
                f"{', ...' if len(there) > 3 else ''}); stackwise never overwrites one unless "
                "asked: pass overwrite=True, or save to a new directory."
            )
    os.makedirs(directory, exist_ok=True)
    written, weight_map, total = [], {}, 0
    for file, group in zip(files, groups):
        arrays = {}
        for _, name, path, spec, a, j in group:
            x = np.asarray(jax.device_get(a[j] if j is not None else a))
            arrays[name] = _stored(spec, x, path)
            weight_map[name] = file
            total += arrays[name].nbytes
        final = os.path.join(directory, file)
        safetensors_numpy.save_file(arrays, final + ".tmp", metadata={"format": "np"})
        os.replace(final + ".tmp", final)
        written.append(final)
        del arrays
    if len(files) > 1:
        index = os.path.join(directory, INDEX)
        with open(index + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        os.replace(index + ".tmp", index)
        written.append(index)
    return written
