"""Opening checkpoints lazily: names, shapes and dtypes first, slices on demand.

A :class:`Checkpoint` knows every tensor's name, shape and dtype and the file
that holds it, and reads any slice of a tensor without reading the rest:
safetensors files through a memory map of the file (the format is a JSON
header and raw little-endian bytes), orbax checkpoints through tensorstore.
The optional libraries are imported only when such a checkpoint is opened.

Why a memory map and not ``safe_open(...).get_slice``: the safetensors
package cannot hand a bfloat16 slice to NumPy (``framework="numpy"`` has no
bfloat16, ``framework="flax"`` would put every slice on a device first). The
file is still validated by ``safe_open`` (a truncated or corrupt file is
refused there), and only the header's offsets are read by hand. After each
read the mapped pages are released (``madvise(MADV_DONTNEED)``), so the
process's memory holds the arrays built, not the files it read.
"""

from __future__ import annotations

import difflib
import glob
import json
import mmap
import os
import pathlib
import zipfile
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from stackwise._core import trees

__all__ = ["Checkpoint", "open_checkpoint"]

INDEX = "model.safetensors.index.json"

SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}  # fmt: skip
_OPEN = "stackwise.open_checkpoint"


def _numpy_dtype(name: str) -> np.dtype:
    import jax.numpy as jnp  # jnp knows bfloat16 and the float8 types (from ml_dtypes)

    return np.dtype(getattr(jnp, name))


def need(module: str, extra: str, who: str) -> Any:
    """Imports an optional library, or says which extra installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError:
        raise ImportError(
            f"{who} needs {module.split('.')[0]} for this checkpoint: "
            f"pip install 'stackwise[{extra}]'"
        ) from None


class Checkpoint:
    """A checkpoint opened lazily: every tensor's name, shape, dtype and file; slices on demand.

    Made by :func:`open_checkpoint`; :func:`stackwise.load_checkpoint` and
    :func:`stackwise.inspect_checkpoint` take one wherever they take a path.

    Attributes:
      kind: ``"safetensors"``, ``"orbax"``, ``"npz"`` or ``"arrays"``.
      where: the path (or a description) of the checkpoint, for messages.
      tensors: ``{name: jax.ShapeDtypeStruct}`` of every tensor.
    """

    def __init__(
        self,
        kind: str,
        where: str,
        tensors: Mapping[str, jax.ShapeDtypeStruct],
        files: Mapping[str, str],
        reader: Callable[[str, tuple], np.ndarray],
        release: Callable[[str], None] | None = None,
        into: Callable[[str, tuple, np.ndarray], bool] | None = None,
    ):
        self.kind, self.where = kind, where
        self.tensors = dict(tensors)
        self._files, self._reader = dict(files), reader
        self._release = release or (lambda name: None)
        self._into = into or (lambda name, index, out: False)
        self._threads_ok = False  # True: its reads may run in several threads at once

    def file_of(self, name: str) -> str:
        """The file (or checkpoint) that holds tensor ``name``."""
        return self._files.get(name, self.where)

    def read(self, name: str, index: tuple = ()) -> np.ndarray:
        """``tensor[index]`` as a NumPy array of its own, reading only that slice."""
        out = np.array(self.view(name, index))
        self.release(name)
        return out

    def view(self, name: str, index: tuple = ()) -> np.ndarray:
        """``tensor[index]``, possibly a read-only view of a mapped file (copy it before
        :meth:`release`), reading only that slice."""
        return self._reader(name, tuple(index))

    def read_into(self, name: str, index: tuple, out: np.ndarray) -> None:
        """``out[...] = tensor[index]``, read straight into ``out`` where the format allows
        (call :meth:`release` when done with ``name``)."""
        if not self._into(name, tuple(index), out):
            out[...] = self.view(name, index)

    def release(self, name: str) -> None:
        """Lets go of the pages that views of ``name`` mapped (they stay in the page cache)."""
        self._release(name)

    def __repr__(self) -> str:
        return f"Checkpoint({self.kind}, {self.where!r}, {len(self.tensors)} tensors)"


# --------------------------------------------------------------------------
# safetensors


def _safetensors_file(path: str, who: str) -> tuple[dict, dict, Callable]:
    safetensors = need("safetensors", "safetensors", who)
    try:
        with safetensors.safe_open(path, framework="numpy"):
            pass  # validates the header against the file's size
    except FileNotFoundError:
        raise ValueError(f"{who}: the safetensors file {path} does not exist.") from None
    except Exception as e:  # noqa: BLE001 -- SafetensorError is not importable by name
        raise ValueError(
            f"{who}: {path} is not a readable safetensors file (truncated or corrupt?): {e}. "
            "Write it again, or check that the download finished."
        ) from None
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    start = 8 + size
    if header:
        fd = os.open(path, os.O_RDONLY)  # kept open, as the map is, while the reader lives
        memmap = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    tensors, views = {}, {}
    for name, entry in header.items():
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(
                f"{who}: tensor {name!r} in {path} has dtype {entry['dtype']}, which stackwise "
                f"does not read (it reads {', '.join(SAFETENSORS_DTYPES)})."
            )
        dtype = _numpy_dtype(SAFETENSORS_DTYPES[entry["dtype"]])
        begin, end = entry["data_offsets"]
        tensors[name] = jax.ShapeDtypeStruct(tuple(entry["shape"]), dtype)
        views[name] = (start + begin, start + end, dtype, tuple(entry["shape"]))

    def mapped(name):
        begin, end, dtype, shape = views[name]
        if os.fstat(fd).st_size < end:  # a mapped page past the end would kill the process
            raise ValueError(f"{who}: {path} ends inside tensor {name!r} (truncated?).")
        return np.frombuffer(memmap, dtype, int(np.prod(shape)), begin).reshape(shape)

    def into(name, index, out):
        """Reads a slice straight into ``out``: one run of bytes into a contiguous ``out`` of
        the tensor's dtype with ``preadv``, else copied (and cast) from the map."""
        begin, _, dtype, shape = views[name]
        run = _contiguous(shape, index)
        if (run is None or out.dtype != dtype or not out.flags.c_contiguous
                or tuple(out.shape) != run[1]):
            out[...] = mapped(name)[index]
            return True
        first = run[0]
        buffer, offset = memoryview(out.reshape(-1).view(np.uint8)), begin + first * dtype.itemsize
        while buffer.nbytes:
            got = os.preadv(fd, [buffer], offset)
            if not got:
                raise ValueError(f"{who}: {path} ends inside tensor {name!r} (truncated?).")
            buffer, offset = buffer[got:], offset + got
        return True

    def read(name, index):
        begin, _, dtype, shape = views[name]
        run = _contiguous(shape, index)
        if run is None:  # a strided slice: from the map, page by page
            return mapped(name)[index]
        out = np.empty(run[1], dtype)  # one run of bytes: read straight into the array
        into(name, index, out)
        return out

    def release(name):
        # The pages read stay in the page cache but leave this process's memory: host memory
        # holds the arrays built, not the files mapped.
        begin, end, _, _ = views[name]
        page = begin - begin % mmap.PAGESIZE
        memmap.madvise(mmap.MADV_DONTNEED, page, end - page)

    return tensors, dict.fromkeys(tensors, path), read, release, into


