"""Per-layer checkpoints straight into stacked, sharded params, and back, streamed.

The names follow the conversion vocabulary (``docs/conversion.md``): a name
with ``{}`` is a per-layer tensor, ``{}`` standing for the layer index, and
fills a stacked leaf (row j = layer j; with ``pattern=k`` position p's row j
= layer ``p + j*k``); a name without ``{}`` fills a leaf whole (embeddings,
a final norm, or a checkpoint that is already stacked). Every check runs
before a byte is read, so nothing is ever partly loaded, and each device's
shard is built from the slices it needs only, one device at a time, each
layer's slice copied straight into it: host memory beyond the final arrays
stays about one device's shard of one leaf.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, Sharding, SingleDeviceSharding

from stackwise._checkpoint_read import INDEX, Checkpoint, need, open_checkpoint

__all__ = [
    "CheckpointLayout", "Tensor", "inspect_checkpoint", "load_checkpoint", "save_safetensors",
]

_LOAD = "stackwise.load_checkpoint"
_SAVE = "stackwise.save_safetensors"
_INSPECT = "stackwise.inspect_checkpoint"


@dataclasses.dataclass(frozen=True)
class Tensor:
    """Where one leaf comes from in a checkpoint, and how it is turned into the leaf.

    The transforms apply to each stored tensor (one layer's, for a name with
    ``{}``) in this order: ``transpose``, then ``reshape``, then the cast to
    ``dtype``. Saving applies them backwards.

    >>> import jax.numpy as jnp, stackwise
    >>> q = stackwise.Tensor("model.layers.{}.self_attn.q_proj.weight", transpose=(1, 0))
    >>> q.name.format(3)
    'model.layers.3.self_attn.q_proj.weight'

    Attributes:
      name: the tensor's name in the checkpoint, ``{}`` for the layer index.
      transpose: a permutation of the stored tensor's axes (torch's
        ``Linear`` keeps ``(out, in)``, JAX layers ``(in, out)``: ``(1, 0)``).
      reshape: the leaf's per-layer shape after the transpose (split or
        merge heads: ``(H*D, E)`` stored, ``(E, H, D)`` wanted).
      dtype: cast to this dtype (it must be the leaf's); without it, a
        dtype that differs from the leaf's is an error, never a cast.
      position: with ``pattern=k``, the pattern position (0..k-1) whose
        stacked leaf this is; its row j is layer ``position + j*k``.
      stored_shape: the stored per-layer shape, needed only to save a leaf
        with ``reshape`` back (the merge has many inverses).
    """

    name: str
    transpose: tuple[int, ...] | None = None
    reshape: tuple[int, ...] | None = None
    dtype: Any = None
    position: int | None = None
    stored_shape: tuple[int, ...] | None = None

    @property
    def per_layer(self) -> bool:
        """Whether ``name`` has ``{}`` (one tensor per layer)."""
        return "{}" in self.name


class CheckpointLayout(NamedTuple):
    """What :func:`inspect_checkpoint` finds in a checkpoint.

    Attributes:
      kind: ``"safetensors"``, ``"orbax"``, ``"npz"`` or ``"arrays"``.
      layout: ``"per-layer"`` (names with a layer index), ``"stacked"``
        (no layer index; most tensors share a leading axis, the depth), or
        ``"flat"`` (neither).
      depth: the number of layers, or None.
      pattern: the smallest k such that each per-layer name is in layers
        of whole residue classes mod k (1: every layer has every name).
      names: the per-layer names (``{}`` for the index), sorted.
      other: the other tensors' names, sorted.
    """

    kind: str
    layout: str
    depth: int | None
    pattern: int | None
    names: list[str]
    other: list[str]


# --------------------------------------------------------------------------
# Finding the layers by name.


def _regex(template: str) -> re.Pattern:
    return re.compile("^" + r"(\d+)".join(map(re.escape, template.split("{}"))) + "$")


def _layers_of(template: str, names: Sequence[str]) -> dict[int, str]:
    """``{layer: name}`` of every name that ``template`` (one ``{}``) matches."""
    regex, found = _regex(template), {}
    for name in names:
        m = regex.match(name)
        if m and str(int(m.group(1))) == m.group(1):
            found[int(m.group(1))] = name
    return found


def _templates(names: Sequence[str]) -> dict[str, dict[int, str]]:
    """Per-layer templates: a number that is a whole component of a name (``layers.3.w``,
    ``layers_3/w``, not ``ln1``) replaced by ``{}``; the widest kept."""
    options: dict[str, dict[int, str]] = {}
    for name in names:
        for m in re.finditer(r"(?<![^./_])\d+(?![^./])", name):  # a whole name component
            options.setdefault(name[: m.start()] + "{}" + name[m.end() :], {})
            options[name[: m.start()] + "{}" + name[m.end() :]][int(m.group())] = name
    # The layer index is the number run that varies most: widest templates first, each
    # name in one template.
    chosen: dict[str, dict[int, str]] = {}
    taken: set[str] = set()
    for t, found in sorted(options.items(), key=lambda tv: (-len(tv[1]), tv[0])):
        if len(found) > 1 and not taken & set(found.values()):
            chosen[t] = found
            taken |= set(found.values())
    return chosen


def inspect_checkpoint(source: Any) -> CheckpointLayout:
    """Says whether a checkpoint is per-layer or stacked, how deep, which pattern, which names.

    >>> import numpy as np, stackwise
    >>> arrays = {f"model.layers.{i}.mlp.weight": np.zeros((4, 2)) for i in range(6)}
    >>> arrays |= {f"model.layers.{i}.attn.weight": np.zeros(2) for i in range(0, 6, 3)}
    >>> layout = stackwise.inspect_checkpoint(arrays | {"lm_head.weight": np.zeros(2)})
    >>> layout.layout, layout.depth, layout.pattern
    ('per-layer', 6, 3)
    >>> layout.names, layout.other
    (['model.layers.{}.attn.weight', 'model.layers.{}.mlp.weight'], ['lm_head.weight'])

    Args:
      source: anything :func:`stackwise.open_checkpoint` opens.

    Returns:
      A :class:`CheckpointLayout`.
    """
    ckpt = open_checkpoint(source)
    names = sorted(ckpt.tensors)
    templates = _templates(names)
    covered = {n for found in templates.values() for n in found.values()}
    other = [n for n in names if n not in covered]
    if templates:
        depth = 1 + max(max(f) for f in templates.values())
        k = next(
            k
            for k in range(1, depth + 1)
            if all(set(f) == {i for i in range(depth) if i % k in {j % k for j in f}}
                   for f in templates.values())
        )
        return CheckpointLayout(ckpt.kind, "per-layer", depth, k, sorted(templates), other)
    leading = [s.shape[0] for s in ckpt.tensors.values() if len(s.shape) >= 2]
    if leading:
        d = max(set(leading), key=leading.count)
        if leading.count(d) * 2 > len(leading) and leading.count(d) > 1:
            return CheckpointLayout(ckpt.kind, "stacked", d, None, [], names)
    return CheckpointLayout(ckpt.kind, "flat", None, None, [], names)


# --------------------------------------------------------------------------
# Matching the names to the target's leaves.


def _key(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _is_array(leaf: Any) -> bool:
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype")


def _is_name(x: Any) -> bool:
    return isinstance(x, (str, Tensor))


def _lookup(names: Any, keys: list[str], path: str, who: str) -> Tensor:
    node, walked = names, []
    for i, k in enumerate(keys):
        if _is_name(node):
            if keys[i:] == ["value"]:  # an NNX Variable's value
                break
            raise ValueError(
                f"{who}: `names` gives the tensor {_as_tensor(node).name!r} at "
                f"{'/'.join(walked)}, but the target has a subtree there (leaf {path}); "
                "give a name per leaf."
            )
        entries = (
            {str(key): v for key, v in node.items()}
            if isinstance(node, Mapping)
            else {str(j): v for j, v in enumerate(node)}
            if isinstance(node, (list, tuple))
            else {}
        )
        if k not in entries:
            close = difflib.get_close_matches(k, list(entries), n=1)
            raise ValueError(
                f"{who}: `names` has no tensor name for the target's leaf {path} (no entry "
                f"{k!r} under {'/'.join(walked) or 'the top'}"
                + (f"; did you mean {close[0]!r}?" if close else f"; it has {sorted(entries)}")
                + "). Give every array leaf of the target a name, nested as the target is, "
                "e.g. {'params': {'w': 'model.layers.{}.w'}}."
            )
        node, walked = entries[k], walked + [k]
    if not _is_name(node):
        raise ValueError(
            f"{who}: `names` has a subtree, not a name, for the target's leaf {path}."
        )
    return _as_tensor(node)


def _as_tensor(name: Any) -> Tensor:
    return name if isinstance(name, Tensor) else Tensor(name)


def _name_leaves(names: Any) -> list[str]:
    out = []

    def walk(node, prefix):
        if _is_name(node):
            out.append("/".join(prefix))
        elif isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, prefix + [str(k)])
        elif isinstance(node, (list, tuple)):
            for j, v in enumerate(node):
                walk(v, prefix + [str(j)])

    walk(names, [])
    return out


def _check_template(spec: Tensor, path: str, who: str) -> None:
    if not isinstance(spec.name, str):
        raise TypeError(f"{who}: the name of leaf {path} must be a str, got {spec.name!r}.")
    if spec.name.count("{}") > 1 or re.search(r"\{[^}]", spec.name):
        raise ValueError(
            f"{who}: the name {spec.name!r} of leaf {path} must have one `{{}}` for the "
            "layer index (or none for a tensor that is not per layer), e.g. "
            "'model.layers.{}.mlp.up_proj.weight'."
        )


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
        if int(np.prod(spec.reshape)) != int(np.prod(shape)):
            raise ValueError(
                f"{who}: leaf {path}: tensor {name!r} in {_where(ckpt, name)} has shape "
                f"{shape} (after the transpose), which cannot be reshaped to {spec.reshape}."
            )
        shape = tuple(spec.reshape)
    return shape


def _plan_leaf(ckpt, path, leaf, spec, k, sharding, who) -> _Plan:
    _check_template(spec, path, who)
    shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
    if spec.position is not None and (k is None or not 0 <= spec.position < k):
        raise ValueError(
            f"{who}: leaf {path} has position={spec.position}, which needs `pattern=k` with "
            f"k > {spec.position} (got pattern={k})."
        )
    if spec.per_layer:
        if k is not None and k > 1 and spec.position is None:
            raise ValueError(
                f"{who}: with pattern={k}, the per-layer name {spec.name!r} of leaf {path} "
                "needs the pattern position it fills: stackwise.Tensor(name, position=p), "
                "p in 0..k-1 (its row j is layer p + j*k)."
            )
        if not shape:
            raise ValueError(
                f"{who}: leaf {path} is a scalar, so it has no layer axis for the "
                f"per-layer name {spec.name!r}; give it a name without `{{}}`."
            )
        p, step = spec.position or 0, k or 1
        layers = [p + j * step for j in range(shape[0])]
        found = _layers_of(spec.name, list(ckpt.tensors))
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
    _check_sharding(sharding, shape, path, who)
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


def _check_sharding(sharding: Any, shape: tuple, path: str, who: str) -> None:
    if not isinstance(sharding, Sharding):
        raise TypeError(
            f"{who}: the sharding for leaf {path} is {type(sharding).__name__}, not a "
            "jax.sharding.Sharding; build them with stackwise.stacked_shardings or "
            "NamedSharding(mesh, spec)."
        )
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec)
        if len(spec) > len(shape):
            raise ValueError(
                f"{who}: leaf {path} has shape {shape} but its sharding's spec "
                f"{sharding.spec} names {len(spec)} axes. Stacked leaves' specs include the "
                "layer axis: build them with stackwise.stacked_shardings(mesh, specs)."
            )
        for d, entry in enumerate(spec):
            axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
            size = int(np.prod([sharding.mesh.shape[a] for a in axes]))
            if shape[d] % size:
                raise ValueError(
                    f"{who}: leaf {path} has shape {shape}; axis {d} (length {shape[d]}) "
                    f"cannot be split over mesh axes {entry!r} of size {size} (spec "
                    f"{sharding.spec}). Shard another axis (stackwise.fsdp_specs picks one "
                    "that divides) or leave this one unsharded."
                )


def _shardings_by_path(shardings: Any, target: Any) -> dict[str, Any]:
    if shardings is None or isinstance(shardings, Sharding):
        return {}
    is_leaf = lambda s: s is None or isinstance(s, Sharding)  # noqa: E731
    return {
        jax.tree_util.keystr(p): s
        for p, s in jax.tree_util.tree_leaves_with_path(shardings, is_leaf=is_leaf)
    }


def _plans(ckpt, target, names, shardings, pattern, who) -> list[_Plan | None]:
    if pattern is not None and (isinstance(pattern, bool) or not isinstance(pattern, int)
                                or pattern < 1):
        raise TypeError(f"{who}: `pattern` must be None or a positive int k, got {pattern!r}.")
    by_path = _shardings_by_path(shardings, target)
    default = shardings if isinstance(shardings, Sharding) else None
    plans, used, seen = [], set(), {}
    for keys, leaf in jax.tree_util.tree_leaves_with_path(target):
        if not _is_array(leaf):
            plans.append(None)  # functions, static numbers: kept as they are
            continue
        path = jax.tree_util.keystr(keys) or "<root>"
        spec = _lookup(names, [_key(k) for k in keys], path, who)
        used.add("/".join(_key(k) for k in keys if _key(k) != "value"))
        sharding = by_path.get(jax.tree_util.keystr(keys)) or default
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
    extra = [n for n in _name_leaves(names) if n not in used]
    if extra:
        raise ValueError(
            f"{who}: `names` has entries for leaves the target does not have: {extra}; "
            "a misspelt key would leave its tensors behind. Remove them or fix the key."
        )
    # The checkpoint's layers beyond the target's: they would be left behind.
    wanted: dict[str, set[int]] = {}
    for plan in plans:
        if plan is not None and plan.sources is not None:
            found = _layers_of(plan.spec.name, plan.sources)
            wanted.setdefault(plan.spec.name, set()).update(found)
    for template, layers in wanted.items():
        found = _layers_of(template, list(ckpt.tensors))
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


def _reader(ckpt: Checkpoint, plan: _Plan):
    """``callback(index) -> the shard``, reading each layer's slice straight into it."""
    spec = plan.spec
    perm = tuple(spec.transpose) if spec.transpose is not None else None

    def one(name: str, index: tuple) -> np.ndarray:  # a view or a copy; the caller copies
        if spec.reshape is not None:
            x = ckpt.view(name, ())
            return (x.transpose(perm) if perm else x).reshape(spec.reshape)[index]
        if perm:
            inverse = [slice(None)] * len(perm)
            for d, a in enumerate(perm):
                inverse[a] = index[d]
            return ckpt.view(name, tuple(inverse)).transpose(perm)
        return ckpt.view(name, index)

    def callback(index: tuple) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(plan.shape) - len(index))
        if plan.sources is None:
            out = np.array(one(spec.name, index), dtype=plan.dtype)  # the cast, if asked
            ckpt.release(spec.name)
            return out
        rows = range(*index[0].indices(plan.shape[0]))
        inner = tuple(len(range(*s.indices(d))) for s, d in zip(index[1:], plan.shape[1:]))
        out = np.empty((len(rows), *inner), plan.dtype)
        direct = perm is None and spec.reshape is None  # and any cast: read_into falls back
        for r, j in enumerate(rows):  # one layer's slice at a time, copied (and cast) once
            if direct:
                ckpt.read_into(plan.sources[j], index[1:], out[r])
                continue
            out[r] = one(plan.sources[j], index[1:])
            ckpt.release(plan.sources[j])
        return out

    return callback


