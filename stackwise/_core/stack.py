"""The core primitive: ``stack(init, apply, n)``: n copies of one layer, scanned.

Everything about scanning and rematerialisation lives in this module; the
framework adapters only turn a module into an ``(init, apply)`` pair.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from stackwise._core import checks, inplace, serving, through, trees
from stackwise._core.checks import check_depth
from stackwise._core.gather import check_fsdp_axes, gather
from stackwise._core.markers import PerLayer, split_markers
from stackwise._core.markers import layer_index as layer_index
from stackwise._core.markers import per_layer as per_layer
from stackwise._core.markers import per_layer_keys as per_layer_keys
from stackwise._core.options import Options, check_bool, check_layers, check_options
from stackwise._core.stacked import Stacked as Stacked
from stackwise._upstream import jax as jax_ties

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

# The name of each layer's params after an FSDP gather (`fsdp=`): never saved.
_GATHERED_NAME = "stackwise_gathered"


# --------------------------------------------------------------------------
# What a layer returns, checked.


def check_pair(out: Any, who: str, what: str, fix: str, by: str = "it") -> tuple[Any, Any]:
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"{who}: {what}, but {by} returned {trees.describe(out)}. {fix}")
    return out


def apply_args(args: tuple, with_state: bool, who: str, call: str = "Stacked.apply") -> tuple:
    """``(params, state, x, rest)`` of an apply call (``state`` None without state), or a
    TypeError giving the call's form."""
    if with_state:
        if len(args) < 3:
            raise TypeError(
                f"{who}: with `with_state=True`, {call} is called as "
                "`apply(params, state, x, *args, **kwargs)`."
            )
        params, state, x, *rest = args
        return params, state, x, rest
    if len(args) < 2:
        raise TypeError(f"{who}: {call} is called as `apply(params, x, *args, **kwargs)`.")
    params, x, *rest = args
    return params, None, x, rest


# --------------------------------------------------------------------------
# The stack.