def _contiguous(shape: tuple, index: tuple) -> tuple[int, tuple] | None:
    """``(first element, shape)`` when ``tensor[index]`` (slices) is one run of a C-order
    tensor's elements, else None."""
    ranges = [
        (s.indices(n) if isinstance(s, slice) else None) for s, n in
        zip(tuple(index) + (slice(None),) * (len(shape) - len(index)), shape)
    ]
    if any(r is None for r in ranges):
        return None
    lengths = [len(range(*r)) for r in ranges]
    partial = [a for a, (r, n) in enumerate(zip(ranges, shape)) if r != (0, n, 1)]
    if partial:
        last = partial[-1]
        if ranges[last][2] != 1 or any(lengths[a] != 1 for a in range(last)):
            return None
    strides = np.cumprod((1, *shape[:0:-1]))[::-1]  # elements per step of each axis
    first = int(sum(r[0] * st for r, st in zip(ranges, strides)))
    return first, tuple(lengths)


def _safetensors(paths: Sequence[str], where: str, who: str) -> Checkpoint:
    tensors, files, readers, releases, intos = {}, {}, {}, {}, {}
    for path in paths:
        t, f, r, release, into = _safetensors_file(path, who)
        for name in t:
            if name in tensors:
                raise ValueError(
                    f"{who}: tensor {name!r} is in two files, {files[name]} and {path}; "
                    "a checkpoint holds each tensor once. Pass only the files of one "
                    "checkpoint (or its directory with the index)."
                )
        tensors.update(t), files.update(f), readers.update(dict.fromkeys(t, r))
        releases.update(dict.fromkeys(t, release)), intos.update(dict.fromkeys(t, into))
    ckpt = Checkpoint("safetensors", where, tensors, files, lambda n, i: readers[n](n, i),
                      lambda n: releases[n](n), lambda n, i, out: intos[n](n, i, out))
    ckpt._threads_ok = True  # preadv and copies from the map, which let go of the GIL
    return ckpt


