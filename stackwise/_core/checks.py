"""The checks every public function shares, written once (jax and numpy only).

Each public function of the core and of the adapters checks its shared kinds of argument
here, first thing, so that the same mistake reads the same everywhere. Every check takes
the value, ``who`` (the public function, as messages name it: ``"stackwise.fsdp_specs"``)
and the argument's name as the user wrote it (``arg``), and returns the value normalised,
or raises a TypeError (wrong kind of value) / ValueError (right kind, wrong value) /
IndexError (a layer index out of range) that names the argument or leaf, says what came,
what was expected and the fix.

Meshes, axes and specs:

- :func:`mesh`: a ``jax.sharding.Mesh`` or ``AbstractMesh`` (or None where allowed).
- :func:`axis_names`: one mesh axis name or a sequence of them, as a tuple (a str is one
  name, never split into characters); with a mesh, every name must be one of its axes.
- :func:`axis_entry`: a ``PartitionSpec`` entry for one dimension (None, a name, or a
  tuple of names), e.g. a layer axis.
- :func:`partition_spec`: a ``PartitionSpec`` (or None where allowed); a str or a tuple is
  refused with the spec it probably meant.
- :func:`spec_names` / :func:`spec_on_mesh`: the axes a spec uses; all of them the mesh's.
- :func:`mesh_lacks`: which of some axis names a mesh lacks (for checks at call time).

Integers and layer indices:

- :func:`integer`: a Python or NumPy integer, never a bool, optionally with a minimum.
- :func:`prng_key`: one PRNG key (typed or raw), not a seed or a batch of keys.
- :func:`layer_number`: ``i`` with ``-n <= i < n`` (int or NumPy integer), as ``0 <= i < n``.

Params trees, concrete or abstract (the tree helpers themselves are in
:mod:`stackwise._core.trees`):

- :func:`leaf_shape` / :func:`leaf_dtype`: a leaf's shape and own dtype (a NumPy array's
  as it is; a Python scalar's as NumPy gives it); anything else is refused, named.
- :func:`depth`: the common leading-axis length of every leaf (ValueError listing them).
- :func:`check_depth`: every leaf's leading axis is ``n`` (ValueError listing those not).
- :func:`carry`: a layer returned its carry with the structure, shapes and dtypes it got.
- :func:`not_split_over_layers`: no params leaf is split over a mesh axis along its layer axis.

Dtypes:

- :func:`same_array_kind`: NumPy and JAX arrays are the same kind of value.
- :func:`exact_dtype`: the dtype a leaf gets as a JAX array equals its own, or a
  TypeError naming the leaf and the dtype (e.g. NumPy int64 with x64 off).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from stackwise._core import trees

__all__ = [
    "axis_entry",
    "axis_names",
    "carry",
    "check_depth",
    "depth",
    "exact_dtype",
    "integer",
    "layer_number",
    "leaf_dtype",
    "leaf_shape",
    "mesh",
    "mesh_lacks",
    "not_split_over_layers",
    "partition_spec",
    "prng_key",
    "same_array_kind",
    "spec_names",
    "spec_on_mesh",
]

_MESH_EXAMPLE = "`jax.make_mesh((8,), ('data',))` (or `jax.sharding.AbstractMesh((8,), ('data',))`)"


# --------------------------------------------------------------------------
# Meshes, axis names, specs.


def mesh(value: Any, who: str, arg: str = "mesh", *, optional: bool = False) -> Any:
    """``value`` if it is a ``Mesh`` or ``AbstractMesh`` (or None with ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, (Mesh, AbstractMesh)):
        return value
    if isinstance(value, (str, tuple, list)):
        hint = (
            f"{value!r} looks like the mesh's axis names; build the mesh from them, e.g. "
            f"`jax.make_mesh((len(jax.devices()),), {tuple(_as_tuple(value))!r})`"
        )
    else:
        hint = f"make one with {_MESH_EXAMPLE}"
    allowed = " (or None)" if optional else ""
    raise TypeError(
        f"{who}: `{arg}` must be a `jax.sharding.Mesh` or `AbstractMesh`{allowed}, got "
        f"{type(value).__name__} {value!r}; {hint}."
    )


def _as_tuple(value: Any) -> tuple:
    return (value,) if isinstance(value, str) else tuple(value)


