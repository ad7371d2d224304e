"""stackwise's ties to JAX internals, each read from jax 0.10.2 and guarded.

stackwise relies on JAX beyond its public API in three places:

- :func:`eval_jaxpr` copies JAX's jaxpr evaluation loop, so that a stacked layer's state
  updates written with ``lax.dynamic_update_slice`` are found (:mod:`stackwise._core.inplace`;
  every Haiku and linen ``Stack`` runs through it). :func:`update_slice_parts` reads such an
  update's operands.
- :func:`unless_resharded`, :func:`unless_all_gathered` and :func:`unless_sliced` build remat
  policies that match primitives by name: the gathered params (``reshard``, ``all_gather``,
  the ``name`` of :func:`jax.ad_checkpoint.checkpoint_name`) and the slices a pipeline stage
  takes of its stacks (``dynamic_slice``, ``slice``, ``squeeze`` taking leading rows of an
  operand of a stack's shape, read from their params) are never saved.
- :func:`unbatched_output_path` reads ``jax.vmap``'s refusal of an output that varies along
  the mapped axis where ``out_axes`` says None, so that a batch of LoRA adapters can name
  the layer's state that differs by group (:mod:`stackwise._finetune.layer`).

Each tie has a probe (:data:`TIES`). :func:`check` runs one and raises
:class:`UpstreamChanged` naming the tie (the fast tier does, in
``tests/core/test_upstream_jax.py``); :func:`holds` runs it once, at first use, and when it
fails warns and makes the code take an exact path: the layer's state returned whole
(slower), or a policy that saves nothing (more recomputation). Never a different result.
(:func:`unbatched_output_path` only reads an error: if its tie breaks, the error passes on
as JAX wrote it, a refusal all the same.)
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "CALL_PRIMITIVES",
    "MIRRORS",
    "SLICE_PRIMITIVES",
    "TIES",
    "UpstreamChanged",
    "bind",
    "check",
    "eval_jaxpr",
    "holds",
    "run_probe",
    "source_line",
    "unless_all_gathered",
    "unless_resharded",
    "takes_rows",
    "unbatched_output_path",
    "unless_sliced",
    "update_slice_parts",
]

#: The jax release every tie below was read from and checked against.
MIRRORS = "0.10.2"

EVAL_LOOP = "the jaxpr evaluation loop"
UPDATE_SLICE = "dynamic_update_slice's operands"
RESHARD = "jax.reshard's primitive"
ALL_GATHER = "lax.all_gather's primitive"
NAME = "checkpoint_name's primitive"
SLICES = "the slicing primitives and their params"
VMAP_OUT_AXES = "vmap's refusal of a batched output under out_axes=None"


class UpstreamChanged(RuntimeError):
    """A tie to JAX internals no longer holds (raised by :func:`check`; ``module``: the
    file of the tie)."""

    def __init__(self, tie: str, detail: str, module: str = "stackwise/_upstream/jax.py"):
        super().__init__(
            f"JAX changed under stackwise: the tie to {tie} ({module}, "
            f"written against jax {MIRRORS}; jax {jax.__version__} is installed) no longer "
            f"holds: {detail}. stackwise takes its exact slower path instead; update the tie."
        )
        self.tie = tie


def _expect(tie: str, ok: bool, detail: str) -> None:
    if not ok:
        raise UpstreamChanged(tie, detail)


# --------------------------------------------------------------------------
# The evaluation loop (jax 0.10.2: jax/_src/core.py, eval_jaxpr).

#: Call-like primitives whose body :func:`eval_jaxpr` may evaluate inline (jax 0.10.2:
#: ``jax.jit`` binds "jit", older releases "pjit"; ``closed_call``, ``core_call``). If one
#: is renamed, its body is bound whole: an update inside it is not found, and that state
#: leaf leaves the layer whole (slower, the same result).
CALL_PRIMITIVES = ("jit", "pjit", "closed_call", "core_call")


def eval_jaxpr(
    jaxpr: Any,
    consts: list,
    args: list,
    inline: Callable[[list], bool],
    observe: Callable[[str, list, list], None],
    instead: Callable[[str, list], list | None] | None = None,
    materialize: Callable[[list], list] | None = None,
    with_params: bool = False,
) -> list:
    """Evaluates ``jaxpr`` on ``args`` as :func:`jax.core.eval_jaxpr` does, equation by equation.

    A call equation (:data:`CALL_PRIMITIVES`) whose inputs ``inline`` accepts has its body
    evaluated here, recursively; every other equation is bound, then ``observe(primitive
    name, inputs, outputs)`` sees it. ``instead(primitive name, inputs)``, if given, may compute
    an equation's outputs instead (a list), or return ``None``; then ``materialize``, if
    given, makes the inputs that the primitive is bound to (``materialize(inputs)``). With
    ``with_params``, ``instead`` is called as ``instead(name, inputs, eqn)``, the equation
    there to read its params or to be bound by :func:`bind`.

    Mirrors jax 0.10.2's ``jax._src.core.eval_jaxpr``: ``Literal.val``, ``DropVar`` outputs,
    ``eqn.ctx.manager`` around ``primitive.bind(*ins, **primitive.get_bind_params(params))``,
    ``multiple_results``; a call's body is its ``jaxpr`` (a ClosedJaxpr) or ``call_jaxpr``
    (a Jaxpr) param. It leaves out what changes no value: source-info propagation (the
    layer's op names in the HLO) and dropping dead values early. If upstream's loop gains a
    step, this copy could compute something else: the probe compares the two on jaxprs with
    nested calls, literals and multiple results.
    """
    from jax.extend.core import DropVar, Literal  # (here: jax.extend loads Pallas, ~0.3 s)

    env: dict = {}
    read = lambda v: v.val if isinstance(v, Literal) else env[v]  # noqa: E731
    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        body = _call_body(eqn)
        if body is not None and inline(ins):
            outs = eval_jaxpr(body[0], body[1], ins, inline, observe, instead, materialize,
                              with_params)
        elif instead is not None and (found := (
                instead(eqn.primitive.name, ins, eqn) if with_params
                else instead(eqn.primitive.name, ins))) is not None:
            outs = found
        else:
            ins = materialize(ins) if materialize is not None else ins
            outs = bind(eqn, ins)
            observe(eqn.primitive.name, ins, outs)
        for v, out in zip(eqn.outvars, outs):
            if not isinstance(v, DropVar):
                env[v] = out
    return [read(v) for v in jaxpr.outvars]


def bind(eqn: Any, ins: list) -> list:
    """One equation of a jaxpr bound on ``ins``, as :func:`eval_jaxpr`'s step does: its
    outputs as a list (``eqn.ctx.manager`` around ``primitive.bind(*ins,
    **primitive.get_bind_params(params))``; jax 0.10.2, checked by the evaluation loop's
    probe). :mod:`stackwise._autostack` re-emits a traced model's equations with it."""
    with eqn.ctx.manager:
        outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
    return list(outs) if eqn.primitive.multiple_results else [outs]


def source_line(eqn: Any) -> str:
    """Where the user's code made ``eqn``, as ``file:line (function)``, or "" when JAX's
    private source-info summary (jax 0.10.2: ``jax._src.source_info_util.summarize``) is
    gone: it only words an error message, so its loss loses no result."""
    try:
        from jax._src import source_info_util

        return str(source_info_util.summarize(eqn.source_info))
    except Exception:  # (words only)
        return ""


def _call_body(eqn: Any) -> tuple | None:
    """A call equation's body as ``(jaxpr, consts)``; ``None`` for any other equation."""
    if eqn.primitive.name not in CALL_PRIMITIVES:
        return None
    inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if hasattr(inner, "consts"):
        return inner.jaxpr, inner.consts
    return inner, []


class UpdateSlice(NamedTuple):
    """A ``dynamic_update_slice``'s operands: ``operand`` with ``update`` written at ``starts``."""

    operand: Any
    update: Any
    starts: list


def update_slice_parts(name: str, ins: list) -> UpdateSlice | None:
    """A bound equation's operands if it is a ``dynamic_update_slice``, else ``None``.

    Mirrors jax 0.10.2's ``dynamic_update_slice_p``: operands ``(operand, update,
    *start_indices)``, one scalar start per dimension. A renamed primitive finds no
    update (the leaf leaves the layer whole: slower); reordered operands would record a
    wrong update, which the probe catches.
    """
    if name != "dynamic_update_slice":
        return None
    return UpdateSlice(ins[0], ins[1], list(ins[2:]))


# --------------------------------------------------------------------------
# Remat policies that match primitives by name (jax 0.10.2: jax/_src/ad_checkpoint.py calls
# a policy as `policy(prim, *in_avals, **params)` for each equation it may save).


def _nothing(*_, **__) -> bool:
    return False


def _refusing(keep: Callable, ties: tuple, refuse: Callable) -> Callable[..., bool]:
    """``keep``, except what ``refuse(prim, avals, params)`` says; if a tie is broken,
    a policy that saves nothing (the backward pass recomputes all: exact, slower)."""
    if not all(holds(t) for t in ties):
        return _nothing

    def save(prim, *avals, **params):
        if refuse(prim, avals, params):
            return False
        return keep(prim, *avals, **params)

    return save


def _named(prim: Any, params: dict, name: str) -> bool:
    # jax 0.10.2: checkpoint_name(x, name) binds `name_p` ("name") with param `name`. If it
    # changes, a value tagged gathered could be saved (memory, not values).
    return prim.name == "name" and params.get("name") == name


def unless_resharded(keep: Callable, name: str) -> Callable[..., bool]:
    """``keep``, except that a ``reshard``'s output and a value named ``name`` are never saved.

    Relies on :func:`jax.reshard` binding a primitive named ``"reshard"`` (jax 0.10.2). If
    it is renamed, the stack's gathered params would be saved for the backward pass (the
    memory FSDP is there to save); the probe then makes this a policy that saves nothing.
    """
    return _refusing(
        keep, (RESHARD, NAME), lambda p, a, k: p.name == "reshard" or _named(p, k, name)
    )


def unless_all_gathered(keep: Callable, name: str) -> Callable[..., bool]:
    """``keep``, except that an ``all_gather``'s output and a value named ``name`` are never
    saved.

    Relies on :func:`jax.lax.all_gather` binding a primitive named ``"all_gather"`` (jax
    0.10.2). If it is renamed, a pipeline stage's gathered params would be saved; the probe
    then makes this a policy that saves nothing.
    """
    return _refusing(
        keep, (ALL_GATHER, NAME), lambda p, a, k: p.name == "all_gather" or _named(p, k, name)
    )


#: The primitives that take a part of an array (jax 0.10.2): ``lax.dynamic_slice_in_dim``
#: and ``lax.dynamic_index_in_dim`` bind ``dynamic_slice`` (then ``squeeze``), ``v[i]`` and
#: ``v[a:b]`` bind ``slice`` (then ``squeeze``), each with the sliced array as operand 0.
SLICE_PRIMITIVES = ("dynamic_slice", "slice", "squeeze")


def takes_rows(name: str, shape: tuple, params: dict) -> bool:
    """Whether a ``name`` equation with ``params`` takes rows of its operand, of ``shape``,
    along the leading axis, the rest whole
    (``v[i]``, ``v[a:b]``, ``lax.dynamic_slice_in_dim(v, i, k)``, or the squeeze of a row).

    Reads jax 0.10.2's params: ``dynamic_slice``'s ``slice_sizes``; ``slice``'s
    ``start_indices``, ``limit_indices`` and ``strides`` (None or ones); ``squeeze``'s
    ``dimensions``. The probe checks each reading on the four takes.
    """
    if not shape:
        return False
    if name == "dynamic_slice":
        return tuple(params["slice_sizes"])[1:] == shape[1:]
    if name == "slice":
        strides = params["strides"]
        return (
            tuple(params["start_indices"])[1:] == (0,) * (len(shape) - 1)
            and tuple(params["limit_indices"])[1:] == shape[1:]
            and (strides is None or all(s == 1 for s in strides))
        )
    if name == "squeeze":
        return tuple(params["dimensions"]) == (0,) and shape[0] == 1
    return False


def unless_sliced(keep: Callable, shapes: set) -> Callable[..., bool]:
    """``keep``, except that rows taken of an operand of one of ``shapes`` are never saved.

    A remat policy sees an equation's primitive, its operands' avals and its params, not
    where an operand came from: so a slice of a stack is recognised by what it takes (rows
    along the leading axis, the rest whole: :func:`takes_rows`) of an operand of a stack's
    shape. Another value of exactly a stack's shape whose rows are taken the same way is
    not saved either: the backward pass takes them again (never a different value). A
    slice along another axis, or of another shape, is kept as ``keep`` says.
    (``jax.ad_checkpoint.checkpoint_name`` is no exact alternative: it names the slice's
    output in an equation of its own, and the slice's equation would still be saved.)

    Relies on the slices of :data:`SLICE_PRIMITIVES` and their params (jax 0.10.2). If a
    slice binds another primitive or its params change, a chunk of the params would be
    saved at every tick; the probe then makes this a policy that saves nothing.
    """

    def refuse(prim: Any, avals: tuple, params: dict) -> bool:
        if prim.name not in SLICE_PRIMITIVES:
            return False
        shape = tuple(avals[0].shape)
        return shape in shapes and takes_rows(prim.name, shape, params)

    return _refusing(keep, (SLICES,), refuse)


# --------------------------------------------------------------------------
# vmap's refusal of a batched output (jax 0.10.2: jax/_src/api.py, `vmap_f` turns a
# `batching.SpecMatchError` into this ValueError).

_UNBATCHED = re.compile(
    r"at vmap out_axes(?P<path>.*), got axis spec None but output was batched on axis \d+"
)


def unbatched_output_path(error: BaseException) -> str | None:
    """The output's path (``keystr``) if ``error`` is ``jax.vmap``'s refusal of an output
    that varies along the mapped axis where ``out_axes`` says None; else None.

    Mirrors jax 0.10.2's message ``"at vmap out_axes{keystr(path)}, got axis spec None
    but output was batched on axis {axis}"``. If the wording changes, the error is not
    recognised and passes on as JAX raised it: still a refusal, with JAX's words.
    """
    found = _UNBATCHED.fullmatch(str(error)) if isinstance(error, ValueError) else None
    return found["path"] if found else None


# --------------------------------------------------------------------------
# The probes: each checks its tie directly, on small jaxprs.


def _asked(fn: Callable, *args: Any, around: Callable = lambda f: f) -> list:
    """``(primitive name, operand shapes, params)`` for each equation a remat policy is
    asked about when ``jax.grad`` runs through ``around(jax.checkpoint(fn))`` (traced
    only)."""
    asked = []

    def record(prim, *avals, **params):
        asked.append((prim.name, tuple(tuple(a.shape) for a in avals), params))
        return False

    def loss(*a):
        return jnp.sum(around(jax.checkpoint(fn, policy=record))(*a))

    jax.make_jaxpr(jax.grad(loss))(*args)
    return asked


def _mesh() -> Any:
    return jax.sharding.AbstractMesh((1,), ("probe",))


def _probe_reshard() -> None:
    spec = jax.sharding.NamedSharding(_mesh(), jax.sharding.PartitionSpec())
    asked = _asked(lambda v: jnp.sin(jax.reshard(v, spec)), _shape(2, 3))
    names = [n for n, _, _ in asked]
    _expect(RESHARD, "reshard" in names, f"a checkpointed jax.reshard showed {names}")


def _probe_all_gather() -> None:
    P = jax.sharding.PartitionSpec

    def fn(v):
        return jnp.sin(jax.lax.all_gather(v, "probe", axis=0, tiled=True))

    def around(f):  # the checkpoint inside the device program, as a pipeline's is
        return jax.shard_map(f, mesh=_mesh(), in_specs=P("probe"), out_specs=P(), check_vma=False)

    names = [n for n, _, _ in _asked(fn, _shape(2, 3), around=around)]
    _expect(ALL_GATHER, "all_gather" in names, f"a checkpointed lax.all_gather showed {names}")


def _probe_name() -> None:
    from jax.ad_checkpoint import checkpoint_name

    asked = _asked(lambda v: jnp.sin(checkpoint_name(v, "probe")), _shape(2, 3))
    found = [(n, k) for n, _, k in asked if n == "name"]
    _expect(NAME, found == [("name", {"name": "probe"})], f"checkpoint_name showed {asked}")


def _probe_slices() -> None:
    takes = {
        "lax.dynamic_slice_in_dim": lambda v, i: jax.lax.dynamic_slice_in_dim(v, i, 2),
        "lax.dynamic_index_in_dim": lambda v, i: jax.lax.dynamic_index_in_dim(v, i, 0, False),
        "v[0]": lambda v, i: v[0],
        "v[1:3]": lambda v, i: v[1:3],
    }
    for what, take in takes.items():
        fn = lambda v, i, take=take: jnp.sin(take(v, i))  # noqa: E731
        asked = _asked(fn, _shape(4, 3), _shape(dtype=jnp.int32))
        on_stack = {n for n, shapes, _ in asked if shapes[:1] == ((4, 3),)}
        _expect(
            SLICES,
            bool(on_stack) and on_stack <= set(SLICE_PRIMITIVES),
            f"{what} of a (4, 3) stack binds {sorted(on_stack)}, not only {list(SLICE_PRIMITIVES)}",
        )
        rows = [n for n, s, k in asked if n in SLICE_PRIMITIVES and takes_rows(n, s[0], k)]
        _expect(SLICES, bool(rows), f"{what}: no equation read as rows taken, of {asked}")
    columns = {
        "lax.dynamic_slice_in_dim(axis=1)": lambda v: jax.lax.dynamic_slice_in_dim(v, 1, 2, 1),
        "v[:, 1:3]": lambda v: v[:, 1:3],
    }
    for what, take in columns.items():
        asked = _asked(lambda v, take=take: jnp.sin(take(v)), _shape(4, 3))
        read = [n for n, s, k in asked if n in SLICE_PRIMITIVES and takes_rows(n, s[0], k)]
        _expect(SLICES, not read, f"{what} read as rows taken: {read}")


def _probe_fn(cache: Any, new: Any, i: Any) -> tuple:
    """A function with the kinds of equation :func:`eval_jaxpr` meets: nested calls (a
    ``jit`` in a ``jit``, and ``called``, which :func:`_probe_jaxpr` makes a
    ``closed_call``), literals, a multiple-results primitive."""

    @jax.jit
    def write(c, u, i):
        return jax.lax.dynamic_update_index_in_dim(c, u * 2.0, i, 0)  # itself a jit

    @jax.jit
    def called(c):
        return jnp.cumsum(c, axis=1) + 1.0

    keys, values = jax.lax.sort((new, new * -1.0), num_keys=1)
    out = write(cache, keys + values, i)
    return called(out), jnp.where(i > 0, out, 0.0), keys


def _probe_jaxpr(args: tuple) -> Any:
    """:func:`_probe_fn`'s jaxpr, its call of ``called`` made a ``closed_call`` (what
    jax 0.10.2 emits where it hoists or drops a custom rule)."""
    from jax.extend.core import primitives

    closed = jax.make_jaxpr(_probe_fn)(*args)
    eqns = [
        e.replace(primitive=primitives.closed_call_p, params={"call_jaxpr": e.params["jaxpr"]})
        if e.params.get("name") == "called"
        else e
        for e in closed.jaxpr.eqns
    ]
    return closed.replace(jaxpr=closed.jaxpr.replace(eqns=eqns))


def _probe_eval_loop() -> None:
    """Traced only: binding every equation stages the program ``jax.core.eval_jaxpr``
    stages; evaluating the calls inline stages the program traced without ``jit``."""
    args = (_shape(4, 3), _shape(3), _shape(dtype=jnp.int32))
    closed = _probe_jaxpr(args)
    calls = {e.primitive.name for e in closed.jaxpr.eqns if _call_body(e) is not None}
    _expect(EVAL_LOOP, calls == {"closed_call", "jit"}, f"the probe's calls are {calls}")

    def ours(inline):
        return lambda *a: eval_jaxpr(closed.jaxpr, closed.consts, list(a), inline, _ignore)

    def upstream(*a):
        return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *a)

    got, want = jax.make_jaxpr(ours(_never))(*args), jax.make_jaxpr(upstream)(*args)
    _expect(EVAL_LOOP, str(got) == str(want), f"it staged\n{got}\nnot, as jax does,\n{want}")
    got = jax.make_jaxpr(ours(_always))(*args)
    with jax.disable_jit():
        want = jax.make_jaxpr(_probe_fn)(*args)
    _expect(EVAL_LOOP, str(got) == str(want), f"inline, it staged\n{got}\nnot\n{want}")


