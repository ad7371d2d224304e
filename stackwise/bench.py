"""``stackwise-bench``: compile time, step time and memory of layer stacking, side by side.

Run ``python -m stackwise.bench`` (or the installed ``stackwise-bench``) to see, in one
process on one machine, what a stack of n identical blocks costs under ``jit(grad(loss))``
when it is written as

* a Python loop over separately stored per-layer params (the traced program grows with n),
* a Python loop over slices of stacked params,
* a hand-written :func:`jax.lax.scan` (with and without :func:`jax.checkpoint`),
* :func:`stackwise.stack` with remat off, per-layer remat and nested (sqrt-n) remat,
* the adapters ``stackwise.haiku.Stack``, ``stackwise.flax.Stack``, ``stackwise.nnx.Stack``,
* the frameworks' own tools ``hk.layer_stack``, ``nn.scan``, ``nnx.scan`` and their
  Python-loop models.

Two blocks: ``mlp``, the residual block ``h + gelu(h @ w1) @ w2`` of the core comparison
(D=256, hidden 512, batch 64), and ``transformer``, a pre-LN causal self-attention + MLP
block written the same way in pure JAX, Haiku, Flax linen and NNX (the framework
comparison). Frameworks that are not installed are skipped with a note.

For every variant and n it reports:

* **compile** -- cold compile time: :func:`jax.clear_caches` and a garbage collection, then
  the wall time of ``jit(grad(loss)).lower(params, x).compile()`` (tracing included).
  Every variant is compiled once at a tiny depth first, so one-time costs (imports,
  first-use initialisation) are not charged to whichever variant happens to run first.
  With ``--compile-repeats k`` every variant is compiled k times, interleaved (each
  repeat in a new shuffled order), and the fastest is shown. **trace** is the tracing and
  lowering part of it (Python: what a library adds); the rest is XLA's.
* **step** -- the median over rounds of one call of the compiled ``jit(grad(loss))`` in
  steady state: each round visits every variant in a shuffled order and times its second
  of two back-to-back calls, so the time does not depend on which variant ran before
  (timing single calls, the same program measured 5-9% apart depending on the variant
  that ran before it).
* **temp** -- ``compiled.memory_analysis().temp_size_in_bytes``: XLA's scratch memory,
  which holds the activations saved for the backward pass.
* **program** -- ``len(lowered.as_text())``, the size of the StableHLO program.
* **barrier bytes** -- bytes of params and of constants that pass an
  ``optimization_barrier`` per step (see :func:`optimization_barrier_bytes`).
* **ops != tool** -- how many instructions of the compiled program (XLA's optimised HLO,
  names and metadata blanked as in :func:`program_fingerprint`) are not shared with the
  program of the tool the row is compared with: 0 is the same program.

Ratios are medians of per-repeat (per-round) ratios, paired because variants timed
within seconds of each other share the machine's state, and printed against the
hand-written scan and the Python loop of the same block and depth in the same run
(``/scan``, ``/loop``), and for each adapter against its
framework's own tool with the same remat (``/tool``): off, the default policy (``dots``:
``stackwise.DEFAULT_REMAT``, given to ``hk.remat`` / ``nn.remat`` / ``nnx.remat`` as
``policy``) and full per-layer remat. Each tool also runs a second time as a separate
``(control)`` row: its ratio to the tool is the run's noise floor. A summary compares
the ratios with the project's targets.
Outputs: a table (rich, if installed), ``--csv PATH`` and ``--plot PATH`` (matplotlib:
compile time and temp memory against n). ``--quick`` is a smoke run with tiny sizes.

Example (the measuring machinery on a toy program; run the command line for real numbers):

>>> import jax, jax.numpy as jnp
>>> from stackwise.bench import optimization_barrier_bytes
>>> def loss(ws, x):
...     for w in ws:  # the default `prevent_cse=True` wraps params in barriers
...         x = jax.checkpoint(lambda w, x: jnp.tanh(x @ w))(w, x)
...     return x.sum()
>>> ws = [jnp.ones((4, 4)) for _ in range(3)]
>>> text = jax.jit(jax.grad(loss)).lower(ws, jnp.ones((2, 4))).as_text()
>>> optimization_barrier_bytes(text, n_params=3).params  # 3 layers x 16 floats x 4 bytes
192

Only jax, numpy and the standard library are imported at module level: frameworks, rich,
tqdm and matplotlib are imported when used, and missing ones are skipped.
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import functools
import gc
import hashlib
import math
import os
import platform
import random
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import stackwise

__all__ = [
    "BarrierBytes",
    "BenchConfig",
    "Result",
    "main",
    "optimization_barrier_bytes",
    "program_fingerprint",
    "run_benchmark",
]

#: The remat policy of the tools' "dots" rows: the same as stackwise's default.
_DOTS = stackwise.DEFAULT_REMAT


# ==========================================================================
# What passes an optimization barrier: a data-flow pass over the StableHLO text.


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


# ==========================================================================
# Whether two compiled programs are the same, up to names.

_METADATA = re.compile(r", metadata=\{[^}]*\}")
_NAME = re.compile(r"%[\w.\-]+")


def program_fingerprint(hlo_text: str) -> str:
    """A hash of a compiled program's instructions, blind to names and source locations.

    ``hlo_text`` is ``jax.jit(f).lower(...).compile().as_text()``: XLA's optimised HLO.
    The hash covers every instruction line in order (op, shapes, layouts, operands,
    attributes), with instruction and computation names replaced by one placeholder and
    ``metadata={...}`` (source file, line, JAX op names) removed. Two programs with the
    same fingerprint run the same machine code on the same inputs, so their step times
    differ only by measurement noise; the names differ between, say, ``hk.layer_stack``
    and ``stackwise.haiku.Stack`` because their modules are named differently.

    >>> import jax, jax.numpy as jnp
    >>> def compiled(f):
    ...     return jax.jit(f).lower(jnp.ones(3)).compile().as_text()
    >>> def f(x):
    ...     return jnp.sin(x) * 2
    >>> def g(y):  # another function, other names, the same program
    ...     return 2 * jnp.sin(y)
    >>> program_fingerprint(compiled(f)) == program_fingerprint(compiled(g))
    True
    >>> program_fingerprint(compiled(f)) == program_fingerprint(compiled(jnp.cos))
    False
    """
    return hashlib.sha256("\n".join(_instructions(hlo_text)).encode()).hexdigest()[:16]


def _instructions(hlo_text: str) -> list[str]:
    """The instruction lines of an HLO text, in order, names and metadata blanked."""
    lines = []
    for line in hlo_text.splitlines():
        line = line.strip()
        if " = " in line and not line.startswith(("HloModule", "//")):
            lines.append(_NAME.sub("%", _METADATA.sub("", line)))
    return lines


def _instructions_unlike(a: list[str], b: list[str]) -> int:
    """How many instructions two programs do not share (a multiset difference, both ways)."""
    ca, cb = collections.Counter(a), collections.Counter(b)
    return sum((ca - cb).values()) + sum((cb - ca).values())


# ==========================================================================
# Configuration and results.


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What to measure. The defaults are the full run; :meth:`quick` is the smoke run.

    Attributes:
      blocks: which blocks to run, ``"mlp"`` and/or ``"transformer"``.
      ns: the depths for the ``mlp`` block.
      transformer_ns: the depths for the ``transformer`` block.
      d, hidden, batch: the ``mlp`` block's sizes.
      tf_d, tf_hidden, tf_heads, tf_seq, tf_batch: the ``transformer`` block's sizes.
      rounds: timed rounds per depth (each times every variant once).
      compile_repeats: cold compiles per variant and depth (the minimum is reported).
      warmup: compile every variant once at a tiny depth first (not recorded).
      variants: only variants whose name contains one of these strings (empty: all).
      target_n: the depth at which the summary compares ratios with the targets.
      seed: the PRNG seed of params and inputs.
    """

    blocks: tuple[str, ...] = ("mlp", "transformer")
    ns: tuple[int, ...] = (8, 24, 48, 96)
    transformer_ns: tuple[int, ...] = (8,)
    d: int = 256
    hidden: int = 512
    batch: int = 64
    tf_d: int = 128
    tf_hidden: int = 512
    tf_heads: int = 4
    tf_seq: int = 32
    tf_batch: int = 8
    rounds: int = 7
    compile_repeats: int = 1
    warmup: bool = True
    variants: tuple[str, ...] = ()
    target_n: int = 48
    seed: int = 0

    @classmethod
    def quick(cls, **overrides: Any) -> BenchConfig:
        """A smoke run of every variant: tiny sizes, few depths and rounds, no warm-up.

        The numbers mean little (the first compile of each framework pays its one-time
        costs); it checks that everything runs and writes its outputs.
        """
        small = dict(
            ns=(2, 4), transformer_ns=(2,), d=16, hidden=32, batch=4, tf_d=16, tf_hidden=32,
            tf_heads=2, tf_seq=8, tf_batch=2, rounds=2, compile_repeats=1, warmup=False,
            target_n=4,
        )
        return cls(**{**small, **overrides})