def axis_names(
    value: Any,
    who: str,
    arg: str,
    *,
    mesh: Any = None,
    optional: bool = False,
    none_means: str | None = None,
) -> tuple[str, ...] | None:
    """One mesh axis name or a sequence of them, as a tuple (None with ``optional``).

    A str is one name (``"model"`` is ``("model",)``, never five letters). With ``mesh``,
    every name must be one of its axes (ValueError naming the missing ones).
    ``none_means`` says in messages what None stands for (``"replicated"``).
    """
    if value is None and (optional or none_means):
        return None
    ok = (isinstance(value, str) and value) or (
        isinstance(value, (tuple, list)) and value and all(isinstance(a, str) and a for a in value)
    )
    if not ok:
        none = f"None ({none_means}), " if none_means else ""
        raise TypeError(
            f"{who}: `{arg}` must be {none}a mesh axis name or a tuple of them (e.g. "
            f"`{arg}='data'` or `{arg}=('data', 'fsdp')`), got {type(value).__name__} "
            f"{value!r}."
        )
    names = _as_tuple(value)
    if mesh is not None:
        missing = mesh_lacks(mesh, names)
        if missing:
            said = "is" if isinstance(value, str) else f"names {missing[0]!r}, which is"
            raise ValueError(
                f"{who}: `{arg}={value!r}` {said} not an axis of the mesh, whose axes are "
                f"{dict(mesh.shape)}. Name one of those, or build the mesh with it, e.g. "
                f"`jax.make_mesh((8,), ({missing[0]!r},))`."
            )
    return names


def axis_entry(value: Any, who: str, arg: str, *, mesh: Any = None) -> Any:
    """A ``PartitionSpec`` entry for one dimension: None, a name, or a tuple of names."""
    names = axis_names(value, who, arg, mesh=mesh, none_means="replicated")
    if names is None:
        return None
    return names[0] if isinstance(value, str) else names


def mesh_lacks(mesh: Any, names: Iterable[str]) -> list[str]:
    """The ``names`` that are not axes of ``mesh``, in order."""
    return [a for a in names if a not in mesh.shape]


def spec_names(spec: Any) -> list[str]:
    """The mesh axis names a ``PartitionSpec`` uses, in order."""
    names: list[str] = []
    for entry in spec or ():
        if isinstance(entry, str):
            names.append(entry)
        elif isinstance(entry, tuple):
            names.extend(a for a in entry if isinstance(a, str))
    return names


def spec_on_mesh(spec: Any, mesh: Any, who: str, arg: str) -> None:
    """ValueError if ``spec`` names an axis ``mesh`` lacks."""
    missing = mesh_lacks(mesh, spec_names(spec))
    if missing:
        raise ValueError(
            f"{who}: {arg} {spec} names {missing[0]!r}, which is not an axis of the mesh "
            f"(its axes: {dict(mesh.shape)}). Name one of those, or build the mesh with it."
        )


def partition_spec(
    value: Any, who: str, arg: str, *, optional: bool = True, leaf: str | None = None
) -> Any:
    """``value`` if it is a ``PartitionSpec`` (or None with ``optional``).

    ``leaf``: the path of the spec in a tree of specs, for messages.
    """
    if isinstance(value, PartitionSpec) or (value is None and optional):
        return value
    if isinstance(value, str):
        meant = f"`P({value!r})` to split the first axis over {value!r}"
    elif isinstance(value, (tuple, list)):
        meant = f"`P(*spec)`, i.e. `P{tuple(value)!r}`"
    else:
        meant = "e.g. `P('data', None)`"
    allowed = " or None" if optional else ""
    what = (
        f"the spec at {leaf} is {type(value).__name__} {value!r}, not a `PartitionSpec`{allowed}"
        if leaf is not None
        else f"`{arg}` must be a `jax.sharding.PartitionSpec`{allowed}, got "
        f"{type(value).__name__} {value!r}"
    )
    raise TypeError(f"{who}: {what}; pass {meant} (`from jax.sharding import PartitionSpec as P`).")


# --------------------------------------------------------------------------
# Integers and layer indices.


