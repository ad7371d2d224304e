"""``stackwise.autostack``: a loop model, traced once, run with its repeated blocks as one scan."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from stackwise._autostack import diagnose
from stackwise._autostack.find import Plan, candidates
from stackwise._autostack.find import runs as find_runs
from stackwise._autostack.run import evaluate
from stackwise._autostack.signature import Signatures
from stackwise._core.options import check_bool, check_remat
from stackwise._upstream import jax_functions

__all__ = ["Autostacked", "Found", "autostack"]

WHO = "stackwise.autostack"
_FIX = ("Make the blocks the same computation on the same shapes (a per-layer difference can "
        "be a value the blocks read, e.g. a traced layer index), or pass `best_effort=True` "
        "to run `fn` unchanged.")


class Found(NamedTuple):
    """A run :func:`autostack` found in ``fn``'s jaxpr (``f.runs``: every run stacked).

    Attributes:
      n: the blocks stacked into the scan (0: nothing was stacked).
      period: the equations of one block (a pattern of several layers is one block).
      start: the index of block 0's first equation among the jaxpr's top-level equations.
      stop: one past the last block's last equation.
      equations: the top-level equations of ``fn``'s jaxpr.
      params: the param leaves each block reads that are stacked (``"blocks"``).
      why: why nothing was stacked (with ``best_effort=True``); "" otherwise.
    """

    n: int
    period: int
    start: int
    stop: int
    equations: int
    params: int
    why: str = ""

    def __str__(self) -> str:
        if not self.n:
            return f"autostack: nothing stacked: {self.why}"
        return (f"autostack: {self.n} blocks of {self.period} equations (equations "
                f"{self.start}-{self.stop - 1} of {self.equations}) run as one scan, "
                f"{self.params} param leaves stacked per block")


class Autostacked:
    """``fn`` with each run of repeated blocks as one scan, returned by :func:`autostack`.

    ``out = f(stacked_params, *args)`` computes ``fn(params, *args)``; ``f.stack(params)``
    and ``f.unstack(stacked_params)`` convert params (bitwise, every leaf moved); ``f.runs``
    says what was stacked, a :class:`Found` per run in program order, and ``f.found`` is
    the longest run (or, where nothing was stacked, why).
    """

    def __init__(self, fn: Callable, runs: tuple[Found, ...], closed: Any = None,
                 plans: tuple[Plan, ...] = (), trees: tuple = (), remat: tuple = (False, None),
                 why: Found | None = None):
        self.fn, self.runs, self._closed, self._plans, self._remat = fn, runs, closed, plans, remat
        self.found = why if why is not None else max(runs, key=lambda r: r.n * r.period)
        if plans:
            self._params_def, self._args_def, self._out_def, self._paths = trees
            slots = [indices for plan in plans for indices in plan.params]
            self._stacked_of = {}  # params-leaf index -> (slot, block)
            for q, indices in enumerate(slots):
                for i, index in enumerate(indices):
                    self._stacked_of[index] = (q, i)
            self._slots = slots
            self._keys = [self._paths[indices[0]] for indices in slots]

    def __repr__(self) -> str:
        runs = "; ".join(str(r).removeprefix("autostack: ") for r in self.runs)
        return f"<Autostacked {getattr(self.fn, '__name__', 'fn')}: {runs or self.found}>"

    def stack(self, params: Any) -> Any:
        """``{"blocks": {path of block 0's leaf: the blocks' leaves stacked}, "rest": params
        with those leaves as None}``: every leaf moved bitwise."""
        if not self._plans:
            return params
        leaves = self._leaves(params, "params", self._params_def)
        blocks = {key: _stack([leaves[i] for i in indices])
                  for key, indices in zip(self._keys, self._slots)}
        rest = [None if i in self._stacked_of else leaf for i, leaf in enumerate(leaves)]
        return {"blocks": blocks, "rest": jax.tree.unflatten(self._params_def, rest)}

    def unstack(self, stacked_params: Any) -> Any:
        """The params tree ``fn`` takes, from :meth:`stack`'s layout (bitwise)."""
        if not self._plans:
            return stacked_params
        blocks, rest = self._parts(stacked_params)
        blocks = [_unsplit(stacked) for stacked in blocks]
        leaves = []
        rest_leaves = iter(rest)
        for i in range(self._params_def.num_leaves):
            if i in self._stacked_of:
                q, block = self._stacked_of[i]
                leaves.append(blocks[q][block])
            else:
                leaves.append(next(rest_leaves))
        return jax.tree.unflatten(self._params_def, leaves)

    def __call__(self, stacked_params: Any, *args: Any) -> Any:
        if not self._plans:
            return self.fn(stacked_params, *args)
        blocks, rest = self._parts(stacked_params)
        blocks = self._scanned(blocks)
        jaxpr = self._closed.jaxpr
        env = dict(zip(jaxpr.constvars, self._closed.consts))
        unstacked = [v for i, v in enumerate(jaxpr.invars[:self._params_def.num_leaves])
                     if i not in self._stacked_of]
        env.update(zip(unstacked, rest))
        arg_leaves = self._leaves(args, "args", self._args_def)
        invars = jaxpr.invars[self._params_def.num_leaves:]
        for k, (v, leaf) in enumerate(zip(invars, arg_leaves)):
            dtype = leaf.dtype if hasattr(leaf, "dtype") else jax.numpy.result_type(leaf)
            shape = tuple(jax.numpy.shape(leaf))
            if shape != tuple(v.aval.shape) or (dtype != v.aval.dtype and not v.aval.weak_type):
                raise TypeError(
                    f"{WHO}: leaf {k} of `*args` is {dtype}{list(shape)}, but `fn` was traced "
                    f"for {v.aval.dtype}{list(v.aval.shape)}: the program is specialised to the "
                    "example's shapes; call `stackwise.autostack` again with an example of the "
                    "new shape."
                )
        env.update(zip(invars, arg_leaves))
        outs = evaluate(jaxpr, env, self._plans, blocks, self._remat)
        return jax.tree.unflatten(self._out_def, outs)

    def _leaves(self, tree: Any, what: str, treedef: Any) -> list:
        leaves, got = jax.tree.flatten(tree)
        if got != treedef:
            raise TypeError(
                f"{WHO}: `{what}` is not the structure `fn` was traced with: "
                f"{_structure_difference(got, treedef)}."
            )
        return leaves

    def _parts(self, stacked_params: Any) -> tuple[list, list]:
        if not (isinstance(stacked_params, dict) and set(stacked_params) == {"blocks", "rest"}):
            raise TypeError(
                f"{WHO}: `stacked_params` is the dict `{{'blocks': ..., 'rest': ...}}` that "
                "`autostack` returns (or `f.stack(params)`); got "
                f"{type(stacked_params).__name__}. For the params `fn` takes, call "
                "`f(f.stack(params), ...)`."
            )
        blocks = stacked_params["blocks"]
        if not isinstance(blocks, dict) or set(blocks) != set(self._keys):
            raise TypeError(f"{WHO}: `stacked_params['blocks']` must hold the keys {self._keys}.")
        rest = self._leaves(stacked_params["rest"], "stacked_params['rest']", self._rest_def())
        return [blocks[key] for key in self._keys], rest

    def _scanned(self, blocks: list) -> list:
        """``blocks``, refused where an explicit mesh axis splits a layer axis (a scan reads
        one layer per step: ``lax.scan`` refuses such an ``xs``)."""
        for key, stacked in zip(self._keys, blocks):
            axis = _split_layers(stacked)
            if axis is not None:
                rest = ", ".join(map(repr, jax.typeof(stacked).sharding.spec[1:]))
                raise ValueError(
                    f"{WHO}: `stacked_params['blocks'][{key!r}]` is "
                    f"{jax.typeof(stacked).str_short()}: its layer axis is split over the "
                    f"mesh axis {axis!r}, but the scan reads one layer per step: its layer axis "
                    "stays unsplit, as `autostack` places it. Reshard it first: "
                    f"`jax.sharding.reshard(leaf, P(None{', ' if rest else ''}{rest}))`."
                )
        return blocks

    def _rest_def(self) -> Any:
        placeholder = [None if i in self._stacked_of else 0
                       for i in range(self._params_def.num_leaves)]
        return jax.tree.structure(jax.tree.unflatten(self._params_def, placeholder))