@dataclasses.dataclass
class Result:
    """One variant at one depth. Times in seconds, sizes in bytes / characters."""

    block: str
    n: int
    framework: str
    variant: str
    remat: str
    compile_s: float = math.nan  # the fastest of the cold compiles
    step_s: float = math.nan  # the median of the steady-state calls
    trace_s: float = math.nan  # the tracing + lowering part of compile_s (fastest)
    temp_bytes: int = -1
    program_chars: int = -1
    barrier_param_bytes: int = -1
    barrier_const_bytes: int = -1
    barrier_ops: int = -1
    compile_vs_scan: float = math.nan
    compile_vs_loop: float = math.nan
    step_vs_scan: float = math.nan
    step_vs_loop: float = math.nan
    tool: str = ""
    compile_vs_tool: float = math.nan
    step_vs_tool: float = math.nan
    program_hash: str = ""  # program_fingerprint of the compiled program
    ops_unlike_tool: int = -1  # instructions not shared with the tool's program; 0: the same
    note: str = ""
    compile_samples: tuple[float, ...] = ()  # one per repeat, in order
    step_samples: tuple[float, ...] = ()  # one per round, in order


class _Case(NamedTuple):
    """A variant: ``build(n) -> (params, x, loss)`` with ``loss(params, x) -> scalar``."""

    name: str
    framework: str
    remat: str  # off | dots | layer | nested
    build: Callable[[int], tuple[Any, Any, Callable]]
    role: str = ""  # "loop" / "scan": the references for /loop and /scan
    tool: str = ""  # for an adapter: the name of its framework's own tool


def _tool_cases(
    framework: str, names: dict[str, str], build: Callable[[Any], Callable]
) -> list[_Case]:
    """A framework tool's rows at each remat setting (``off``, ``dots``, ``layer``).

    ``names`` maps the setting to the row's name; ``build(remat)`` gives the case's
    build for remat ``False``, ``"dots"`` (the tool's remat with policy ``_DOTS``) or
    ``True``. The ``off`` row runs twice: the second, ``(control)``, is compared with the
    first, so its ratios are the run's noise floor.
    """
    off = names["off"]
    return [
        _Case(off, framework, "off", build(False)),
        _Case(f"{off} (control)", framework, "off", build(False), tool=off),
        _Case(names["dots"], framework, "dots", build("dots")),
        _Case(names["layer"], framework, "layer", build(True)),
    ]


def _adapter_cases(
    name: str, framework: str, tools: dict[str, str], build: Callable[[Any], Callable]
) -> list[_Case]:
    """An adapter's rows with ``remat`` False, ``stackwise.DEFAULT_REMAT`` and True
    (``build(remat)``), each compared with its tool's row of the same setting."""
    return [
        _Case(name, framework, "off", build(False), tool=tools["off"]),
        _Case(f"{name} default", framework, "dots", build(stackwise.DEFAULT_REMAT),
              tool=tools["dots"]),
        _Case(f"{name} remat", framework, "layer", build(True), tool=tools["layer"]),
    ]


def _mean_square(y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(y))


# ==========================================================================
# The MLP residual block: the core comparison.