def integer(value: Any, who: str, arg: str, *, minimum: int | None = None) -> int:
    """A Python or NumPy integer as an int (never a bool), at least ``minimum``."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{who}: `{arg}` must be an int, got bool {value!r}.")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{who}: `{arg}` must be an int, got {type(value).__name__} {value!r}."
        ) from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{who}: `{arg}` must be at least {minimum}, got {value}.")
    return value


def layer_number(i: Any, n: int, who: str, arg: str = "index") -> int:
    """Layer ``i`` of ``n`` (``-n <= i < n``, negative counting from the end) as ``0..n-1``.

    An int or a NumPy integer (or a 0-d integer array); a bool, a float or a slice is
    refused (TypeError), an index out of range too (IndexError).
    """
    try:
        if isinstance(i, (bool, np.bool_)):
            raise TypeError
        i = operator.index(i)
    except TypeError:
        raise TypeError(
            f"{who}: a layer index must be an int, got {type(i).__name__} {i!r} (as `{arg}`; "
            "a NumPy integer works too); for several layers use `stackwise.slice_layers` on "
            "the params, or `to_layers()[a:b]`."
        ) from None
    if not -n <= i < n:
        raise IndexError(f"{who}: layer {i} is out of range for n={n} layers (use -{n}..{n - 1}).")
    return i % n


def prng_key(key: Any, who: str, arg: str = "key") -> Any:
    """One PRNG key: a typed key of shape ``()`` (``jax.random.key``) or a raw ``uint32[2]``
    (``jax.random.PRNGKey``); a seed, None, or a batch of keys is refused."""
    dtype = getattr(key, "dtype", None)
    typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
    if (typed and jnp.shape(key) == ()) or (dtype == jnp.uint32 and jnp.shape(key) == (2,)):
        return key
    if typed or (dtype == jnp.uint32 and jnp.shape(key)[-1:] == (2,)):
        got = f"a batch of keys of shape {jnp.shape(key)[: None if typed else -1]}"
        fix = "pass one key (it is split for you), e.g. `keys[0]`"
    else:
        got = f"{type(key).__name__} {key!r}"
        fix = "make one from a seed with `jax.random.key(seed)`"
    raise TypeError(f"{who}: `{arg}` must be one PRNG key, got {got}; {fix}.")


# --------------------------------------------------------------------------
# Leaves: concrete arrays, NumPy values, abstract shapes.


def leaf_shape(leaf: Any, who: str, name: str) -> tuple[int, ...]:
    """A leaf's shape: arrays, abstract leaves, NumPy values, Python numbers (``()``)."""
    shape = getattr(leaf, "shape", None)
    if shape is not None:
        return tuple(shape)
    if isinstance(leaf, (bool, int, float, complex, np.generic)):
        return ()
    raise TypeError(
        f"{who}: leaf {name} is {type(leaf).__name__} {leaf!r}, not an array; params leaves "
        "are arrays (or `jax.ShapeDtypeStruct` s from `jax.eval_shape`)."
    )


def leaf_dtype(leaf: Any) -> Any:
    """A leaf's own dtype: a NumPy array's as it is (never canonicalised by jax)."""
    dtype = getattr(leaf, "dtype", None)
    return np.asarray(leaf).dtype if dtype is None else dtype


def depth(tree: Any, who: str, what: str, fix: str = "", leaf_name=lambda path: path) -> int:
    """The common length of every leaf's leading axis; ValueError listing the leaves if none.

    ``leaf_name`` turns a ``keystr`` path into the framework's leaf name in messages.
    """
    leaves = [(leaf_name(name), leaf) for name, leaf in trees.named_leaves(tree)]
    if not leaves:
        raise ValueError(f"{who}: the {what} has no array leaves.")
    shapes = [leaf_shape(leaf, who, name) for name, leaf in leaves]
    depths = {s[0] if s else None for s in shapes}
    if len(depths) != 1 or None in depths:
        lines = "\n".join(f"  {name}: shape {s}" for (name, _), s in zip(leaves, shapes))
        raise ValueError(
            f"{who}: every leaf of the {what} needs the same leading layer axis, but the "
            f"leaves are:\n{lines}" + (f"\n{fix}" if fix else "")
        )
    return depths.pop()


def check_depth(leaves: Iterable[tuple[str, Any]], n: int, who: str, what: str, fix: str) -> None:
    """Raises ValueError listing the ``(name, leaf)`` whose leading axis is not ``n``."""
    bad = []
    for name, leaf in leaves:
        shape = leaf_shape(leaf, who, name)
        if not shape or shape[0] != n:
            bad.append(f"  {name}: shape {shape}")
    if bad:
        raise ValueError(
            f"{who}: every leaf of the stacked {what} needs a leading layer axis of "
            f"length n={n}, but these do not:\n" + "\n".join(bad) + "\n" + fix
        )


# --------------------------------------------------------------------------
# What a layer returns, and where params sit.


def _spec(leaf: Any) -> tuple:
    """A traced leaf's sharding spec over explicit mesh axes (part of its type), padded with
    None to its rank; all None outside explicit axes."""
    spec = getattr(getattr(jax.typeof(leaf), "sharding", None), "spec", None) or ()
    return tuple(spec) + (None,) * (jnp.ndim(leaf) - len(spec))