def autostack(
    fn: Callable[..., Any],
    params: Any,
    *example_args: Any,
    n: int | tuple[int, ...] | None = None,
    remat: bool | Callable[..., Any] | None = None,
    best_effort: bool = False,
) -> tuple[Any, Autostacked]:
    """Runs an unmodified loop model with each run of repeated blocks as one ``lax.scan``.

    ``fn(params, *args)`` is traced once on the examples; the longest run of consecutive
    blocks of top-level equations that are the same computation up to variable names
    (the same primitives, params, shapes and dtypes, each block reading its own param
    leaves, the previous block's values and values from before the run) is rewritten as a
    scan over the blocks' stacked params, and so is every other run of another block that
    is a stack of layers (each block reading param leaves of its own and the previous
    block's values: an encoder's layers, then a decoder's). A literal that differs from
    block to block (the ``i`` of ``fold_in(key, i)``) becomes a scanned input, a static
    slice of one array from before the run stepping from block to block along one axis
    (``keys[i]`` of keys split before the loop) a slice at the layer's index; a pattern of
    several different layers repeating is found as one longer block.

    The loop:

    >>> import jax, jax.numpy as jnp, stackwise
    >>> def model(params, x):
    ...     for layer in params["layers"]:
    ...         x = x + jnp.tanh(x @ layer["w"] + layer["b"])
    ...     return x @ params["head"]
    >>> keys = jax.random.split(jax.random.key(0), 5)
    >>> params = {"layers": [{"w": jax.random.normal(k, (8, 8)) / 8, "b": jnp.zeros((1, 8))}
    ...                      for k in keys[:4]], "head": jax.random.normal(keys[4], (8, 2))}
    >>> x = jnp.ones((3, 8))

    The same, as one scan over the 4 blocks:

    >>> stacked, f = stackwise.autostack(model, params, x)
    >>> print(f.found)  # doctest: +NORMALIZE_WHITESPACE
    autostack: 4 blocks of 4 equations (equations 0-15 of 17) run as one scan,
    2 param leaves stacked per block
    >>> stacked["blocks"]["['layers'][0]['w']"].shape
    (4, 8, 8)
    >>> bool(jnp.allclose(jax.jit(f)(stacked, x), model(params, x), atol=1e-6))
    True
    >>> jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), f.unstack(stacked), params))
    True

    Args:
      fn: ``out = fn(params, *args)``, a function of arrays (a Haiku ``apply``, a linen
        ``Module.apply``, a pure function over a list of per-layer dicts).
      params: a pytree of arrays: the layers' leaves are stacked, every other leaf is kept.
      *example_args: the other arguments ``fn`` is traced with; ``f`` takes arguments of
        the same structure, shapes and dtypes.
      n: the blocks expected: an int, one run of ``n`` blocks; a tuple, one count per run
        in program order (``n=(6, 4)``: an encoder's 6 layers, then a decoder's 4). Other
        runs, or runs of other lengths, are refused.
      remat: rematerialise each block in the backward pass, as :func:`stackwise.stack`'s
        ``remat``: ``None``/``False`` (store every residual, as the loop does), ``True`` or a
        :mod:`jax.checkpoint_policies` policy. The carry entering each block is named
        :data:`stackwise.CARRY_NAME`.
      best_effort: where no run is found, or the loop is broken, return ``params`` as
        given and ``fn`` unchanged (``f.found.why`` says why) instead of raising.

    Returns:
      ``(stacked_params, f)``: ``stacked_params`` is ``{"blocks": {path of block 0's
      leaf: the n blocks' leaves stacked on a new leading axis}, "rest": params with those
      leaves as None}``; ``f`` an :class:`Autostacked`: ``out = f(stacked_params, *args)``,
      ``f.unstack(stacked_params)`` gives the params back bitwise, ``f.stack(params)``
      converts fresh params, ``f.runs`` says what was stacked (a :class:`Found` per run,
      their leaves all in ``"blocks"``), ``f.found`` is the longest run. Leaves placed with one
      ``NamedSharding`` are stacked onto its mesh as ``P(None, *spec)``, and unstacked
      placed as they were.

    Raises:
      TypeError: ``fn`` not callable, ``params`` not a pytree of arrays, a non-bool
        ``best_effort``, an unknown ``remat``, ``n`` not an int or a tuple of ints.
      ValueError: a count in ``n`` below 2, ``params`` with no leaves, or no run of 2 or
        more blocks found, a broken loop (the same block recurs apart from its run) or
        other runs than ``n`` says: the message names the first block that differs, its
        equation, and how.
    """
    if not callable(fn):
        raise TypeError(f"{WHO}: `fn` must be callable, got {type(fn).__name__} {fn!r}. "
                        "Call it as `stackwise.autostack(fn, params, *example_args)`.")
    check_bool(best_effort, "best_effort", WHO)
    rematted = check_remat(remat, WHO)
    _check_n(n)
    path_leaves, params_def = jax.tree_util.tree_flatten_with_path(params)
    if not path_leaves:
        raise ValueError(f"{WHO}: `params` has no leaves; give the model's params as arrays.")
    for path, leaf in path_leaves:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise TypeError(
                f"{WHO}: `params` must be a pytree of arrays, but the leaf at "
                f"`params{jax.tree_util.keystr(path)}` is {type(leaf).__name__} {leaf!r}; pass "
                "Python values in `example_args`, or close over them in `fn`. For an Equinox "
                "module, split off its arrays: not `autostack(lambda m, x: m(x), model, x)` but "
                "`params, static = eqx.partition(model, eqx.is_array)` and "
                "`autostack(lambda p, x: eqx.combine(p, static)(x), params, x)`."
            )
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(params, *example_args)
    closed = _inline_whole(closed)
    jaxpr = closed.jaxpr
    sigs = Signatures()
    eqns = jaxpr.eqns
    ids = np.array([sigs.of(e) for e in eqns], dtype=np.int64)
    search = find_runs(jaxpr, ids, len(path_leaves), _readers(jaxpr))
    plans, failures, top = search.plans, search.failures, search.top
    if not plans and top is None and len(eqns) >= 2:
        # Nothing repeats: where blocks differ in the functions they hold only, line them up
        # with every function alike, to name the first block that differs and how.
        loose = Signatures(loose=True)
        lined_up = candidates(np.array([loose.of(e) for e in eqns], dtype=np.int64))
        top = lined_up[0] if lined_up else None
    if not plans:
        problem = diagnose.no_run(eqns, ids, sigs, top, failures)
    else:
        problem = diagnose.broken(eqns, ids, sigs, search, n)
    if problem is not None:
        if best_effort:
            why = Found(0, 0, 0, 0, len(eqns), 0, problem)
            return params, Autostacked(fn, (), why=why)
        raise ValueError(f"{WHO}: {problem}. {_FIX}")
    paths = [jax.tree_util.keystr(path) for path, _ in path_leaves]
    args_def = jax.tree.structure(example_args)
    found = tuple(Found(plan.count, plan.period, plan.start, plan.stop, len(eqns),
                        len(plan.params)) for plan in plans)
    trees = (params_def, args_def, jax.tree.structure(shapes), paths)
    f = Autostacked(fn, found, closed, tuple(plans), trees, rematted)
    return f.stack(params), f


