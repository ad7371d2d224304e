"""What passes an optimisation barrier: a data-flow pass over a lowered StableHLO program.

:func:`optimization_barrier_bytes` reads ``jax.jit(f).lower(...).as_text()`` and counts the
bytes of params and of constants that pass ``stablehlo.optimization_barrier`` per run:
remat that puts params through barriers (``jax.checkpoint``'s default ``prevent_cse=True``)
shows there, without running anything. Pure text analysis: jax is used only in the examples.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

__all__ = ["BarrierBytes", "optimization_barrier_bytes"]


class BarrierBytes(NamedTuple):
    """Bytes passing ``stablehlo.optimization_barrier`` ops, per execution of the program.

    Attributes:
      params: bytes of operands that are the program's param arguments (or slices,
        reshapes, casts... of them).
      consts: bytes of operands that are constants of the program (or views of them).
      total: bytes of all barrier operands (params, constants and activations).
      count: the number of barrier ops in the program text (static, not weighted).
      exact: False when a loop's trip count could not be read and was counted once.
    """

    params: int
    consts: int
    total: int
    count: int
    exact: bool


# Ops whose result holds the same data as their first operand, or a part or copy of it.
_VIEW_OPS = frozenset(
    {
        "broadcast_in_dim",
        "reshape",
        "transpose",
        "convert",
        "bitcast_convert",
        "slice",
        "dynamic_slice",
        "copy",
        "reverse",
        "custom_call",  # @Sharding / @SPMDFullToShardShape annotations
    }
)
_VALUE = re.compile(r"%[\w$.-]+(?:#\d+)?")
_DEFINE = re.compile(r"^\s*(%[\w$.-]+(?::\d+)?(?:\s*,\s*%[\w$.-]+(?::\d+)?)*)\s*=\s*(.*)$")
_FUNC = re.compile(r"^\s*func\.func\s+(?:\w+\s+)*@([\w$.-]+)\s*\(")
_OPNAME = re.compile(r'^"?(?:stablehlo|mhlo|func|chlo)\.(\w+)"?')
_CALLEE = re.compile(r"^(?:func\.)?call\s+@([\w$.-]+)")
_INT_CONST = re.compile(r"^stablehlo\.constant\s+dense<(-?\d+)>\s*:\s*tensor<[ui]\d+>")
_COMPARE_LT = re.compile(r"stablehlo\.compare\s+LT,\s*(%[\w$.#-]+),\s*(%[\w$.#-]+)")
_ITER_ARG = re.compile(r"(%[\w$.-]+)\s*=\s*(%[\w$.-]+(?:#\d+)?)")
_TENSOR = re.compile(r"tensor<((?:[\d?]+x)*)(complex<\w+>|[a-z]+\d*)")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _tensor_bytes(types: str) -> list[int]:
    """Byte sizes of the ``tensor<...>`` types in ``types``, in order."""
    sizes = []
    for dims, dtype in _TENSOR.findall(types):
        count = math.prod(int(d) if d != "?" else 0 for d in dims.split("x") if d)
        bits = [int(b) for b in re.findall(r"\d+", dtype)] or [8]
        per = max(1, bits[0] // 8) * (2 if dtype.startswith("complex") else 1)
        sizes.append(count * per)
    return sizes


@dataclasses.dataclass
class _Op:
    kind: str  # view | barrier | call | while | return | const | other
    results: list[str]
    operands: list[str]
    loops: tuple[int, ...]  # the whiles (indices into _Func.whiles) around this op
    callee: str = ""
    types: str = ""
    loop: int = -1  # for kind "while": its index; for "return": the while it ends (-1: func)


@dataclasses.dataclass
class _While:
    inits: list[str]
    args: list[str]
    results: list[str]
    returns: list[str] = dataclasses.field(default_factory=list)
    names: list[str] = dataclasses.field(default_factory=list)  # as printed, unscoped
    cond_args: list[str] = dataclasses.field(default_factory=list)
    trip: int | None = None
    compare: tuple[str, str] | None = None


@dataclasses.dataclass
class _Func:
    name: str
    args: list[str]
    ops: list[_Op] = dataclasses.field(default_factory=list)
    whiles: list[_While] = dataclasses.field(default_factory=list)
    ints: dict[str, int] = dataclasses.field(default_factory=dict)


def _results(spec: str) -> list[str]:
    out = []
    for part in spec.split(","):
        name, _, count = part.strip().partition(":")
        out += [f"{name}#{i}" for i in range(int(count))] if count else [name]
    return out


def _parse(text: str) -> dict[str, _Func]:
    """Parses the module text into functions of ops over scoped value names.

    MLIR reuses a value name in sibling regions (two whiles both bind ``%iterArg``), so
    every name is resolved to ``name@region`` of its innermost enclosing definition.
    """
    funcs: dict[str, _Func] = {}
    func: _Func | None = None
    regions: list[tuple[str, int]] = []  # ("cond" | "body" | "other", while index)
    scopes: list[dict[str, str]] = []
    ids: list[int] = []  # each open region's unique id, parallel to `scopes`
    counter = 0
    pending_while = -1

    def enter(kind: str, loop: int, names: Sequence[str] = ()) -> list[str]:
        nonlocal counter
        counter += 1
        regions.append((kind, loop))
        ids.append(counter)
        scopes.append({name: f"{name}@{counter}" for name in names})
        return [scopes[-1][name] for name in names]

    def leave() -> None:
        if regions:
            regions.pop()
            scopes.pop()
            ids.pop()

    def define(name: str) -> str:
        key = f"{name}@{ids[-1]}" if ids else name
        scopes[-1][name] = key
        return key

    def resolve(name: str) -> str:
        for scope in reversed(scopes):
            if name in scope:
                return scope[name]
        return name + "@?"

    for raw in text.splitlines():
        line = _STRING.sub('""', raw).strip()
        header = _FUNC.match(line)
        if header:
            args_part = line.split(")", 1)[0] if "->" in line else line
            args = re.findall(r"(%arg\d+)\s*:", args_part)
            func = _Func(header.group(1), args)
            funcs[func.name] = func
            regions, scopes, ids, pending_while = [], [{a: a for a in args}], [], -1
            continue
        if func is None or not line:
            continue
        loops = tuple(w for kind, w in regions if kind == "body")
        if line == "cond {" and pending_while >= 0:
            loop = func.whiles[pending_while]
            loop.cond_args = enter("cond", pending_while, loop.names)
            continue
        if line == "} do {" and regions and regions[-1][0] == "cond":
            w = regions[-1][1]
            leave()
            func.whiles[w].args = enter("body", w, func.whiles[w].names)
            continue
        opens, closes = line.count("{"), line.count("}")
        if line.startswith("}"):
            # `}`, `})`, `}, {`, `}) : (...) -> ...`: closes a region, maybe opens the next.
            for _ in range(closes):
                leave()
            for _ in range(opens):
                enter("other", -1)
            continue
        define_match = _DEFINE.match(line)
        rest = define_match.group(2) if define_match else line
        name_match = _OPNAME.match(rest)
        opname = name_match.group(1) if name_match else rest.split(" ", 1)[0]
        where = regions[-1] if regions else ("func", -1)
        if opname == "while" and rest.startswith(("stablehlo.while", '"stablehlo.while"')):
            pairs = _ITER_ARG.findall(rest.split(")", 1)[0])
            inits = [resolve(b) for _, b in pairs]
            results = [define(r) for r in _results(define_match.group(1))] if define_match else []
            func.whiles.append(_While(inits, [], results, names=[a for a, _ in pairs]))
            pending_while = len(func.whiles) - 1
            func.ops.append(_Op("while", results, inits, loops, loop=pending_while))
            for _ in range(opens - closes):  # a generic-form while with inline regions
                enter("other", -1)
            continue
        operands = [resolve(v) for v in _VALUE.findall(rest.split(" : ", 1)[0])]
        results = [define(r) for r in _results(define_match.group(1))] if define_match else []
        int_const = _INT_CONST.match(rest)
        if int_const and results:
            func.ints[results[0]] = int(int_const.group(1))
        if where[0] == "cond":
            compare = _COMPARE_LT.search(rest)
            if compare:
                a, b = compare.group(1), compare.group(2)
                func.whiles[where[1]].compare = (resolve(a), resolve(b))
        if opname == "return" and not define_match:
            if where[0] == "body":
                func.whiles[where[1]].returns = operands
            if where[0] in ("body", "func"):
                func.ops.append(_Op("return", [], operands, loops, loop=where[1]))
        elif opname == "constant":
            func.ops.append(_Op("const", results, [], loops))
        elif opname == "optimization_barrier":
            types = rest.split(" : ", 1)[1] if " : " in rest else ""
            if types.startswith("("):
                types = types[1:].split(") ->", 1)[0]
            func.ops.append(_Op("barrier", results, operands, loops, types=types))
        elif _CALLEE.match(rest):
            func.ops.append(
                _Op("call", results, operands, loops, callee=_CALLEE.match(rest).group(1))
            )
        elif opname in _VIEW_OPS:
            func.ops.append(_Op("view", results, operands[:1], loops))
        else:
            func.ops.append(_Op("other", results, operands, loops))
        for _ in range(opens - closes):  # an op with regions (reduce, case, sort...)
            enter("other", -1)
    for func in funcs.values():
        for loop in func.whiles:
            counter_arg, bound = loop.compare or ("", "")
            if bound in func.ints and counter_arg in loop.cond_args:
                start = func.ints.get(loop.inits[loop.cond_args.index(counter_arg)])
                if start is not None:
                    loop.trip = max(0, func.ints[bound] - start)
    return funcs


def optimization_barrier_bytes(text: str, n_params: int, entry: str = "main") -> BarrierBytes:
    """Bytes of params and constants that pass ``optimization_barrier`` ops, per run.

    The method, on the lowered StableHLO text (``jax.jit(f).lower(...).as_text()``):

    1. Parse every ``func.func``: its arguments, and per op its results, operands, the
       ``stablehlo.while`` loops it sits in, and the callee of ``func.call`` ops.
    2. Mark values: the first ``n_params`` arguments of the entry function are *params*
       (jax flattens ``f(params, x)`` with the params' leaves first); every
       ``stablehlo.constant`` is a *constant*. A mark flows, to a fixed point, through ops
       that pass data on unchanged or in part -- ``reshape``, ``broadcast_in_dim``,
       ``transpose``, ``convert``, ``slice``, ``dynamic_slice`` (a scan's per-layer slice of
       stacked params), ``copy``, sharding ``custom_call`` s and barriers themselves --, from
       a call's operands into the callee's arguments and from its ``return`` back to the
       call's results, and through a ``while`` into its loop-carried values when the body
       returns them unchanged (how a scan carries the stacked params it reads from).
       Values computed from params (a matmul, a sum) are activations: not marked.
    3. At every ``stablehlo.optimization_barrier``, add the sizes of the marked operands
       (from the op's type signature). Each barrier counts as often as it runs per call:
       the trip counts of the loops around it (read from the ``compare LT`` of each loop's
       ``cond`` against a constant, started from a constant) times the number of times its
       function is called. So a scan over n layers that puts each layer's params through a
       barrier counts n x the per-layer bytes, the same as a Python loop of n barriers.

    Args:
      text: the StableHLO module text.
      n_params: how many leading arguments of the entry function are params.
      entry: the entry function's name.

    Returns:
      A :class:`BarrierBytes`.

    >>> import jax, jax.numpy as jnp
    >>> def loss(w, x):  # a scan whose body is checkpointed with the default prevent_cse
    ...     body = jax.checkpoint(lambda x, w: (jnp.sin(x @ w), None))
    ...     return jax.lax.scan(body, x, w)[0].sum()
    >>> text = jax.jit(jax.grad(loss)).lower(jnp.ones((5, 3, 3)), jnp.ones(3)).as_text()
    >>> optimization_barrier_bytes(text, n_params=1).params  # 5 layers x 9 floats x 4 bytes
    180
    """
    funcs = _parse(text)
    if entry not in funcs:
        raise ValueError(
            f"optimization_barrier_bytes: no function @{entry} in the program text; "
            f"functions found: {sorted(funcs) or 'none'}. Pass the text of "
            "`jax.jit(f).lower(...).as_text()`."
        )
    marks: dict[tuple[str, str], frozenset] = {}
    empty: frozenset = frozenset()
    for arg in funcs[entry].args[:n_params]:
        marks[(entry, arg)] = frozenset({"param"})
    returns: dict[tuple[str, int], frozenset] = {}

    def mark(f: str, value: str) -> frozenset:
        return marks.get((f, value), empty)

    def add(key: Any, value: frozenset, table: dict) -> bool:
        old = table.get(key, empty)
        if value <= old:
            return False
        table[key] = old | value
        return True

    changed = True
    while changed:
        changed = False
        for func in funcs.values():
            f = func.name
            for op in func.ops:
                if op.kind == "const":
                    changed |= add((f, op.results[0]), frozenset({"const"}), marks)
                elif op.kind == "view" and op.operands:
                    changed |= add((f, op.results[0]), mark(f, op.operands[0]), marks)
                elif op.kind == "barrier":
                    for result, operand in zip(op.results, op.operands):
                        changed |= add((f, result), mark(f, operand), marks)
                elif op.kind == "call" and op.callee in funcs:
                    callee = funcs[op.callee]
                    for arg, operand in zip(callee.args, op.operands):
                        changed |= add((op.callee, arg), mark(f, operand), marks)
                    for j, result in enumerate(op.results):
                        changed |= add((f, result), returns.get((op.callee, j), empty), marks)
                elif op.kind == "while":
                    loop = func.whiles[op.loop]
                    for i, (init, arg) in enumerate(zip(loop.inits, loop.args)):
                        through = i < len(loop.returns) and loop.returns[i] == arg
                        value = mark(f, init) if through else empty
                        changed |= add((f, arg), value, marks)
                        if i < len(loop.results):
                            changed |= add((f, loop.results[i]), value, marks)
                elif op.kind == "return" and op.loop == -1:
                    for j, operand in enumerate(op.operands):
                        changed |= add((f, j), mark(f, operand), returns)

    # How many times each function runs per call of the entry function.
    calls: dict[str, list[tuple[str, _Op]]] = {}
    for func in funcs.values():
        for op in func.ops:
            if op.kind == "call":
                calls.setdefault(op.callee, []).append((func.name, op))
    exact = True

    def per_run(func: _Func, op: _Op) -> int:
        nonlocal exact
        count = 1
        for w in op.loops:
            trip = func.whiles[w].trip
            if trip is None:
                exact = False
            count *= 1 if trip is None else trip
        return count

    @functools.cache
    def runs(name: str) -> int:
        if name == entry:
            return 1
        return sum(runs(caller) * per_run(funcs[caller], op) for caller, op in calls.get(name, []))

    params = consts = total = count = 0
    for func in funcs.values():
        for op in func.ops:
            if op.kind != "barrier":
                continue
            count += 1
            times = runs(func.name) * per_run(func, op)
            sizes = _tensor_bytes(op.types)
            if len(sizes) != len(op.operands):
                exact = False
                continue
            for operand, size in zip(op.operands, sizes):
                what = mark(func.name, operand)
                total += size * times
                if "param" in what:
                    params += size * times
                elif "const" in what:
                    consts += size * times
    return BarrierBytes(params, consts, total, count, exact)