def stack(
    init: Callable[..., Any] | Sequence[Callable[..., Any]] | None,
    apply: Callable[..., Any] | Sequence[Callable[..., Any]],
    n: int,
    *,
    remat: bool | Callable[..., Any] = DEFAULT_REMAT,
    nested: bool | int = False,
    unroll: int | bool = 1,
    reverse: bool = False,
    has_aux: bool = False,
    with_state: bool = False,
    fsdp: str | tuple[str, ...] | None = None,
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

    A pattern of k different layers repeats along the depth (Gemma's local and
    global attention, dense and MoE blocks): layer i runs ``apply[i % k]``
    with params made by ``init[i % k]``, and ``n`` need not be a multiple of
    ``k``. The params are a tuple of k stacked trees; tree p holds layers p,
    p+k, p+2k, ..., in that order:

    >>> def scaled(key, d):
    ...     return {"s": jnp.full((1, d), 0.5)}
    >>> pattern = stackwise.stack([init, scaled], [apply, lambda p, x: x * p["s"]], n=5)
    >>> dense, scales = pattern.init(jax.random.key(0), 8)
    >>> dense["w"].shape, scales["s"].shape  # layers 0, 2, 4 and layers 1, 3
    ((3, 8, 8), (2, 1, 8))
    >>> pattern.apply((dense, scales), x).shape
    (2, 8)

    Args:
      init: ``layer_params = init(key, *args, **kwargs)`` for one layer (with
        ``with_state=True`` it returns ``(layer_params, layer_state)``).
        ``Stacked.init`` calls it once per key of ``jax.random.split(key, n)``
        (vectorised with :func:`jax.vmap`) and stacks the results. ``None``
        when the params come from elsewhere (a checkpoint,
        :func:`stackwise.stack_layers`): ``Stacked.init`` then raises. A
        sequence of k functions (or ``None`` s) for a pattern.
      apply: ``x = apply(layer_params, x, *args, **kwargs)`` for one layer.
        ``x`` is any pytree; the layer must return it with the same structure,
        shapes and dtypes. With ``has_aux=True`` it returns ``(x, aux)``; with
        ``with_state=True`` its signature is
        ``out, layer_state = apply(layer_params, layer_state, x, ...)``. A
        sequence of k functions for a pattern (as many as ``init``).
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
        copy). With a pattern, groups hold whole repeats of it and the sizes
        count repeats. Combines with ``remat``, which then applies inside each
        group. It pays off when per-layer activations outweigh per-layer
        params: the backward pass keeps one group's param gradients as well.
      unroll: an int is passed to :func:`jax.lax.scan` (with a pattern: repeats
        of it per iteration; ``False`` is 1); ``True`` runs a Python loop over the layers
        instead (same params layout; each layer traced separately; runs
        eagerly under :func:`jax.disable_jit` for debugging, where ``remat`` is
        then skipped). With ``with_state``, a layer that updates its state
        in place (a KV cache written with ``dynamic_update_slice``) reads and
        writes its own row of the stacked state, in place when it is donated: on
        a TPU the decode step you then compile is the loop's, where a scan copies
        each layer's cache every token.
      reverse: run the last layer first. Per-layer inputs and outputs keep
        their layer order.
      has_aux: the layer returns ``(x, aux)``; ``Stacked.apply`` returns
        ``(x, aux)`` with every aux leaf stacked along a leading ``n`` axis
        (a tuple per pattern position for a pattern).
      with_state: the layer carries per-layer mutable state (normalisation
        statistics, counters, a KV cache): see ``init`` and ``apply``. A state
        leaf the layer returns as its input leaf written with
        :func:`jax.lax.dynamic_update_slice` (a KV cache's new positions) is
        updated in place in the stacked state, so decoding with a donated
        cache copies nothing per token; every other leaf is returned whole.
        Params and state converted by :func:`stackwise.to_serving` (per-layer
        buffers) run as a Python loop instead, as a loop model does.
      fsdp: the mesh axis (or axes) the params are sharded over, FSDP-style:
        each layer's params are all-gathered over them inside the loop, one
        layer at a time, and the gathered copy is never kept for the backward
        pass (it is gathered again there, whatever ``remat``); gradients come
        back sharded like the params. For explicit mesh axes
        (:func:`jax.make_mesh`'s default); on ``Auto`` axes the compiler
        places the gathers itself and this changes nothing but the remat.
      name: what error messages call the stack (adapters pass their own name and
        the block's, e.g. ``"stackwise.flax.Stack(Block)"``).

    Per-layer arguments: wrap an argument of ``Stacked.init`` or
    ``Stacked.apply`` in :func:`per_layer` (layer i gets slice i),
    :func:`per_layer_keys` (layer i gets the i-th of n independent keys) or
    pass :func:`layer_index` (layer i gets ``i`` as a traced int32). Every
    other argument reaches every layer unchanged; Python values (bools,
    strings, None) stay static, so under :func:`jax.jit` pass them as static
    arguments: ``jax.jit(layers.apply, static_argnames="train")(params, x,
    train=True)`` (a jitted function otherwise turns ``True`` into a tracer,
    and ``if train:`` in the layer fails with a ``TracerBoolConversionError``).

    Returns:
      A :class:`Stacked` ``(init, apply, n, decode)``.

    Raises:
      TypeError: ``init``/``apply`` not callable, ``n`` not an int, an unknown
        ``remat``, ``unroll`` or ``nested`` value, a non-bool flag, or a layer
        that changes the carry or returns the wrong number of values.
      ValueError: ``n < 1``, or params / per-layer inputs whose leading axis is
        not ``n`` (the offending leaves are listed).
    """
    who = name or "stackwise.stack"
    inits, applies, pattern = check_layers(init, apply, who)
    options = check_options(
        who,
        n,
        remat=remat,
        nested=nested,
        unroll=unroll,
        reverse=reverse,
        has_aux=has_aux,
        fsdp=fsdp,
    )
    check_bool(with_state, "with_state", who)
    k = len(applies)
    if n < k:
        raise ValueError(
            f"{who}: a pattern of {k} layers needs n >= {k} layers, got n={n}; for fewer "
            "layers, give the first n positions only."
        )
    runs = {
        "apply": Run(applies, n, options, with_state, who),
        "decode": Run(applies, n, options._replace(unroll=True, nested=False), with_state, who),
    }

    def unwrap(trees: tuple) -> Any:
        return trees if pattern else trees[0]

    def stacked_init(key, *args, **kwargs):
        if inits is None:
            raise TypeError(
                f"{who}: this stack was built without `init` (`stackwise.stack(None, "
                "apply, n)`), so it makes no params: give `Stacked.apply` params from "
                "elsewhere, e.g. `stackwise.stack_layers([...])` of per-layer params."
            )
        keys = jax.random.split(checks.prng_key(key, f"{who}: Stacked.init"), n)
        xs, rebuild = split_markers(args, kwargs, n, f"{who}: Stacked.init")
        out = []
        for p, init_p in enumerate(inits):

            def one(key_i, slices, init_p=init_p):
                a, kw = rebuild(slices)
                made = init_p(key_i, *a, **kw)
                if with_state:
                    made = check_pair(
                        made,
                        who,
                        "with `with_state=True`, `init` returns `(layer_params, layer_state)`",
                        "Return `(params, None)` for a layer without initial state.",
                    )
                return made

            out.append(jax.vmap(one)(keys[p::k], _position(xs, p, k)))
        if with_state:
            return unwrap(tuple(o[0] for o in out)), unwrap(tuple(o[1] for o in out))
        return unwrap(tuple(out))

    def stacked_apply(*args, **kwargs):
        return runs["apply"].apply(args, kwargs, pattern, "Stacked.apply")

    def stacked_decode(*args, **kwargs):
        return runs["decode"].apply(args, kwargs, pattern, "Stacked.decode")

    return Stacked(stacked_init, stacked_apply, n, stacked_decode)


def _position(tree: Any, p: int, k: int) -> Any:
    """Pattern position p's share of a tree stacked over all n layers: ``[p::k]``."""
    return tree if k == 1 else jax.tree.map(lambda a: a[p::k], tree)


# --------------------------------------------------------------------------
# Running the layers.


class Run:
    """Runs n layers (k positions of a pattern, or one layer repeated)."""

    def __init__(self, applies: tuple, n: int, options: Options, with_state: bool, who: str):
        self.applies, self.n, self.k = applies, n, len(applies)
        self.options, self.with_state, self.who = options, with_state, who
        self.repeats, self.tail = divmod(n, self.k)  # whole repeats, then a partial one
        self.counts = [len(range(p, n, self.k)) for p in range(self.k)]
        nested = options.nested
        if nested is True:
            self.group = _group_size(self.repeats) if self.repeats else None
        elif nested is False or not self.repeats:
            self.group = None
        else:
            self.group = min(nested, self.repeats)
        self.python_loop = options.unroll is True
        self.records: list[dict] = [{} for _ in applies]  # per position: state updates

    def apply(self, args: tuple, kwargs: dict, pattern: bool, call: str) -> Any:
        """``Stacked.apply``'s (or ``decode``'s) call: the arguments checked and split, the
        layers run on stacked or served params."""
        who, n, k, options = self.who, self.n, self.k, self.options
        unwrap = (lambda trees: trees) if pattern else (lambda trees: trees[0])
        params, state, x, args = apply_args(args, self.with_state, who, call)
        if isinstance(x, PerLayer) or any(
            isinstance(v, PerLayer)
            for v in jax.tree.leaves(x, is_leaf=lambda v: isinstance(v, PerLayer))
        ):
            raise TypeError(
                f"{who}: the carry `x` (the first layer's input) holds a per-layer marker; "
                "per-layer inputs go in the other arguments: `apply(params, x, "
                "stackwise.per_layer(xs))`."
            )
        if serving.in_use(params, state):  # per-layer buffers: a Python loop
            at, where = k if pattern else None, f"{who}: {call}"
            params, state = serving.layers_of(
                params, state, n=n, pattern=at, options=options, where=where
            )
            xs, rebuild = split_markers(tuple(args), kwargs, n, where)
            x, new_state, aux = self.serve(params, state, x, xs, rebuild)
            new_state = serving.Serving(new_state, at)
        else:
            params = self.positions(params, "params", pattern)
            state = self.positions(state, "state", pattern) if self.with_state else (None,) * k
            checks.not_split_over_layers(unwrap(params), f"{who}: {call}")
            if options.fsdp:
                check_fsdp_axes(params, options.fsdp, who)
            xs, rebuild = split_markers(tuple(args), kwargs, n, f"{who}: {call}")
            x, new_state, aux = self(params, state, x, xs, rebuild)
            new_state = unwrap(new_state) if self.with_state else None
        out = (x, unwrap(aux)) if options.has_aux else x
        return (out, new_state) if self.with_state else out

    def positions(self, tree: Any, what: str, pattern: bool) -> tuple:
        """The tree as one stacked tree per position, each leaf's depth checked."""
        if pattern and tree is None:  # layers without params (or state)
            tree = (None,) * self.k
        if pattern:
            if not isinstance(tree, (tuple, list)) or len(tree) != self.k:
                raise TypeError(
                    f"{self.who}: with a pattern of {self.k} layers, the {what} are a "
                    f"tuple of {self.k} stacked trees (position p holds layers p, p+"
                    f"{self.k}, ...), as `Stacked.init` returns them; got "
                    f"{type(tree).__name__}."
                )
            tree = tuple(tree)
        else:
            tree = (tree,)
        fix = (
            f"Stacked {what} come from `Stacked.init`, or from "
            "`stackwise.stack_layers([layer_0, ..., layer_{n-1}])`; take the "
            "first k layers with `stackwise.slice_layers(params, 0, k)`."
        )
        for p, sub in enumerate(tree):
            where = f"{self.who}: Stacked.apply" + (f", pattern position {p}" if pattern else "")
            check_depth(trees.named_leaves(sub), self.counts[p], where, what, fix)
        return tree

    def __call__(self, params: tuple, state: tuple, x: Any, xs: list, rebuild) -> tuple:
        if self.python_loop and self.with_state and self.group is None:
            return self.through(params, state, x, xs, rebuild)
        k, reverse = self.k, self.options.reverse
        layers = [self._layer(p, rebuild) for p in range(k)]
        inputs = [(params[p], state[p], _position(xs, p, k)) for p in range(k)]
        order = list(reversed(range(k))) if reverse else list(range(k))

        def repeat(x, inputs):
            """One repeat of the pattern: position by position."""
            outs = [None] * k
            for p in order:
                x, outs[p] = layers[p](x, inputs[p])
            return x, tuple(outs)

        g, r = self.repeats, self.tail
        whole = [_take(inputs[p], 0, g) if self.counts[p] > g else inputs[p] for p in range(k)]
        ys_tail = [None] * k

        def run_tail(x):
            for p in reversed(range(r)) if reverse else range(r):
                x, y = layers[p](x, jax.tree.map(lambda a: a[g], inputs[p]))
                ys_tail[p] = jax.tree.map(lambda a: a[None], y)
            return x

        if reverse and r:
            x = run_tail(x)
        ys = [None] * k
        if g:
            x, ys = self._repeats(repeat, x, tuple(whole))
        if not reverse and r:
            x = run_tail(x)
        ys = [
            y if t is None else t if y is None else jax.tree.map(_concat, y, t)
            for y, t in zip(ys, ys_tail)
        ]
        new_state, aux = [], []
        for p in range(k):
            per_layer, aux_p = ys[p]
            aux.append(aux_p)
            if self.with_state:
                rec = self.records[p]
                new_state.append(
                    inplace.apply_updates(state[p], rec["treedef"], rec["updates"], per_layer)
                )
        return x, tuple(new_state), tuple(aux)

    def serve(self, params: tuple, state: tuple, x: Any, xs: list, rebuild) -> tuple:
        """The layers as a Python loop over per-layer buffers (the serving layout): layer
        i gets ``params[i]`` and ``state[i]`` whole and returns its own new state (written
        in place where its buffer is donated). Per-layer inputs are sliced per layer."""
        k, n = self.k, self.n
        layers = [self._layer(p, rebuild, serving=True) for p in range(k)]
        new_state, aux = [None] * n, [None] * n
        for i in reversed(range(n)) if self.options.reverse else range(n):
            slices = jax.tree.map(lambda a, i=i: a[i], xs)
            x, (new_state[i], aux[i]) = layers[i % k](x, (params[i], state[i], slices))
        stacked = tuple(jax.tree.map(lambda *a: jnp.stack(a), *aux[p::k]) for p in range(k))
        return x, tuple(new_state), stacked

    def through(self, params: tuple, state: tuple, x: Any, xs: list, rebuild) -> tuple:
        """``unroll=True`` with state: a Python loop of the layers over static indices. A
        layer that updates its state in place (a KV cache) reads and writes its row of the
        stacked state in place (:mod:`stackwise._core.through`: no copy of a layer's cache
        when the state is donated); another's new states are stacked, as a scan's are."""
        k, n = self.k, self.n
        for record in self.records:  # (decided afresh for this call's state)
            record.pop("through", None)
        new_state, aux = list(state), [None] * n
        rows: list[list] = [[None] * c for c in self.counts]  # (layers not written through)
        for i in reversed(range(n)) if self.options.reverse else range(n):
            p, j = i % k, i // k
            row = lambda tree, j=j: jax.tree.map(lambda a: a[j], tree)  # noqa: E731
            x, (out_state, aux[i]) = self._layer(p, rebuild, through=j)(
                x, (row(params[p]), new_state[p], row(_position(xs, p, k))))
            if self.records[p]["through"]:
                new_state[p] = out_state
            else:
                rows[p][j] = out_state
        for p in range(k):
            if not self.records[p]["through"]:
                new_state[p] = jax.tree.map(lambda *a: jnp.stack(a), *rows[p])
        stacked = tuple(jax.tree.map(lambda *a: jnp.stack(a), *aux[p::k]) for p in range(k))
        return x, tuple(new_state), stacked

    def _layer(self, p: int, rebuild, serving: bool = False, through: int | None = None
               ) -> Callable:
        """Position p's layer as a scan body ``x, (per_layer, aux)``, rematerialised.

        ``serving``: a body of :meth:`serve`, whose ``per_layer`` is the new state whole.
        ``through``: a body of :meth:`through` for row ``through`` of the position's
        stacked state, given and returned whole (``per_layer``)."""
        apply, record, who = self.applies[p], self.records[p], self.who
        has_aux = self.options.has_aux

        def layer(x, inputs):
            params, state, slices = inputs
            x = checkpoint_name(x, CARRY_NAME)
            if self.options.fsdp:
                params = checkpoint_name(gather(params, self.options.fsdp), _GATHERED_NAME)
            a, kw = rebuild(slices)
            if self.with_state:

                def with_state(params, x, state):
                    return check_pair(
                        apply(params, state, x, *a, **kw),
                        who,
                        "with `with_state=True` a layer returns `(out, layer_state)`",
                        "Return the state with the output, e.g. `return x, state`.",
                    )

                if serving:
                    out, per_layer = with_state(params, x, state)
                elif through is not None:
                    out, per_layer = self._write_through(p, with_state, params, x, state, through)
                else:
                    out, treedef, updates, per_layer = inplace.call(with_state, (params, x), state)
                    record.update(treedef=treedef, updates=updates)
            else:
                out, per_layer = apply(params, x, *a, **kw), None
            if has_aux:
                out = check_pair(
                    out,
                    who,
                    "with `has_aux=True` a layer returns `(x, aux)`",
                    "Return `(x, aux)`, or build the stack without `has_aux`.",
                )
            new_x, aux = out if has_aux else (out, None)
            checks.carry(x, new_x, who, has_aux, scanned=not (self.python_loop or serving))
            return new_x, (per_layer, aux)

        return _remat(layer, self.options, self.python_loop or serving)

    def _write_through(self, p: int, fn: Callable, params: Any, x: Any, stacked: Any,
                       j: int) -> tuple:
        """``fn(params, x, row j of stacked)``: with the row written through into
        ``stacked`` (:func:`through.call`), returning the stacked state, where the layer
        updates its state in place (decided at position p's first layer, in
        ``records[p]["through"]``); else returning the layer's new state."""
        record = self.records[p]
        if "through" not in record:
            rows = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stacked)
            record["through"] = through.keeps_layout(fn, (params, x), rows)
        if record["through"]:
            return through.call(fn, (params, x), stacked, j)
        return fn(params, x, jax.tree.map(lambda a: a[j], stacked))

    def _repeats(self, body: Callable, x: Any, xs: Any) -> tuple:
        """All whole repeats of the pattern, in checkpointed groups when ``nested``."""
        count, group, reverse = self.repeats, self.group, self.options.reverse
        if group is None:
            return self._loop(body, x, xs, count)
        n_groups, tail = divmod(count, group)
        whole = n_groups * group
        # The groups run first, then the smaller last group of `tail` repeats:
        # the end of the axis, or its start when running in reverse.
        groups_at, tail_at = ((tail, count), (0, tail)) if reverse else ((0, whole), (whole, count))
        groups_xs = jax.tree.map(
            lambda a: a.reshape(n_groups, group, *a.shape[1:]), _take(xs, *groups_at)
        )
        whole_remat = self.options._replace(remat=True, policy=None)
        run_group = _remat(
            lambda c, g_xs: self._loop(body, c, g_xs, group), whole_remat, self.python_loop
        )
        x, ys = self._loop(run_group, x, groups_xs, n_groups)
        ys = jax.tree.map(lambda a: a.reshape(whole, *a.shape[2:]), ys)
        if tail:
            x, ys_tail = self._loop(body, x, _take(xs, *tail_at), tail)
            parts = (ys_tail, ys) if reverse else (ys, ys_tail)
            ys = jax.tree.map(_concat, *parts)
        return x, ys

    def _loop(self, body: Callable, x: Any, xs: Any, length: int) -> tuple:
        """``lax.scan`` over the leading axis, or a Python loop when ``unroll=True``."""
        reverse = self.options.reverse
        if not self.python_loop:
            return jax.lax.scan(
                body, x, xs, length=length, reverse=reverse, unroll=self.options.unroll
            )
        ys = [None] * length
        for i in reversed(range(length)) if reverse else range(length):
            x, ys[i] = body(x, jax.tree.map(lambda a, i=i: a[i], xs))
        return x, jax.tree.map(lambda *y: jnp.stack(y), *ys)


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


def _concat(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.concatenate([a, b])


def _remat(body: Callable, options: Options, python_loop: bool) -> Callable:
    """``body(x, xs)`` with rematerialisation: the one home of remat.

    Inside a scan no CSE barriers are needed. In straight-line code only the
    carry ``x`` is protected; per-layer params and inputs ``xs`` (and
    closed-over constants, which ``jax.checkpoint`` never protects) are not.
    With ``fsdp`` the layer is always checkpointed, and its gathered params
    are never saved: the backward pass gathers them again.
    """
    if python_loop and jax.config.jax_disable_jit:
        return body  # eager debugging: nothing is staged, so nothing to remat
    policy = options.policy
    if options.fsdp:
        policy = _never_gathered(policy if options.remat else _everything)
    elif not options.remat:
        return body
    prevent_cse = (True, False) if python_loop else False
    return jax.checkpoint(body, prevent_cse=prevent_cse, policy=policy)


def _everything(*_, **__) -> bool:
    return True


def _never_gathered(policy: Callable | None) -> Callable:
    """``policy`` (None: save nothing), except that gathered params are never saved.

    A gather is a ``reshard`` of the layer's params slice: refusing to save
    ``reshard`` outputs makes the backward pass gather again from the slice
    (an input of the checkpoint, kept anyway). A ``reshard`` the layer itself
    applies to an activation is then redone in the backward pass as well.
    (Matched by primitive name: :func:`stackwise._upstream.jax.unless_resharded`.)
    """
    keep = policy if policy is not None else jax.checkpoint_policies.nothing_saveable
    return jax_ties.unless_resharded(keep, _GATHERED_NAME)