def _readers(jaxpr: Any) -> dict:
    """Each variable -> the indices of the equations that read it (``-1``: an output)."""
    readers: dict = {}
    for r, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if hasattr(v, "count") or not hasattr(v, "val"):
                readers.setdefault(v, []).append(r)
    for v in jaxpr.outvars:
        if not hasattr(v, "val"):
            readers.setdefault(v, []).append(-1)
    return readers


def _check_n(n: Any) -> None:
    """``n``: None, an int of at least 2, or a tuple of such ints (one per run)."""
    counts = n if isinstance(n, (tuple, list)) else (n,)
    if n is None:
        return
    if not counts or any(isinstance(c, bool) or not isinstance(c, int) for c in counts):
        raise TypeError(
            f"{WHO}: `n` must be None, an int (the blocks of the longest run) or a tuple of "
            f"ints (the blocks of each run, in program order), got {n!r}."
        )
    if any(c < 2 for c in counts):
        raise ValueError(f"{WHO}: `n` must be at least 2 (a run of blocks), got {n!r}.")


def _stack(leaves: list) -> Any:
    """The blocks' leaves on a new leading axis; where each is an array of one
    ``NamedSharding``, the stack is placed on that mesh with the layer axis unsplit in front
    (``P(None, *spec)``), as :func:`stackwise.stack_layers` places a stack."""
    concrete = all(jax_functions.is_concrete_array(leaf) for leaf in leaves)
    sharding = leaves[0].sharding if concrete else None
    same = isinstance(sharding, jax.sharding.NamedSharding) and all(
        leaf.sharding == sharding for leaf in leaves)
    if not same:
        return jax.numpy.stack(leaves)
    spec = jax.sharding.PartitionSpec(None, *sharding.spec)
    return _stack_onto(sharding.update(spec=spec))(leaves)