def _index(path: str, who: str) -> Checkpoint:
    try:
        with open(path, "rb") as f:
            weight_map = json.loads(f.read().decode("utf-8"))["weight_map"]
        if not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError
    except (ValueError, KeyError, TypeError, AttributeError):  # not UTF-8, not JSON, ...
        raise ValueError(
            f"{who}: {path} is not a safetensors index (a JSON object with a "
            "'weight_map' of tensor names to files). Check that the download finished, or "
            "pass the safetensors files themselves."
        ) from None
    folder = os.path.dirname(path)
    paths = sorted({os.path.join(folder, file) for file in weight_map.values()})
    ckpt = _safetensors(paths, path, who)
    for name, file in weight_map.items():
        if name not in ckpt.tensors:
            raise ValueError(
                f"{who}: the index {path} puts tensor {name!r} in {file}, which does not "
                "hold it; the index and the files are of different checkpoints."
            )
    return ckpt


# --------------------------------------------------------------------------
# orbax (a pytree checkpoint: one array per leaf, read with tensorstore)


def _orbax(path: str, who: str) -> Checkpoint:
    ocp = need("orbax.checkpoint", "orbax", who)
    ts = need("tensorstore", "orbax", who)
    path = os.path.abspath(path)
    try:
        # (the handler reads the same tree as StandardCheckpointer().metadata(path), without
        # that one's absl warning about a checkpoint-level metadata file it does not need)
        meta = ocp.StandardCheckpointHandler().metadata(pathlib.Path(path))
    except Exception as e:  # noqa: BLE001 -- orbax raises many kinds here
        raise ValueError(f"{who}: {path} is not a readable orbax checkpoint: {e}") from None
    tree = getattr(meta, "tree", meta)
    if not tree:
        raise ValueError(
            f"{who}: {path} is not a readable orbax checkpoint: orbax finds no arrays' "
            "metadata in it. Pass the folder of one saved pytree (a CheckpointManager's "
            "<dir>/<step>/<item>)."
        )
    driver = "zarr3" if getattr(meta, "use_zarr3", False) else "zarr"
    ocdbt = os.path.exists(os.path.join(path, "manifest.ocdbt"))
    tensors, stores = {}, {}
    for keys, leaf in jax.tree_util.tree_leaves_with_path(tree):
        name = getattr(leaf, "name", None) or ".".join(trees.key_text(k) for k in keys)
        tensors[name] = jax.ShapeDtypeStruct(tuple(leaf.shape), np.dtype(leaf.dtype))

    def store(name):
        if name not in stores:
            kv = (
                {"driver": "ocdbt", "base": f"file://{path}/", "path": name}
                if ocdbt
                else {"driver": "file", "path": os.path.join(path, name)}
            )
            stores[name] = ts.open({"driver": driver, "kvstore": kv}, open=True).result()
        return stores[name]

    def read(name, index):
        return np.asarray(store(name)[index].read().result())

    return Checkpoint("orbax", path, tensors, {}, read)



# --------------------------------------------------------------------------


def _npz(path: str, who: str) -> Checkpoint:
    """An ``.npz`` file: its members' headers now, each member read whole when asked (the
    file opened for each read)."""
    broken = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error)
    try:
        zipfile.ZipFile(path).close()  # (NumPy would leave its file open on a broken zip)
        tensors = {}
        with np.load(path) as npz:
            for name in npz.files:  # the headers only; NumPy reads a member whole when asked
                with npz.zip.open(name + ".npy") as member:
                    header = (
                        np.lib.format.read_array_header_1_0
                        if np.lib.format.read_magic(member) == (1, 0)
                        else np.lib.format.read_array_header_2_0
                    )
                    shape, _, dtype = header(member)
                tensors[name] = jax.ShapeDtypeStruct(shape, dtype)
    except broken as e:
        raise ValueError(
            f"{who}: {path} is not a readable .npz file (empty, truncated or corrupt?): "
            f"{type(e).__name__}: {e}. Write it again, or check that the copy finished."
        ) from None

    def read(name, index):
        try:
            with np.load(path) as npz:  # opened per read: no file is held open between
                return np.asarray(npz[name][index])
        except broken as e:
            raise ValueError(
                f"{who}: tensor {name!r} in {path} cannot be read (truncated or corrupt?): "
                f"{type(e).__name__}: {e}. Write the file again."
            ) from None

    return Checkpoint("npz", path, tensors, {}, read)


def _nearby(path: str) -> str:
    """The end of a sentence: ``; did you mean ...?`` with the names closest to ``path``'s in
    its folder, if any, else ``.``."""
    folder, name = os.path.split(os.path.abspath(path))
    try:
        there = os.listdir(folder)
    except OSError:
        return f" (nor does its folder {folder})." if not os.path.isdir(folder) else "."
    close = difflib.get_close_matches(name, there, n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(os.path.join(folder, c)) for c in close)}?" \
        if close else "."