def _mlp_cases(cfg: BenchConfig) -> list[_Case]:
    d, hidden, batch = cfg.d, cfg.hidden, cfg.batch

    def layer_init(key):  # what stackwise.stack is given; the values come from `inputs`
        k1, k2 = jax.random.split(key)
        return {
            "w1": jax.random.normal(k1, (d, hidden)) / math.sqrt(d),
            "w2": jax.random.normal(k2, (hidden, d)) / math.sqrt(hidden) * 0.1,
        }

    def layer(p, h):
        return h + jax.nn.gelu(h @ p["w1"]) @ p["w2"]

    def inputs(n):
        rng = np.random.default_rng(cfg.seed)
        stacked = {
            "w1": rng.standard_normal((n, d, hidden), np.float32) / math.sqrt(d),
            "w2": rng.standard_normal((n, hidden, d), np.float32) / math.sqrt(hidden) * 0.1,
        }
        return _device(stacked), _device(rng.standard_normal((batch, d), np.float32))

    def loop_separate(n):
        stacked, x = inputs(n)

        def loss(ps, h):
            for p in ps:
                h = layer(p, h)
            return _mean_square(h)

        return _unstack(stacked), x, loss

    def loop_slices(n):
        stacked, x = inputs(n)

        def loss(ps, h):
            for i in range(n):
                h = layer(jax.tree.map(lambda a, i=i: a[i], ps), h)
            return _mean_square(h)

        return stacked, x, loss

    def hand_scan(remat):
        def build(n):
            stacked, x = inputs(n)
            body = lambda h, p: (layer(p, h), None)  # noqa: E731
            if remat:
                body = jax.checkpoint(body, prevent_cse=False)

            def loss(ps, h):
                return _mean_square(jax.lax.scan(body, h, ps)[0])

            return stacked, x, loss

        return build

    def with_stackwise(**options):
        def build(n):
            stacked, x = inputs(n)
            layers = stackwise.stack(layer_init, layer, n, **options)
            return stacked, x, lambda ps, h: _mean_square(layers.apply(ps, h))

        return build

    return [
        _Case("loop (separate params)", "jax", "off", loop_separate, role="loop"),
        _Case("loop (stacked slices)", "jax", "off", loop_slices),
        _Case("lax.scan (hand)", "jax", "off", hand_scan(False), role="scan"),
        _Case("lax.scan+checkpoint (hand)", "jax", "layer", hand_scan(True)),
        _Case("stackwise", "jax", "off", with_stackwise(remat=False)),
        _Case("stackwise default", "jax", "dots", with_stackwise()),
        _Case("stackwise remat", "jax", "layer", with_stackwise(remat=True)),
        _Case("stackwise nested", "jax", "nested", with_stackwise(remat=True, nested=True)),
    ]


# ==========================================================================
# The transformer block: the framework comparison.


def _attend(qkv: jax.Array, heads: int) -> jax.Array:
    """Causal multi-head self-attention from fused ``qkv [batch, seq, 3 * d]``."""
    b, t, three_d = qkv.shape
    q, k, v = (a.reshape(b, t, heads, three_d // 3 // heads) for a in jnp.split(qkv, 3, -1))
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))[None, None]
    weights = jax.nn.softmax(jnp.where(causal, logits, jnp.finfo(logits.dtype).min), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", weights, v).reshape(b, t, three_d // 3)


def _transformer_jax_cases(cfg: BenchConfig) -> list[_Case]:
    d, hidden, heads = cfg.tf_d, cfg.tf_hidden, cfg.tf_heads

    def dense(key, m, k):
        return {"w": jax.random.normal(key, (m, k)) / math.sqrt(m), "b": jnp.zeros(k)}

    def layer_init(key):
        ks = jax.random.split(key, 4)
        return {
            "ln1": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
            "qkv": dense(ks[0], d, 3 * d),
            "out": dense(ks[1], d, d),
            "ln2": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
            "fc1": dense(ks[2], d, hidden),
            "fc2": dense(ks[3], hidden, d),
        }

    def linear(p, x):
        return x @ p["w"] + p["b"][None, None, :]

    def norm(p, x):
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"][None, None] + p["bias"][
            None, None
        ]

    def layer(p, x):
        x = x + linear(p["out"], _attend(linear(p["qkv"], norm(p["ln1"], x)), heads))
        return x + linear(p["fc2"], jax.nn.gelu(linear(p["fc1"], norm(p["ln2"], x))))

    def inputs(n):
        rng = np.random.default_rng(cfg.seed)

        def dense_np(m, k):
            w = rng.standard_normal((n, m, k), np.float32) / math.sqrt(m)
            return {"w": w, "b": np.zeros((n, k), np.float32)}

        norm_np = {"scale": np.ones((n, d), np.float32), "bias": np.zeros((n, d), np.float32)}
        stacked = {
            "ln1": norm_np, "qkv": dense_np(d, 3 * d), "out": dense_np(d, d), "ln2": norm_np,
            "fc1": dense_np(d, hidden), "fc2": dense_np(hidden, d),
        }
        return _device(stacked), _tf_input(cfg)

    def loop(n):
        stacked, x = inputs(n)

        def loss(ps, h):
            for p in ps:
                h = layer(p, h)
            return _mean_square(h)

        return _unstack(stacked), x, loss

    def hand_scan(n):
        stacked, x = inputs(n)
        return stacked, x, lambda ps, h: _mean_square(
            jax.lax.scan(lambda h, p: (layer(p, h), None), h, ps)[0]
        )

    def with_stackwise(**options):
        def build(n):
            stacked, x = inputs(n)
            layers = stackwise.stack(layer_init, layer, n, **options)
            return stacked, x, lambda ps, h: _mean_square(layers.apply(ps, h))

        return build

    return [
        _Case("loop (separate params)", "jax", "off", loop, role="loop"),
        _Case("lax.scan (hand)", "jax", "off", hand_scan, role="scan"),
        _Case("stackwise", "jax", "off", with_stackwise(remat=False)),
        _Case("stackwise default", "jax", "dots", with_stackwise()),
        _Case("stackwise remat", "jax", "layer", with_stackwise(remat=True)),
        _Case("stackwise nested", "jax", "nested", with_stackwise(remat=True, nested=True)),
    ]


def _tf_input(cfg: BenchConfig) -> jax.Array:
    rng = np.random.default_rng(cfg.seed + 1)
    return _device(rng.standard_normal((cfg.tf_batch, cfg.tf_seq, cfg.tf_d), np.float32))


def _device(tree: Any) -> Any:
    """numpy -> device arrays without running a jax op (so without compiling one)."""
    return jax.tree.map(jax.device_put, tree)


def _unstack(stacked: Any) -> list[Any]:
    """Per-layer params, as separate device arrays, sliced in numpy (no compiles)."""
    host = jax.tree.map(np.asarray, stacked)
    n = jax.tree.leaves(host)[0].shape[0]
    return [_device(jax.tree.map(lambda a, i=i: a[i], host)) for i in range(n)]