@functools.cache
def _stack_onto(sharding: Any) -> Callable:
    return jax.jit(jax.numpy.stack, out_shardings=sharding)


def _split_layers(stacked: Any) -> Any:
    """The mesh axis that splits a stack's layer axis in its type (an explicit mesh's), or
    None."""
    if not isinstance(stacked, jax.Array):
        return None
    spec = getattr(getattr(jax.typeof(stacked), "sharding", None), "spec", None)
    return spec[0] if spec else None


def _unsplit(stacked: Any) -> Any:
    """A stack whose layer axis an explicit mesh axis splits, resharded with that axis unsplit
    (each layer's leaf then slices out as the loop placed it); any other as it is."""
    if _split_layers(stacked) is None:
        return stacked
    typed = jax.typeof(stacked).sharding
    spec = jax.sharding.PartitionSpec(None, *typed.spec[1:])
    return jax.sharding.reshard(stacked, typed.update(spec=spec))


def _structure_difference(got: Any, want: Any) -> str:
    """How two treedefs differ, in words: the leaf paths one has and the other lacks, else
    the node where they part (a class made twice, another static field)."""

    def paths(treedef: Any) -> list[str]:
        tree = jax.tree.unflatten(treedef, [0] * treedef.num_leaves)
        return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]

    try:
        got_paths, want_paths = paths(got), paths(want)
    except Exception:  # noqa: BLE001  (a node that cannot be rebuilt from placeholders)
        return f"it has the structure {got}, but `fn` was traced with {want}"
    missing = [p for p in want_paths if p not in set(got_paths)]
    extra = [p for p in got_paths if p not in set(want_paths)]
    if missing or extra:
        return (f"it lacks {len(missing)} leaves `fn` was traced with "
                f"({', '.join(missing[:3]) or 'none'}{', ...' if len(missing) > 3 else ''}) and "
                f"has {len(extra)} others ({', '.join(extra[:3]) or 'none'}"
                f"{', ...' if len(extra) > 3 else ''})")
    for a, b in zip(_nodes(got), _nodes(want)):
        if a != b:
            return (f"the same leaves at the same paths, but a node differs: {a[0]} where `fn` "
                    f"was traced with {b[0]} (another class of the same name, made twice, or "
                    "other static fields)")
    return f"it has the structure {got}, but `fn` was traced with {want}"


def _nodes(treedef: Any) -> list[tuple[str, Any]]:
    """The nodes of a treedef, depth first: each as ``(words, what tells it apart)``."""
    out = []
    for child in [treedef, *_descendants(treedef)]:
        data = child.node_data()
        if data is None:
            continue
        kind, aux = data
        out.append((f"`{getattr(kind, '__qualname__', kind)}` (of {kind.__module__}, "
                    f"id {id(kind):#x}) with {_short(aux)}", (kind, aux)))
    return out


def _descendants(treedef: Any) -> list:
    found = []
    for child in treedef.children():
        found.append(child)
        found.extend(_descendants(child))
    return found


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _inline_whole(closed: Any) -> Any:
    """The body of a ``jax.jit`` that wraps the whole model (its one equation), else as is."""
    eqns = closed.jaxpr.eqns
    if len(eqns) == 1 and eqns[0].primitive.name in ("jit", "pjit") and not closed.consts:
        eqn = eqns[0]
        if list(eqn.invars) == list(closed.jaxpr.invars) and list(eqn.outvars) == list(
            closed.jaxpr.outvars
        ):
            return _inline_whole(eqn.params["jaxpr"])
    return closed