def carry(old: Any, new: Any, who: str, has_aux: bool, scanned: bool = True) -> None:
    """Raises if a layer changed the carry's structure, shape or dtype, or (``scanned``: a
    scan's carry, whose type holds its sharding over explicit mesh axes) its sharding."""
    old_def, new_def = jax.tree_util.tree_structure(old), jax.tree_util.tree_structure(new)
    if old_def != new_def:
        hint = (
            "With `has_aux=True` the layer returns `(x, aux)`: check that x comes first."
            if has_aux
            else "Per-layer outputs of another structure go in `aux`: build the stack "
            "with `has_aux=True` and return `(x, aux)`."
        )
        raise TypeError(
            f"{who}: a layer must return its input `x` with the same "
            f"pytree structure (it is fed to the next layer), but it took\n  {old_def}\n"
            f"and returned\n  {new_def}\n{hint}"
        )
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(old), jax.tree_util.tree_leaves(new)
    ):
        a_shape, b_shape = jnp.shape(a), jnp.shape(b)
        a_type, b_type = jnp.result_type(a), jnp.result_type(b)
        if a_shape != b_shape or a_type != b_type:
            leaf = "x" + jax.tree_util.keystr(path)
            fix = (
                f"cast it back, e.g. `{leaf}.astype(jnp.{a_type.name})`"
                if a_shape == b_shape
                else f"reshape or project it back to {a_shape}"
            )
            raise TypeError(
                f"{who}: a layer changed carry leaf `{leaf}` from "
                f"{a_type.name}{list(a_shape)} to {b_type.name}{list(b_shape)}; "
                f"every layer must return x with the shape and dtype it received: {fix}."
            )
        if scanned and _spec(a) != _spec(b):
            leaf = "x" + jax.tree_util.keystr(path)
            raise TypeError(
                f"{who}: a layer changed the sharding of carry leaf `{leaf}` from "
                f"{PartitionSpec(*_spec(a))} to {PartitionSpec(*_spec(b))} (explicit mesh "
                "axes make it part of the type, and the scan feeds each layer's x to the "
                "next as one type). Reshard it back before the layer returns, e.g. "
                f"`jax.sharding.reshard({leaf}, {PartitionSpec(*_spec(a))})`, or give the "
                f"stack x sharded as the layer returns it ({PartitionSpec(*_spec(b))})."
            )


def not_split_over_layers(params: Any, who: str) -> None:
    """Params placed with the layer axis sharded cannot be scanned layer by layer."""
    for name, leaf in trees.named_leaves(params):
        spec = getattr(getattr(jax.typeof(leaf), "sharding", None), "spec", None)
        if spec and spec[0] is not None:
            raise ValueError(
                f"{who}: params leaf {name} is split over mesh axis {spec[0]!r} along "
                "its layer axis (e.g. by `stackwise.shard_stacked(..., layer_axis=...)`), "
                "but `Stacked.apply` runs the layers one after another on every device. "
                "Run them as pipeline stages with `stackwise.pipeline`, or reshard the "
                "layer axis to replicated first (`stackwise.shard_stacked(params, mesh, "
                "specs)` without `layer_axis`)."
            )


# --------------------------------------------------------------------------
# Dtypes: exact, or an error naming the leaf.


def same_array_kind(a: Any, b: Any) -> bool:
    """Whether two values are both arrays (NumPy or JAX alike) or of one type."""
    arrays = (np.ndarray, np.generic, jax.Array)
    return type(a) is type(b) or (isinstance(a, arrays) and isinstance(b, arrays))


def exact_dtype(leaf: Any, who: str, name: str) -> None:
    """Raises TypeError if ``leaf`` would change dtype as a JAX array (NumPy 64-bit with
    ``jax_enable_x64`` off), naming the leaf, its dtype and the fix."""
    own = leaf_dtype(leaf)
    if own == np.dtype(object) or jnp.issubdtype(own, jax.dtypes.extended):  # e.g. PRNG keys
        return
    held = jax.dtypes.canonicalize_dtype(own)
    if held != own:
        raise TypeError(
            f"{who}: leaf {name} is {np.dtype(own).name}, which JAX holds as "
            f"{np.dtype(held).name} with its current settings: its values would be rounded "
            "or wrapped (an int64 2**40 + 1 becomes 1). Cast it first (`a.astype(np."
            f"{np.dtype(held).name})`) if that is what you want, or enable 64-bit values "
            "with `jax.config.update('jax_enable_x64', True)`."
        )