def _haiku_cases(cfg: BenchConfig, notes: list[str]) -> list[_Case]:
    try:
        import haiku as hk
    except ImportError:
        notes.append("haiku: not installed (pip install 'stackwise[haiku]'); Haiku rows skipped.")
        return []
    d, hidden, heads = cfg.tf_d, cfg.tf_hidden, cfg.tf_heads

    class Block(hk.Module):
        """The transformer block as an ordinary Haiku module."""

        def __call__(self, x):
            h = hk.LayerNorm(-1, create_scale=True, create_offset=True)(x)
            x = x + hk.Linear(d)(_attend(hk.Linear(3 * d)(h), heads))
            h = hk.LayerNorm(-1, create_scale=True, create_offset=True)(x)
            return x + hk.Linear(d)(jax.nn.gelu(hk.Linear(hidden)(h)))

    def model(forward):
        def build(n):
            net = hk.without_apply_rng(hk.transform(functools.partial(forward, n)))
            x = _tf_input(cfg)
            params = net.init(jax.random.key(cfg.seed), x)
            return params, x, lambda p, h: _mean_square(net.apply(p, h))

        return build

    def loop(n, x):
        for _ in range(n):
            x = Block()(x)
        return x

    def layer_stack(remat, n, x):
        fn = lambda x: Block()(x)  # noqa: E731
        if remat:
            fn = hk.remat(fn, policy=_DOTS if remat == "dots" else None)
        return hk.layer_stack(n)(fn)(x)

    tools = {
        "off": "hk.layer_stack", "dots": "hk.layer_stack+hk.remat(dots)",
        "layer": "hk.layer_stack+hk.remat",
    }
    cases = [
        _Case("hk loop", "haiku", "off", model(loop)),
        *_tool_cases("haiku", tools, lambda remat: model(functools.partial(layer_stack, remat))),
    ]
    try:
        import stackwise.haiku as sw_haiku
    except ImportError as e:
        notes.append(f"stackwise.haiku: not importable ({e}); its rows skipped.")
        return cases

    def adapter(remat, n, x):
        return sw_haiku.Stack(Block, n=n, remat=remat)(x)

    return cases + _adapter_cases(
        "stackwise.haiku.Stack", "haiku", tools,
        lambda remat: model(functools.partial(adapter, remat)),
    )


def _flax_cases(cfg: BenchConfig, notes: list[str]) -> list[_Case]:
    try:
        import flax.linen as nn
    except ImportError:
        notes.append("flax: not installed (pip install 'stackwise[flax]'); linen rows skipped.")
        return []
    d, hidden, heads = cfg.tf_d, cfg.tf_hidden, cfg.tf_heads

    class Block(nn.Module):
        """The transformer block as an ordinary linen module."""

        @nn.compact
        def __call__(self, x):
            h = nn.LayerNorm()(x)
            x = x + nn.Dense(d)(_attend(nn.Dense(3 * d)(h), heads))
            h = nn.LayerNorm()(x)
            return x + nn.Dense(d)(jax.nn.gelu(nn.Dense(hidden)(h)))

    class Cell(nn.Module):
        """``nn.scan`` needs ``(carry, x) -> (carry, y)``."""

        @nn.compact
        def __call__(self, x, _):
            return Block()(x), None

    def model(body):
        def build(n):
            class Model(nn.Module):
                @nn.compact
                def __call__(self, x):
                    return body(n, x)

            net = Model()
            x = _tf_input(cfg)
            params = net.init(jax.random.key(cfg.seed), x)
            return params, x, lambda p, h: _mean_square(net.apply(p, h))

        return build

    def loop(n, x):
        for _ in range(n):
            x = Block()(x)
        return x

    def scan(remat, n, x):
        cell = nn.remat(Cell, policy=_DOTS if remat == "dots" else None) if remat else Cell
        scanned = nn.scan(
            cell, variable_axes={"params": 0}, split_rngs={"params": True}, length=n
        )
        return scanned()(x, None)[0]

    tools = {"off": "nn.scan", "dots": "nn.scan(nn.remat dots)", "layer": "nn.scan(nn.remat)"}
    cases = [
        _Case("nn loop", "flax", "off", model(loop)),
        *_tool_cases("flax", tools, lambda remat: model(functools.partial(scan, remat))),
    ]
    try:
        import stackwise.flax as sw_flax
    except ImportError as e:
        notes.append(f"stackwise.flax: not importable ({e}); its rows skipped.")
        return cases

    def adapter(remat, n, x):
        return sw_flax.Stack(Block, n=n, remat=remat)(x)

    return cases + _adapter_cases(
        "stackwise.flax.Stack", "flax", tools,
        lambda remat: model(functools.partial(adapter, remat)),
    )