def _probe_update_slice() -> None:
    """Traced only: the operands it reads are the update's operand, update and starts."""
    args = (_shape(4, 5), _shape(2, 3))
    closed = jax.make_jaxpr(lambda c, u: jax.lax.dynamic_update_slice(c, u, (1, 2)))(*args)
    found = []

    def run(*a):
        def observe(name, ins, outs):
            parts = update_slice_parts(name, ins)
            if parts is not None:
                starts = [int(s) for s in parts.starts]  # literals: concrete
                found.append((parts.operand is a[0], parts.update is a[1], starts))

        return eval_jaxpr(closed.jaxpr, closed.consts, list(a), _always, observe)

    jax.make_jaxpr(run)(*args)
    want = [(True, True, [1, 2])]  # (the operand?, the update?, the starts)
    _expect(UPDATE_SLICE, found == want, f"its operands read as {found}, not {want}")


def _probe_vmap_out_axes() -> None:
    """Traced only: a batched output where out_axes says None is refused, the message read."""
    mapped = jax.vmap(lambda v: (v, {"kept": v * 2.0}), out_axes=(0, None))
    try:
        jax.eval_shape(mapped, _shape(3))
    except ValueError as e:
        path = unbatched_output_path(e)
        _expect(VMAP_OUT_AXES, path == "[1]['kept']", f"its message read {str(e)!r}")
        return
    _expect(VMAP_OUT_AXES, False, "a batched output passed where out_axes said None")