def _orbax_items(path: str) -> list[str]:
    """The orbax pytree checkpoints one or two folders below ``path`` (a CheckpointManager's
    step ``<step>/<item>``, or its directory ``<dir>/<step>/<item>``), sorted."""
    found = []
    for depth in ("*", os.path.join("*", "*")):
        for item in sorted(glob.glob(os.path.join(glob.escape(path), depth))):
            if os.path.exists(os.path.join(item, "_METADATA")):
                found.append(item)
        if found:
            break
    return found


def _arrays(arrays: Mapping[str, Any], where: str) -> Checkpoint:
    tensors = {}
    for name, a in arrays.items():
        dtype = getattr(a, "dtype", None) or np.asarray(a).dtype
        tensors[name] = jax.ShapeDtypeStruct(tuple(np.shape(a)), np.dtype(dtype))
    return Checkpoint("arrays", where, tensors, {}, lambda n, i: np.asarray(arrays[n])[i])


def open_checkpoint(source: Any) -> Checkpoint:
    """Opens a checkpoint lazily: its names, shapes and dtypes now, its bytes when read.

    >>> import numpy as np, stackwise
    >>> ckpt = stackwise.open_checkpoint({"layers.0.w": np.zeros((2, 3), np.float32)})
    >>> ckpt.tensors["layers.0.w"].shape, ckpt.read("layers.0.w", (slice(0, 1),)).shape
    ((2, 3), (1, 3))

    Args:
      source: one of
        - a ``.safetensors`` file, a list of them, a directory of them, a
          directory with a ``model.safetensors.index.json`` or that index
          file itself (``pip install 'stackwise[safetensors]'``);
        - an orbax checkpoint directory (a pytree checkpoint, e.g. one item
          of a ``CheckpointManager`` step: ``<dir>/<step>/<item>``, or a
          directory whose pytree is ``<dir>/state``, as orbax's v1 API and
          :func:`stackwise.save_orbax` write it;
          ``pip install 'stackwise[orbax]'``);
        - an ``.npz`` file (each tensor is read whole, as NumPy does);
        - a dict of arrays (NumPy or jax), by name;
        - a :class:`Checkpoint`, returned as it is.

    Returns:
      A :class:`Checkpoint`.

    Raises:
      ValueError: a path that is none of these, a truncated or corrupt file,
        a tensor in two files, an index that disagrees with its files.
      ImportError: the reader's library is missing (the message gives the
        ``pip install``).
    """
    if isinstance(source, Checkpoint):
        return source
    if isinstance(source, Mapping):
        return _arrays(source, "the dict of arrays")
    if isinstance(source, (list, tuple)):
        if not source:
            raise ValueError(
                f"{_OPEN}: no files given (`source` is an empty {type(source).__name__}); "
                "pass the checkpoint's safetensors files, or its directory."
            )
        paths = [os.fspath(p) for p in source]
        return _safetensors(paths, ", ".join(paths), _OPEN)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"{_OPEN}: `source` must be a path (safetensors, orbax, .npz), a list of "
            f"safetensors files or a dict of arrays, got {type(source).__name__}."
        )
    path = os.fspath(source)
    if not os.path.exists(path):
        raise ValueError(f"{_OPEN}: {path} does not exist{_nearby(path)}")
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, INDEX)):
            return _index(os.path.join(path, INDEX), _OPEN)
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if files:
            return _safetensors([os.path.join(path, f) for f in files], path, _OPEN)
        if any(os.path.exists(os.path.join(path, m)) for m in ("_METADATA", "manifest.ocdbt")):
            return _orbax(path, _OPEN)
        if os.path.exists(os.path.join(path, "state", "_METADATA")):  # orbax v1's layout:
            return _orbax(os.path.join(path, "state"), _OPEN)  # (stackwise.save_orbax's)
        items = _orbax_items(path)
        raise ValueError(
            f"{_OPEN}: the directory {path} holds no safetensors files, no {INDEX} and no "
            "orbax checkpoint (_METADATA). For a CheckpointManager's directory, pass one "
            "step's item: <dir>/<step>/<item>"
            + (f"; here, e.g. {items[-1]} (of {len(items)} found)." if items else ".")
        )
    if path.endswith(".json"):
        return _index(path, _OPEN)
    if path.endswith(".safetensors"):
        return _safetensors([path], path, _OPEN)
    if path.endswith(".npz"):
        return _npz(path, _OPEN)
    raise ValueError(
        f"{_OPEN}: cannot tell what checkpoint {path} is: pass a .safetensors file, a "
        f"directory with safetensors files or {INDEX}, an orbax checkpoint directory or an "
        ".npz file."
    )