def _build(plan: _Plan, callback) -> jax.Array:
    """The leaf, one device's shard at a time (``jax.make_array_from_callback`` would hold
    every device's host copy of the leaf at once); a shard that several devices hold is read
    once."""
    arrays, built = [], {}
    for device, index in plan.sharding.addressable_devices_indices_map(plan.shape).items():
        key = tuple(s.indices(d) for s, d in zip(index, plan.shape))
        if key in built:
            arrays.append(jax.device_put(built[key], device))
            continue
        host = callback(index)
        built[key] = jax.device_put(host, device).block_until_ready()
        del host
        arrays.append(built[key])
    return jax.make_array_from_single_device_arrays(plan.shape, plan.sharding, arrays)


def load_checkpoint(
    source: Any,
    target: Any,
    names: Any,
    *,
    shardings: Any = None,
    pattern: int | None = None,
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
        the first device), one ``Sharding`` for all, or a tree of them like
        the target (``stackwise.stacked_shardings``, ``fsdp_specs``).
      pattern: k for a pattern Stack: the per-layer names then say their
        position (``Tensor(name, position=p)``), whose row j is layer
        ``p + j*k``.

    Returns:
      The target with every array leaf loaded, as a ``jax.Array`` with its
      sharding; each device's shard is read from the checkpoint alone.

    Raises:
      ValueError: a missing layer or tensor, an extra layer, a shape that
        differs, a template that matches nothing or a tensor that would
        fill two leaves, names for leaves the target lacks, a mesh that does
        not divide a leaf, or a truncated or corrupt file. Every check runs
        before anything is read.
      TypeError: a dtype that differs without a ``Tensor(..., dtype=)``, or
        a bad transform or sharding.
    """
    ckpt = open_checkpoint(source)
    plans = _plans(ckpt, target, names, shardings, pattern, _LOAD)
    leaves, treedef = jax.tree_util.tree_flatten(target)
    out = [
        leaf
        if plan is None
        else _build(plan, _reader(ckpt, plan))
        for leaf, plan in zip(leaves, plans)
    ]
    return jax.tree_util.tree_unflatten(treedef, out)


# --------------------------------------------------------------------------
# Saving, streamed: a group of layers in host memory at a time.


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
      ValueError: as :func:`load_checkpoint` for names that do not fit.
    """
    safetensors_numpy = need("safetensors.numpy", "safetensors", _SAVE)
    directory = os.fspath(directory)
    tensors, rows = {}, []
    flat = [(jax.tree_util.keystr(p) or "<root>", p, a)
            for p, a in jax.tree_util.tree_leaves_with_path(params) if _is_array(a)]
    for path, keys, a in flat:
        spec = _lookup(names, [_key(k) for k in keys], path, _SAVE)
        _check_template(spec, path, _SAVE)
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