def _shape(*shape: int, dtype: Any = jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def _never(_) -> bool:
    return False


def _always(_) -> bool:
    return True


def _ignore(*_) -> None:
    pass


#: Every tie, with its probe.
TIES: dict[str, Callable[[], None]] = {
    EVAL_LOOP: _probe_eval_loop,
    UPDATE_SLICE: _probe_update_slice,
    RESHARD: _probe_reshard,
    ALL_GATHER: _probe_all_gather,
    NAME: _probe_name,
    SLICES: _probe_slices,
    VMAP_OUT_AXES: _probe_vmap_out_axes,
}


def check(tie: str) -> None:
    """Runs ``tie``'s probe; raises :class:`UpstreamChanged` naming the tie if it fails."""
    run_probe(TIES, tie, "stackwise/_upstream/jax.py")


def run_probe(ties: dict[str, Callable[[], None]], tie: str, module: str) -> None:
    """Runs ``ties[tie]``, the probe of a tie of ``module``; raises :class:`UpstreamChanged`
    naming the tie and the module if it fails (every module of ties checks through here)."""
    # The probes only trace, on shapes (the first use is often inside a trace), on their
    # own mesh (the first use is often under the user's), with the calls staged as calls
    # even under `jax.disable_jit`.
    no_mesh = jax.sharding.AbstractMesh((), ())
    with jax.disable_jit(False), jax.sharding.use_abstract_mesh(no_mesh):
        try:
            ties[tie]()
        except UpstreamChanged:
            raise
        except Exception as e:
            raise UpstreamChanged(tie, f"its probe raised {type(e).__name__}: {e}",
                                  module) from e


@functools.cache
def holds(tie: str) -> bool:
    """Whether ``tie`` holds with the installed jax (its probe, run once); warns if not."""
    try:
        check(tie)
    except UpstreamChanged as e:
        warnings.warn(str(e), RuntimeWarning, stacklevel=2)
        return False
    return True