def _nnx_cases(cfg: BenchConfig, notes: list[str]) -> list[_Case]:
    try:
        from flax import nnx
    except ImportError:
        notes.append("flax.nnx: not installed (pip install 'stackwise[flax]'); NNX rows skipped.")
        return []
    d, hidden, heads = cfg.tf_d, cfg.tf_hidden, cfg.tf_heads

    class Block(nnx.Module):
        """The transformer block as an ordinary NNX module."""

        def __init__(self, rngs: nnx.Rngs):
            self.ln1 = nnx.LayerNorm(d, rngs=rngs)
            self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
            self.out = nnx.Linear(d, d, rngs=rngs)
            self.ln2 = nnx.LayerNorm(d, rngs=rngs)
            self.fc1 = nnx.Linear(d, hidden, rngs=rngs)
            self.fc2 = nnx.Linear(hidden, d, rngs=rngs)

        def __call__(self, x):
            x = x + self.out(_attend(self.qkv(self.ln1(x)), heads))
            return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x))))

    def model(make):
        def build(n):
            graphdef, state = nnx.split(make(n, nnx.Rngs(cfg.seed)))
            return state, _tf_input(cfg), lambda s, h: _mean_square(nnx.merge(graphdef, s)(h))

        return build

    class Loop(nnx.Module):
        def __init__(self, n, rngs):
            self.blocks = nnx.List([Block(rngs) for _ in range(n)])

        def __call__(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    class Scan(nnx.Module):
        def __init__(self, n, rngs, remat):
            @nnx.split_rngs(splits=n)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def create(rngs):
                return Block(rngs)

            self.blocks = create(rngs)
            self.remat = remat

        def __call__(self, x):
            def step(x, block):
                return block(x)

            if self.remat:
                step = nnx.remat(step, policy=_DOTS if self.remat == "dots" else None)
            return nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(step)(x, self.blocks)

    tools = {
        "off": "nnx.scan", "dots": "nnx.scan+nnx.remat(dots)", "layer": "nnx.scan+nnx.remat",
    }
    cases = [
        _Case("nnx loop", "nnx", "off", model(Loop)),
        *_tool_cases("nnx", tools, lambda remat: model(lambda n, r: Scan(n, r, remat))),
    ]
    try:
        import stackwise.nnx as sw_nnx
    except ImportError as e:
        notes.append(f"stackwise.nnx: not importable ({e}); its rows skipped.")
        return cases

    def adapter(remat):
        return lambda n, rngs: sw_nnx.Stack(Block, n=n, rngs=rngs, remat=remat)

    return cases + _adapter_cases(
        "stackwise.nnx.Stack", "nnx", tools, lambda remat: model(adapter(remat))
    )


def _transformer_cases(cfg: BenchConfig, notes: list[str]) -> list[_Case]:
    return (
        _transformer_jax_cases(cfg)
        + _haiku_cases(cfg, notes)
        + _flax_cases(cfg, notes)
        + _nnx_cases(cfg, notes)
    )


# ==========================================================================
# Measuring.


class _Compiled(NamedTuple):
    fn: Callable
    params: Any
    x: Any


def _build(case: _Case, n: int) -> tuple[Any, Any, Callable]:
    params, x, loss = case.build(n)
    return jax.block_until_ready(params), jax.block_until_ready(x), loss


def _compile(built: tuple[Any, Any, Callable]) -> tuple[_Compiled, float, float, Any]:
    """Compiles ``jit(grad(loss))`` cold: caches cleared, garbage collected, then timed.

    Returns the compiled function, the seconds of the whole compile and of its tracing
    and lowering part, and the lowered program.
    """
    params, x, loss = built
    jax.clear_caches()
    gc.collect()
    start = time.perf_counter()
    lowered = jax.jit(jax.grad(loss), keep_unused=True).lower(params, x)
    traced = time.perf_counter() - start
    compiled = lowered.compile()
    seconds = time.perf_counter() - start
    return _Compiled(compiled, params, x), seconds, traced, lowered


def _time_call(c: _Compiled) -> float:
    start = time.perf_counter()
    jax.block_until_ready(c.fn(c.params, c.x))
    return time.perf_counter() - start


def _short(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first[:200]}"


class _Progress:
    """A progress bar on stderr: rich if installed, else tqdm, else nothing."""

    def __init__(self, total: int, enabled: bool):
        self._bar = self._rich = self._tqdm = None
        if not enabled:
            return
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._rich = Progress(
                TextColumn("{task.description:<48}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), console=Console(stderr=True), transient=False,
            )
            self._rich.start()
            self._bar = self._rich.add_task("stackwise-bench", total=total)
        except ImportError:
            try:
                from tqdm import tqdm

                self._tqdm = tqdm(total=total, file=sys.stderr, desc="stackwise-bench")
            except ImportError:
                pass

    def describe(self, text: str) -> None:
        if self._rich is not None:
            self._rich.update(self._bar, description=text)
        elif self._tqdm is not None:
            self._tqdm.set_description(text)

    def advance(self, k: int = 1) -> None:
        if self._rich is not None:
            self._rich.advance(self._bar, k)
        elif self._tqdm is not None:
            self._tqdm.update(k)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
        elif self._tqdm is not None:
            self._tqdm.close()


def _select(cases: list[_Case], wanted: Sequence[str]) -> list[_Case]:
    if not wanted:
        return cases
    return [c for c in cases if any(w.lower() in c.name.lower() for w in wanted)]


def run_benchmark(
    cfg: BenchConfig, *, progress: bool = True, log: Callable[[str], None] = print
) -> tuple[list[Result], list[str]]:
    """Runs every selected variant at every depth.

    Args:
      cfg: what to measure.
      progress: show a progress bar on stderr.
      log: where notes go as they happen.

    Returns:
      ``(results, notes)``: one :class:`Result` per measured variant and depth (ratios
      filled in), and notes on what was skipped and why.
    """
    notes: list[str] = []
    plan: list[tuple[str, list[_Case], tuple[int, ...]]] = []
    if "mlp" in cfg.blocks:
        plan.append(("mlp", _select(_mlp_cases(cfg), cfg.variants), cfg.ns))
    if "transformer" in cfg.blocks:
        cases = _select(_transformer_cases(cfg, notes), cfg.variants)
        plan.append(("transformer", cases, cfg.transformer_ns))
    for note in notes:
        log(f"note: {note}")
    total = sum(
        len(cases) * cfg.warmup + len(ns) * (len(cases) * cfg.compile_repeats + cfg.rounds + 1)
        for _, cases, ns in plan
    )
    bar = _Progress(total, progress)
    results: list[Result] = []
    try:
        for block, cases, ns in plan:
            results += _run_block(block, cases, ns, cfg, bar, notes, log)
    finally:
        bar.close()
    _fill_ratios(results)
    return results, notes


def _run_block(block, cases, ns, cfg, bar, notes, log) -> list[Result]:
    def failed(where: str, e: BaseException) -> None:
        note = f"{block}/{where}: failed, skipped ({_short(e)})"
        notes.append(note)
        log(f"note: {note}")

    # Warm-up: each variant once at a tiny depth, not recorded, so one-time costs (first
    # imports, first traces of a framework) are charged to nobody; failures drop the variant.
    working = [] if cfg.warmup else list(cases)
    for case in cases if cfg.warmup else ():
        bar.describe(f"{block}: warm-up {case.name}")
        try:
            compiled, *_ = _compile(_build(case, min(2, *ns)))
            _time_call(compiled)
            working.append(case)
        except Exception as e:  # noqa: BLE001 - a broken variant is reported, not fatal
            failed(case.name, e)
        bar.advance()
    results = []
    for n in ns:
        rows = {
            c.name: Result(block, n, c.framework, c.name, c.remat, tool=c.tool) for c in working
        }
        built, compiled, programs = {}, {}, {}
        for case in working:
            bar.describe(f"{block} n={n}: build {case.name}")
            try:
                built[case.name] = _build(case, n)
            except Exception as e:  # noqa: BLE001
                failed(f"{case.name} n={n}", e)
        for repeat in range(cfg.compile_repeats):
            for name in _shuffled(list(built), cfg.seed, repeat):
                bar.describe(f"{block} n={n}: compile {name}")
                row = rows[name]
                try:
                    c, seconds, traced, lowered = _compile(built[name])
                except Exception as e:  # noqa: BLE001
                    failed(f"{name} n={n}", e)
                    del built[name]
                    compiled.pop(name, None)
                    bar.advance()
                    continue
                row.compile_samples += (seconds,)
                row.compile_s = min(row.compile_samples)
                row.trace_s = traced if repeat == 0 else min(row.trace_s, traced)
                if repeat == 0:
                    text = lowered.as_text()
                    row.program_chars = len(text)
                    barriers = optimization_barrier_bytes(text, len(jax.tree.leaves(c.params)))
                    row.barrier_param_bytes = barriers.params
                    row.barrier_const_bytes = barriers.consts
                    row.barrier_ops = barriers.count
                    if not barriers.exact:
                        row.note = "barrier bytes approximate (a loop's trip count unread)"
                    hlo = c.fn.as_text()
                    programs[name] = _instructions(hlo)
                    row.program_hash = program_fingerprint(hlo)
                    memory = c.fn.memory_analysis()
                    row.temp_bytes = int(getattr(memory, "temp_size_in_bytes", -1))
                compiled[name] = c
                bar.advance()
        for name, row in rows.items():
            if name in programs and row.tool in programs:
                row.ops_unlike_tool = _instructions_unlike(programs[name], programs[row.tool])
        bar.describe(f"{block} n={n}: warm-up calls")
        for c in compiled.values():
            _time_call(c)
        bar.advance()
        names = list(compiled)
        for r in range(cfg.rounds):
            bar.describe(f"{block} n={n}: step times, round {r + 1}/{cfg.rounds}")
            for name in _shuffled(names, cfg.seed, r):
                # Steady state: the untimed call leaves the machine (allocator, caches) as
                # this variant's own steps would, not as the previous variant left it.
                _time_call(compiled[name])
                rows[name].step_samples += (_time_call(compiled[name]),)
            bar.advance()
        for name in names:
            rows[name].step_s = statistics.median(rows[name].step_samples)
        if not sys.stderr.isatty():  # no live progress bar: say where we are
            log(f"{block} n={n}: measured {len(compiled)} variants")
        results += [rows[c.name] for c in working if c.name in compiled]  # cases' order
        built.clear()
        compiled.clear()
    return results


def _shuffled(names: list[str], seed: int, i: int) -> list[str]:
    """Repeat (or round) ``i``'s order: a seeded shuffle, so that no variant always runs
    right after the same one (with a fixed or rotated order, a variant's neighbour
    biases its times by a few percent, as the control rows showed)."""
    return random.Random(f"{seed}/{i}").sample(names, len(names))


def _paired(r: Result, ref: Result, what: str) -> float:
    """``r``'s compile or step time over ``ref``'s: the median of the per-repeat ratios.

    Repeat (or round) i of every variant runs within seconds of the others, so pairing
    by i cancels the machine's slow drift, which moves single timings by 10-20% on a
    shared 2-core VM. Without samples (rows read from an old CSV): the summaries' ratio.
    """
    return _paired_interval(r, ref, what)[0]


def _paired_interval(r: Result, ref: Result, what: str) -> tuple[float, float, float]:
    """:func:`_paired`'s median with a distribution-free ~95% interval for it.

    The interval is ``[q_(m+1), q_(k-m)]`` of the k sorted ratios, with the largest m
    such that ``P(Binomial(k, 1/2) <= m) <= 2.5%`` (order statistics: no assumption on
    the noise's shape). NaN bounds with fewer than 6 paired samples.
    """
    a, b = getattr(r, f"{what}_samples"), getattr(ref, f"{what}_samples")
    if not a or len(a) != len(b):
        return getattr(r, f"{what}_s") / getattr(ref, f"{what}_s"), math.nan, math.nan
    q = sorted(x / y for x, y in zip(a, b))
    k, m, tail = len(q), -1, 0.0
    while tail + math.comb(k, m + 1) / 2**k <= 0.025:
        m += 1
        tail += math.comb(k, m) / 2**k
    if m < 0:
        return statistics.median(q), math.nan, math.nan
    return statistics.median(q), q[m], q[k - 1 - m]


def _fill_ratios(results: list[Result]) -> None:
    by_key = {(r.block, r.n, r.variant): r for r in results}
    scan_name, loop_name = "lax.scan (hand)", "loop (separate params)"
    for r in results:
        scan = by_key.get((r.block, r.n, scan_name))
        loop = by_key.get((r.block, r.n, loop_name))
        tool = by_key.get((r.block, r.n, r.tool)) if r.tool else None
        if scan:
            r.compile_vs_scan, r.step_vs_scan = (_paired(r, scan, w) for w in ("compile", "step"))
        if loop:
            r.compile_vs_loop, r.step_vs_loop = (_paired(r, loop, w) for w in ("compile", "step"))
        if tool:
            r.compile_vs_tool, r.step_vs_tool = (_paired(r, tool, w) for w in ("compile", "step"))


# ==========================================================================
# Targets: the ratios the project's issues ask for.


class _Target(NamedTuple):
    what: str
    measured: float
    limit: float | None  # None: shown for reference (a noise floor), no target
    low: float = math.nan  # ~95% interval of `measured`, when it is a paired median
    high: float = math.nan


def _target_cells(t: _Target, no: str = "NO") -> list[str]:
    """what, measured (interval), target, met: "yes"; "within noise" when the median
    misses but the interval reaches the target (the miss is not significant); else no."""
    measured = _fmt(t.measured, ".3f")
    if not math.isnan(t.low):
        measured += f" ({t.low:.2f}-{t.high:.2f})"
    if t.limit is None:
        return [t.what, measured, "reference", "-"]
    if math.isnan(t.measured):
        met = "-"
    elif t.measured <= t.limit:
        met = "yes"
    else:
        met = "within noise" if t.low <= t.limit else no
    return [t.what, measured, f"<= {t.limit:g}", met]


def _targets(results: list[Result], cfg: BenchConfig) -> list[_Target]:
    by_key = {(r.block, r.n, r.variant): r for r in results}
    out: list[_Target] = []

    def get(block, n, variant):
        return by_key.get((block, n, variant))

    def ratio(what, row, ref, timing, limit):
        median, low, high = _paired_interval(row, ref, timing)
        return _Target(what, median, limit, low, high)

    mlp_ns = sorted({r.n for r in results if r.block == "mlp"})
    if mlp_ns:
        n = cfg.target_n if cfg.target_n in mlp_ns else mlp_ns[-1]
        sw = get("mlp", n, "stackwise")
        scan, loop = get("mlp", n, "lax.scan (hand)"), get("mlp", n, "loop (separate params)")
        if sw and scan:
            out += [
                ratio(f"mlp n={n}: stackwise compile / hand scan", sw, scan, "compile", 1.05),
                ratio(f"mlp n={n}: stackwise step / hand scan", sw, scan, "step", 1.03),
            ]
        if sw and loop:
            out.append(ratio(f"mlp n={n}: stackwise compile / loop", sw, loop, "compile", 0.25))
        default = get("mlp", n, "stackwise default")
        if default and loop:
            out.append(ratio(
                f"mlp n={n}: stackwise default (dots remat) step / loop", default, loop, "step", 1.3
            ))
        first, last = get("mlp", mlp_ns[0], "stackwise"), get("mlp", mlp_ns[-1], "stackwise")
        if first and last and first is not last:
            out.append(_Target(
                f"mlp: stackwise compile n={mlp_ns[-1]} / n={mlp_ns[0]}",
                last.compile_s / first.compile_s, 1.2,
            ))
        remat, nested = get("mlp", mlp_ns[-1], "stackwise remat"), get(
            "mlp", mlp_ns[-1], "stackwise nested"
        )
        if remat and nested and remat.temp_bytes > 0:
            out.append(_Target(
                f"mlp n={mlp_ns[-1]}: temp nested / per-layer remat",
                nested.temp_bytes / remat.temp_bytes, 1.0,
            ))
    tf_ns = sorted({r.n for r in results if r.block == "transformer"})
    if tf_ns:
        n = cfg.target_n if cfg.target_n in tf_ns else tf_ns[-1]
        for adapter, tool, loop in (
            ("stackwise.haiku.Stack", "hk.layer_stack", "hk loop"),
            ("stackwise.flax.Stack", "nn.scan", "nn loop"),
            ("stackwise.nnx.Stack", "nnx.scan", "nnx loop"),
        ):
            # Like for like: the adapter and its framework's tool with the same remat.
            for suffix in ("", " default", " remat"):
                row = get("transformer", n, adapter + suffix)
                ref = get("transformer", n, row.tool) if row and row.tool else None
                if not ref:
                    continue
                unlike = row.ops_unlike_tool
                same = (
                    "" if unlike < 0 else " (same program)" if unlike == 0
                    else f" ({unlike} instructions differ)"
                )
                out += [
                    ratio(f"tf n={n}: {row.variant} {w} / {row.tool}{same}", row, ref, w, limit)
                    for w, limit in (("compile", 1.0), ("step", 1.03))
                ]
            # As written: `Stack(Block, n)` (default remat) against the tool's default (none).
            default = get("transformer", n, adapter + " default")
            plain = get("transformer", n, tool)
            if default and plain:
                out += [
                    ratio(f"tf n={n}: {adapter} default {w} / {tool} (both as written)",
                          default, plain, w, limit)
                    for w, limit in (("compile", 1.0), ("step", 1.03))
                ]
            # The noise floor: the tool against a second, separately compiled copy of itself.
            control = get("transformer", n, f"{tool} (control)")
            if control and plain:
                out += [
                    ratio(f"tf n={n}: noise: {tool} (control) {w} / {tool}",
                          control, plain, w, None)
                    for w in ("compile", "step")
                ]
            loop_row = get("transformer", n, loop)
            for variant in (adapter, adapter + " default"):
                row = get("transformer", n, variant)
                if row and loop_row:
                    out.append(ratio(f"tf n={n}: {variant} compile / {loop}", row, loop_row,
                                     "compile", 0.25))
    return out


# ==========================================================================
# Output: table, CSV, plot.

_COLUMNS = [f.name for f in dataclasses.fields(Result)]
_SAMPLES = ("compile_samples", "step_samples")  # written as space-separated seconds


def _fmt(value: float, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(
        value, spec
    )


def _kib(b: int) -> str:
    return "-" if b < 0 else f"{b / 1024:,.0f}"


def _table_rows(results: list[Result]) -> list[list[str]]:
    return [
        [
            str(r.n), r.variant, r.remat,
            _fmt(r.compile_s, ".2f"), _fmt(r.trace_s, ".2f"), _fmt(r.compile_vs_scan, ".2f"),
            _fmt(r.compile_vs_loop, ".2f"), _fmt(r.compile_vs_tool, ".2f"),
            _fmt(r.step_s * 1e3, ".1f"), _fmt(r.step_vs_scan, ".2f"),
            _fmt(r.step_vs_loop, ".2f"), _fmt(r.step_vs_tool, ".2f"),
            _fmt(r.temp_bytes / 2**20, ".1f") if r.temp_bytes >= 0 else "-",
            _kib(r.program_chars),
            f"{_kib(r.barrier_param_bytes)} / {_kib(r.barrier_const_bytes)}",
            "-" if r.ops_unlike_tool < 0 else str(r.ops_unlike_tool),
        ]
        for r in results
    ]


_HEADERS = [
    "n", "variant", "remat", "compile s", "trace s", "/scan", "/loop", "/tool", "step ms", "/scan",
    "/loop",
    "/tool", "temp MiB", "HLO Kchars", "barrier KiB p / c", "ops != tool",
]


def print_report(
    results: list[Result], notes: list[str], cfg: BenchConfig, file: Any = None
) -> None:
    """Prints the results table per block, the targets summary and the notes."""
    file = file or sys.stdout
    try:
        from rich.console import Console
        from rich.table import Table

        console = Console(file=file, width=max(200, Console(file=file).width))

        def emit(title, headers, rows):
            table = Table(title=title, title_justify="left")
            for i, h in enumerate(headers):
                left = i in (1, 2) if headers[0] == "n" else i != 1
                table.add_column(h, justify="left" if left else "right")
            last = None
            for row in rows:
                if last is not None and row[0] != last and headers[0] == "n":
                    table.add_section()
                last = row[0]
                table.add_row(*row)
            console.print(table)

        say = console.print
    except ImportError:

        def emit(title, headers, rows):
            widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
            print(title, file=file)
            for row in [headers, *rows]:
                print("  ".join(c.ljust(w) for c, w in zip(row, widths)), file=file)
            print(file=file)

        def say(text):
            print(re.sub(r"\[/?[a-z ]+\]", "", text), file=file)

    for block in dict.fromkeys(r.block for r in results):
        rows = [r for r in results if r.block == block]
        emit(_block_title(block, cfg), _HEADERS, _table_rows(rows))
    targets = _targets(results, cfg)
    if targets:
        emit(
            "Targets (ratios measured in this run)",
            ["what", "measured", "target", "met"],
            [_target_cells(t) for t in targets],
        )
    for note in notes:
        say(f"note: {note}")


def _block_title(block: str, cfg: BenchConfig) -> str:
    if block == "mlp":
        return (
            f"mlp block h + gelu(h @ w1) @ w2: D={cfg.d}, hidden={cfg.hidden}, batch={cfg.batch}"
            "; jit(grad(mean(y**2)))"
        )
    return (
        f"transformer block (pre-LN causal attention + MLP): D={cfg.tf_d}, hidden="
        f"{cfg.tf_hidden}, heads={cfg.tf_heads}, seq={cfg.tf_seq}, batch={cfg.tf_batch}"
    )


def write_csv(results: list[Result], path: str) -> None:
    """Writes one row per result, with the machine and jax version on each."""
    machine = _machine()
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*_COLUMNS, "jax", "machine"])
        writer.writeheader()
        for r in results:
            row = dataclasses.asdict(r)
            row.update({k: " ".join(f"{v:.6g}" for v in row[k]) for k in _SAMPLES})
            writer.writerow({**row, "jax": jax.__version__, "machine": machine})


def write_markdown(results: list[Result], cfg: BenchConfig, path: str) -> None:
    """Writes the tables and the targets summary as Markdown (for docs)."""
    lines = []
    for block in dict.fromkeys(r.block for r in results):
        lines += [f"**{_block_title(block, cfg)}**", ""]
        lines += ["| " + " | ".join(_HEADERS) + " |", "|" + "---|" * len(_HEADERS)]
        rows = _table_rows([r for r in results if r.block == block])
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines.append("")
    targets = _targets(results, cfg)
    if targets:
        lines += ["| what | measured | target | met |", "|---|---|---|---|"]
        lines += ["| " + " | ".join(_target_cells(t, no="**no**")) + " |" for t in targets]
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def read_csv(path: str) -> list[Result]:
    """Reads back a CSV written by :func:`write_csv` (e.g. to re-plot or re-tabulate)."""
    types = {f.name: f.type for f in dataclasses.fields(Result)}
    out = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            values = {}
            for name, kind in types.items():
                raw = row.get(name, "")
                if name in _SAMPLES:
                    values[name] = tuple(float(v) for v in raw.split())
                else:
                    values[name] = (
                        float(raw) if kind == "float" else int(raw) if kind == "int" else raw
                    )
            out.append(Result(**values))
    return out


def write_plot(results: list[Result], path: str) -> str | None:
    """Compile time and temp memory against n, one panel row per block. Returns a note."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot written (pip install matplotlib)."
    blocks = list(dict.fromkeys(r.block for r in results))
    if not blocks:
        return "no results to plot."
    fig, axes = plt.subplots(len(blocks), 2, figsize=(13, 4.6 * len(blocks)), squeeze=False)
    for row, block in zip(axes, blocks):
        mine = [r for r in results if r.block == block]
        for variant in dict.fromkeys(r.variant for r in mine):
            pts = sorted((r.n, r.compile_s, r.temp_bytes) for r in mine if r.variant == variant)
            style = "--" if "loop" in variant else ("-" if "stackwise" in variant else ":")
            ns = [p[0] for p in pts]
            row[0].plot(ns, [p[1] for p in pts], style, marker="o", label=variant)
            row[1].plot(ns, [p[2] / 2**20 for p in pts], style, marker="o", label=variant)
        row[0].set(title=f"{block}: cold compile of jit(grad)", xlabel="n (layers)",
                   ylabel="seconds", yscale="log")
        row[1].set(title=f"{block}: compiled temp memory", xlabel="n (layers)", ylabel="MiB")
        row[1].legend(fontsize=7, loc="upper left")
        for ax in row:
            ax.grid(True, alpha=0.3)
    fig.suptitle(f"stackwise-bench, jax {jax.__version__}, {_machine()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    devices = ", ".join(sorted({d.device_kind for d in jax.devices()}))
    return f"{cpu}, {os.cpu_count()} cores, {devices}"


# ==========================================================================
# Command line.


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return values


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stackwise-bench",
        description="Compile time, step time and memory of n stacked layers under "
        "jit(grad): Python loops, lax.scan, stackwise and the frameworks' own tools.",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, n in {2, 4}")
    p.add_argument("--blocks", default=None, help="mlp,transformer (default: both)")
    p.add_argument("--n", type=_ints, default=None, help="depths for the mlp block (8,24,48,96)")
    p.add_argument("--transformer-n", type=_ints, default=None,
                   help="depths for the transformer block (8; the README also ran 48)")
    p.add_argument("--variants", default="",
                   help="comma-separated substrings: run only matching variants")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per depth (7)")
    p.add_argument("--compile-repeats", type=int, default=None,
                   help="cold compiles per variant, the minimum is reported (1)")
    p.add_argument("--target-n", type=int, default=None, help="depth of the targets summary (48)")
    p.add_argument("--csv", default="stackwise-bench.csv", help="CSV path ('' for none)")
    p.add_argument("--plot", default="stackwise-bench.png", help="PNG path ('' for none)")
    p.add_argument("--markdown", default="", help="also write the tables as Markdown here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The ``stackwise-bench`` command; ``argv`` defaults to ``sys.argv[1:]``."""
    args = _parser().parse_args(argv)
    overrides: dict[str, Any] = {"seed": args.seed}
    if args.blocks:
        blocks = tuple(b.strip() for b in args.blocks.split(",") if b.strip())
        unknown = set(blocks) - {"mlp", "transformer"}
        if unknown:
            _parser().error(f"--blocks: unknown {sorted(unknown)}; choose from mlp, transformer")
        overrides["blocks"] = blocks
    for flag, field in (
        ("n", "ns"), ("transformer_n", "transformer_ns"), ("rounds", "rounds"),
        ("compile_repeats", "compile_repeats"), ("target_n", "target_n"),
    ):
        if getattr(args, flag) is not None:
            overrides[field] = getattr(args, flag)
    if args.variants:
        overrides["variants"] = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    cfg = BenchConfig.quick(**overrides) if args.quick else BenchConfig(**overrides)
    log = functools.partial(print, file=sys.stderr)
    log(f"stackwise-bench: jax {jax.__version__} on {_machine()}")
    start = time.perf_counter()
    results, notes = run_benchmark(cfg, progress=not args.no_progress, log=log)
    print_report(results, notes, cfg)
    if args.csv:
        write_csv(results, args.csv)
        print(f"wrote {args.csv}")
    if args.plot:
        note = write_plot(results, args.plot)
        print(f"note: {note}" if note else f"wrote {args.plot}")
    if args.markdown:
        write_markdown(results, cfg, args.markdown)
        print(f"wrote {args.markdown}")
    print(f"total time {time.perf_counter() - start:.0f} s")
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
