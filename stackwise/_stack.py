"""The core primitive: ``stack(init, apply, n)``: n copies of one layer, scanned.

Everything about scanning and rematerialisation lives in this module; the
framework adapters only turn a module into an ``(init, apply)`` pair.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

__all__ = [
    "CARRY_NAME",
    "DEFAULT_REMAT",
    "Stacked",
    "layer_index",
    "per_layer",
    "per_layer_keys",
    "stack",
]

#: Name given (with :func:`jax.ad_checkpoint.checkpoint_name`) to the carry that
#: enters each layer, so remat policies can save or offload it by name, e.g.
#: ``jax.checkpoint_policies.save_only_these_names(stackwise.CARRY_NAME)``.
CARRY_NAME = "stackwise_carry"

#: The default ``remat`` of :func:`stack`: keep each layer's matmul outputs
#: (``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``) and recompute
#: the cheap elementwise rest in the backward pass. The fastest ``jit(grad)``
#: measured (docs/step-time.md), and it stores less than no remat at all.
DEFAULT_REMAT = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


class Stacked(NamedTuple):
    """A pure pair of functions for n stacked layers, returned by :func:`stack`.

    Attributes:
      init: ``params = init(key, *args, **kwargs)``; every leaf gains a leading
        axis of length ``n``. With ``with_state=True``: ``(params, state)``.
      apply: ``x = apply(params, x, *args, **kwargs)``, the layers run in
        order. With ``has_aux=True`` it returns ``(x, aux)``, aux stacked
        along a leading ``n`` axis; with ``with_state=True`` it is
        ``out, state = apply(params, state, x, *args, **kwargs)``.
      n: the number of layers.
    """

    init: Callable[..., Any]
    apply: Callable[..., Any]
    n: int


# --------------------------------------------------------------------------
# Per-layer arguments: markers resolved to one slice per layer.


@jax.tree_util.register_pytree_node_class
class _PerLayer:
    """An argument that differs per layer; see :func:`per_layer`.

    A pytree node, so a marked argument passes through ``jax.jit`` and other
    transformations on its way to ``Stacked.apply``.
    """

    __slots__ = ("kind", "value")

    def __init__(self, kind: str, value: Any = None):
        self.kind = kind  # "slices" | "keys" | "index"
        self.value = value

    def __repr__(self) -> str:
        return f"stackwise.{_MARKER_NAMES[self.kind]}(...)"

    def tree_flatten(self):
        return (self.value,), self.kind

    @classmethod
    def tree_unflatten(cls, kind, children):
        return cls(kind, *children)

    def stacked(self, n: int, where: str) -> Any:
        """The value with a leading axis ``n``: layer i receives ``[i]``."""
        if self.kind == "index":
            return jnp.arange(n, dtype=jnp.int32)
        if self.kind == "keys":
            return jax.random.split(self.value, n)
        _check_leading_axis(
            self.value, n, where, "stackwise.per_layer(...) value",
            fix="Layer i receives slice i, so give one entry per layer (`jnp.stack` "
            "them), or pass the value without `per_layer` to give every layer all of it.",
        )
        return self.value


_MARKER_NAMES = {"slices": "per_layer", "keys": "per_layer_keys", "index": "layer_index"}


def per_layer(xs: Any) -> Any:
    """Marks an argument whose leading axis is the layer axis: layer i gets ``xs[i]``.

    Works for positional and keyword arguments of ``Stacked.init`` and
    ``Stacked.apply`` and for any pytree (every leaf sliced).

    >>> import jax.numpy as jnp, stackwise
    >>> layers = stackwise.stack(lambda k: None, lambda p, x, s: x * s, n=3)
    >>> layers.apply(None, 1.0, stackwise.per_layer(jnp.array([2.0, 3.0, 4.0])))
    Array(24., dtype=float32)
    """
    return _PerLayer("slices", xs)


def per_layer_keys(key: jax.Array) -> Any:
    """Marks a PRNG key to be split into n independent keys, one per layer.

    Layer i receives ``jax.random.split(key, n)[i]``.

    >>> import jax, stackwise
    >>> layers = stackwise.stack(
    ...     lambda k: None, lambda p, x, k: x + jax.random.uniform(k), n=4)
    >>> y = layers.apply(None, 0.0, stackwise.per_layer_keys(jax.random.key(0)))
    >>> bool(0.0 < y < 4.0)
    True
    """
    return _PerLayer("keys", key)


def layer_index() -> Any:
    """Marks an argument that receives the layer's own index, a traced int32.

    >>> import stackwise
    >>> layers = stackwise.stack(lambda k: None, lambda p, x, i: x * 10 + i, n=3)
    >>> layers.apply(None, 0, stackwise.layer_index())
    Array(12, dtype=int32)
    """
    return _PerLayer("index")


def _split_markers(args: tuple, kwargs: dict, n: int, what: str):
    """Separates per-layer markers from the rest of ``(args, kwargs)``.

    Returns ``(xs, rebuild)``: ``xs`` lists each marker's stacked value and
    ``rebuild(slices)`` gives back ``(args, kwargs)`` with every marker
    replaced by its slice. Every other leaf (arrays and static Python values
    alike) is closed over unchanged, so static values stay static.
    """
    is_marker = lambda v: isinstance(v, _PerLayer)  # noqa: E731
    leaves, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=is_marker)
    slots = [i for i, (_, leaf) in enumerate(leaves) if is_marker(leaf)]
    xs = [
        leaves[i][1].stacked(n, f"{what}{_describe_arg(leaves[i][0])}") for i in slots
    ]
    values = [leaf for _, leaf in leaves]

    def rebuild(slices):
        filled = list(values)
        for i, s in zip(slots, slices):
            filled[i] = s
        return jax.tree_util.tree_unflatten(treedef, filled)

    return xs, rebuild


def _describe_arg(path) -> str:
    """``(args, kwargs)`` path -> ``" argument *args[0]"`` / ``" argument **kwargs['s']"``."""
    top, first, *rest = path
    inner = jax.tree_util.keystr(tuple(rest))
    if top.idx == 0:
        return f" argument *args[{first.idx}]{inner}"
    return f" argument **kwargs[{first.key!r}]{inner}"


# --------------------------------------------------------------------------
# Validation.


def _leaf_lines(tree: Any, pred: Callable[[Any], bool]) -> list[str]:
    return [
        f"  {jax.tree_util.keystr(path) or '<root>'}: shape {jnp.shape(leaf)}"
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
        if pred(leaf)
    ]


def _check_leading_axis(tree: Any, n: int, where: str, what: str, fix: str | None = None) -> None:
    bad = _leaf_lines(tree, lambda a: jnp.ndim(a) == 0 or jnp.shape(a)[0] != n)
    if bad:
        fix = fix or (
            f"Stacked {what} come from `Stacked.init`, or from "
            "`stackwise.stack_layers([layer_0, ..., layer_{n-1}])`; take the "
            "first k layers with `stackwise.slice_layers(params, 0, k)`."
        )
        raise ValueError(
            f"{where}: every leaf of the {what} needs a leading layer axis of "
            f"length n={n}, but these leaves do not:\n" + "\n".join(bad) + "\n" + fix
        )


def _check_carry(old: Any, new: Any, who: str) -> None:
    """Raises if a layer changed the carry's structure, shape or dtype."""
    old_def, new_def = jax.tree_util.tree_structure(old), jax.tree_util.tree_structure(new)
    if old_def != new_def:
        raise TypeError(
            f"{who}: a layer must return its input `x` with the same "
            f"pytree structure (it is fed to the next layer), but it took\n  {old_def}\n"
            f"and returned\n  {new_def}\n"
            "Per-layer outputs of another structure go in `aux`: build the "
            "stack with `has_aux=True` and return `(x, aux)`."
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


def _remat_policy(remat: Any) -> tuple[bool, Callable | None]:
    """Normalises ``remat`` to ``(enabled, policy)``: the one home of that logic."""
    if remat is False or remat is None:
        return False, None
    if remat is True:
        return True, None
    if callable(remat):
        return True, remat
    raise TypeError(
        f"stackwise.stack: `remat` must be False, True or a policy from "
        f"`jax.checkpoint_policies` (e.g. `jax.checkpoint_policies.dots_saveable`), "
        f"got {remat!r}."
    )


# --------------------------------------------------------------------------
# The stack.


def stack(
    init: Callable[..., Any],
    apply: Callable[..., Any],
    n: int,
    *,
    remat: bool | Callable[..., bool] = DEFAULT_REMAT,
    nested: bool | int = False,
    unroll: int | bool = 1,
    reverse: bool = False,
    has_aux: bool = False,
    with_state: bool = False,
    name: str | None = None,
) -> Stacked:
    """Stacks ``n`` copies of one layer: stacked params, one scanned apply.

    The loop it replaces, with one set of params per layer:

    >>> import jax, jax.numpy as jnp, stackwise
    >>> def init(key, d):
    ...     return {"w": jax.random.normal(key, (d, d)) / d**0.5, "b": jnp.zeros((1, d))}
    >>> def apply(params, x):
    ...     return x + jnp.tanh(x @ params["w"] + params["b"])
    >>> keys = jax.random.split(jax.random.key(0), 4)
    >>> per_layer_params = [init(k, 8) for k in keys]
    >>> x = jnp.ones((2, 8))
    >>> y_loop = x
    >>> for p in per_layer_params:
    ...     y_loop = apply(p, y_loop)

    The same, stacked: the layer is traced once, whatever ``n``:

    >>> layers = stackwise.stack(init, apply, n=4)
    >>> params = layers.init(jax.random.key(0), 8)
    >>> params["w"].shape
    (4, 8, 8)
    >>> y = jax.jit(layers.apply)(params, x)
    >>> bool(jnp.allclose(y, y_loop, atol=1e-6))
    True

    Args:
      init: ``layer_params = init(key, *args, **kwargs)`` for one layer (with
        ``with_state=True`` it returns ``(layer_params, layer_state)``).
        ``Stacked.init`` calls it once per key of ``jax.random.split(key, n)``
        (vectorised with :func:`jax.vmap`) and stacks the results.
      apply: ``x = apply(layer_params, x, *args, **kwargs)`` for one layer.
        ``x`` is any pytree; the layer must return it with the same structure,
        shapes and dtypes. With ``has_aux=True`` it returns ``(x, aux)``; with
        ``with_state=True`` its signature is
        ``out, layer_state = apply(layer_params, layer_state, x, ...)``.
      n: the number of layers, a positive int.
      remat: rematerialise each layer's activations in the backward pass
        instead of storing them: ``False`` (store every residual), ``True``
        (save nothing but the carry between layers) or a
        :mod:`jax.checkpoint_policies` policy. The default,
        :data:`DEFAULT_REMAT`, saves matmul outputs and recomputes the rest:
        the fastest and, after ``True``, the leanest choice measured.
        Inside the scan no optimisation barriers are added (none are needed);
        with ``unroll=True`` barriers protect the activations only, never
        params or closed-over constants. The carry entering each layer is
        named :data:`CARRY_NAME` for save/offload policies.
      nested: checkpoint groups of layers as well (two-level, "sqrt(n)"
        remat): only the carries between groups are kept for the backward
        pass, and each group is recomputed when its turn comes. ``True`` picks
        groups of about ``sqrt(n)`` layers (a divisor of ``n`` if one is near);
        an int sets the group size. A last, smaller group takes the remainder
        when the size does not divide ``n`` (this slices the stacked params: a
        copy). Combines with ``remat``, which then applies inside each group.
        It pays off when per-layer activations outweigh per-layer params: the
        backward pass keeps one group's param gradients as well.
      unroll: an int is passed to :func:`jax.lax.scan`; ``True`` runs a Python
        loop over the layers instead (same params layout; each layer traced
        separately; runs eagerly under :func:`jax.disable_jit` for debugging,
        where ``remat`` is then skipped).
      reverse: run the last layer first. Per-layer inputs and outputs keep
        their layer order.
      has_aux: the layer returns ``(x, aux)``; ``Stacked.apply`` returns
        ``(x, aux)`` with every aux leaf stacked along a leading ``n`` axis.
      with_state: the layer carries per-layer mutable state (normalisation
        statistics, counters, a KV cache): see ``init`` and ``apply``.
      name: what error messages call the stack (adapters pass their own name and
        the block's, e.g. ``"stackwise.flax.Stack(Block)"``).

    Per-layer arguments: wrap an argument of ``Stacked.init`` or
    ``Stacked.apply`` in :func:`per_layer` (layer i gets slice i),
    :func:`per_layer_keys` (layer i gets the i-th of n independent keys) or
    pass :func:`layer_index` (layer i gets ``i`` as a traced int32). Every
    other argument reaches every layer unchanged; Python values (bools,
    strings, None) stay static.

    Returns:
      A :class:`Stacked` ``(init, apply, n)``.

    Raises:
      TypeError: ``init``/``apply`` not callable, ``n`` not an int, an unknown
        ``remat`` or ``unroll`` value, or a layer that changes the carry.
      ValueError: ``n < 1``, or params / per-layer inputs whose leading axis is
        not ``n`` (the offending leaves are listed).
    """
    for arg, fn in (("init", init), ("apply", apply)):
        if not callable(fn):
            raise TypeError(
                f"stackwise.stack: `{arg}` must be callable, got {type(fn).__name__} "
                f"{fn!r}. Call it as `stackwise.stack(init, apply, n)`."
            )
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(
            f"stackwise.stack: `n` must be a Python int (the number of layers), got "
            f"{type(n).__name__} {n!r}. The depth is static: for a data-dependent "
            "number of iterations use `jax.lax.while_loop`."
        )
    if n < 1:
        raise ValueError(f"stackwise.stack: `n` must be at least 1, got {n}.")
    rematted, policy = _remat_policy(remat)
    if unroll is False:
        unroll = 1  # as in lax.scan: no unrolling
    positive_int = isinstance(unroll, int) and not isinstance(unroll, bool) and unroll >= 1
    if unroll is not True and not positive_int:
        raise TypeError(
            f"stackwise.stack: `unroll` must be a positive int (passed to "
            f"`lax.scan`) or True (a Python loop), got {unroll!r}."
        )
    if isinstance(nested, bool):
        group = _group_size(n) if nested else None
    elif isinstance(nested, int) and 1 <= nested:
        group = min(nested, n)
    else:
        raise TypeError(
            f"stackwise.stack: `nested` must be a bool or a positive int group size, "
            f"got {nested!r}."
        )
    python_loop = unroll is True
    who = name or "stackwise.stack"

    def stacked_init(key, *args, **kwargs):
        keys = jax.random.split(key, n)
        xs, rebuild = _split_markers(args, kwargs, n, f"{who}: Stacked.init")

        def one(key_i, slices):
            a, kw = rebuild(slices)
            return init(key_i, *a, **kw)

        return jax.vmap(one)(keys, xs)

    def layer(p, s, x, slices, rebuild):
        """One layer, as the scan body sees it: ``x, (state, aux)``."""
        x = checkpoint_name(x, CARRY_NAME)
        a, kw = rebuild(slices)
        if with_state:
            out, s = apply(p, s, x, *a, **kw)
        else:
            out = apply(p, x, *a, **kw)
        new_x, aux = out if has_aux else (out, None)
        _check_carry(x, new_x, who)
        return new_x, (s, aux)

    def stacked_apply(params, *args, **kwargs):
        if with_state:
            if len(args) < 2:
                raise TypeError(
                    "Stacked.apply with `with_state=True` is called as "
                    "`apply(params, state, x, *args, **kwargs)`."
                )
            state, x, *args = args
        else:
            if not args:
                raise TypeError("Stacked.apply is called as `apply(params, x, *args, **kwargs)`.")
            state, (x, *args) = None, args
        _check_leading_axis(params, n, f"{who}: Stacked.apply", "params")
        if with_state:
            _check_leading_axis(state, n, f"{who}: Stacked.apply", "state")
        xs, rebuild = _split_markers(tuple(args), kwargs, n, f"{who}: Stacked.apply")

        def body(x, per_layer):
            p, s, slices = per_layer
            return layer(p, s, x, slices, rebuild)

        x, (state, aux) = _run(body, x, (params, state, xs))
        out = (x, aux) if has_aux else x
        return (out, state) if with_state else out

    def _run(body, x, xs):
        """All n layers, in groups when ``nested``."""
        inner = _remat(body, rematted, policy, python_loop)
        if group is None:
            return _loop(inner, x, xs, n)
        n_groups, tail = divmod(n, group)
        whole = n_groups * group
        # The groups run first, then the smaller last group of `tail` layers:
        # the end of the layer axis, or its start when running in reverse.
        groups_at, tail_at = ((tail, n), (0, tail)) if reverse else ((0, whole), (whole, n))
        groups_xs = jax.tree.map(
            lambda a: a.reshape(n_groups, group, *a.shape[1:]), _take(xs, *groups_at)
        )
        run_group = _remat(lambda c, g_xs: _loop(inner, c, g_xs, group), True, None, python_loop)
        x, ys = _loop(run_group, x, groups_xs, n_groups)
        ys = jax.tree.map(lambda a: a.reshape(whole, *a.shape[2:]), ys)
        if tail:
            x, ys_tail = _loop(inner, x, _take(xs, *tail_at), tail)
            parts = (ys_tail, ys) if reverse else (ys, ys_tail)
            ys = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), *parts)
        return x, ys

    def _loop(body, x, xs, length):
        """``lax.scan`` over the layer axis, or a Python loop when ``unroll=True``."""
        if not python_loop:
            return jax.lax.scan(body, x, xs, length=length, reverse=reverse, unroll=unroll)
        ys = [None] * length
        for i in reversed(range(length)) if reverse else range(length):
            x, ys[i] = body(x, jax.tree.map(lambda a, i=i: a[i], xs))
        return x, jax.tree.map(lambda *y: jnp.stack(y), *ys)

    return Stacked(stacked_init, stacked_apply, n)


def _group_size(n: int) -> int:
    """About ``sqrt(n)``, preferring a divisor of ``n`` within 2x of it.

    A group size that divides ``n`` needs no last, smaller group, so the
    stacked params need not be sliced (a copy) nor their gradients joined.
    """
    root = math.sqrt(n)
    divisors = [d for d in range(1, n + 1) if n % d == 0 and root / 2 <= d <= 2 * root]
    return min(divisors, key=lambda d: abs(d - root)) if divisors else max(1, round(root))


def _take(tree: Any, start: int, stop: int) -> Any:
    return jax.tree.map(lambda a: a[start:stop], tree)


def _remat(body, enabled: bool, policy, python_loop: bool):
    """``body(x, xs)`` with rematerialisation: the one home of remat.

    Inside a scan no CSE barriers are needed. In straight-line code only the
    carry ``x`` is protected; per-layer params and inputs ``xs`` (and
    closed-over constants, which ``jax.checkpoint`` never protects) are not.
    """
    if not enabled or (python_loop and jax.config.jax_disable_jit):
        return body  # eager debugging: nothing is staged, so nothing to remat
    prevent_cse = (True, False) if python_loop else False
    return jax.checkpoint(body, prevent_cse=prevent_cse, policy=policy)
