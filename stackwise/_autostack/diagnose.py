"""Why a traced model's blocks could not be stacked, in words: the first block that differs,
which of its equations, and how."""

from __future__ import annotations

from typing import Any

import numpy as np

from stackwise._autostack.find import Plan
from stackwise._autostack.signature import Signatures, describe, difference

__all__ = ["broken", "no_run"]


def _walk(eqns: list, ids: np.ndarray, sigs: Signatures, t0: int, p: int,
          failures: dict) -> tuple[int, int, str]:
    """From the block at equation ``t0``, the first block (index, first equation) that
    differs from it, and how."""
    template, m = ids[t0:t0 + p], len(ids)
    pos = t0 + p
    while pos + p <= m and (ids[pos:pos + p] == template).all() and (pos, p) not in failures:
        pos += p
    block = (pos - t0) // p
    if (pos, p) in failures:
        return block, pos, failures[(pos, p)]
    for j in range(p):
        if pos + j >= m:
            return block, pos, f"the jaxpr ends at its equation {j}"
        if ids[pos + j] != template[j]:
            eqn = eqns[pos + j]
            return block, pos, f"its {describe(eqn, j)}: {difference(sigs, eqns[t0 + j], eqn)}"
    return block, pos, "it differs"  # (unreachable: the loop stopped for a reason)


def broken(eqns: list, ids: np.ndarray, sigs: Signatures, plan: Plan, n: int | None,
           failures: dict) -> str | None:
    """Why ``plan`` is not the whole loop, or None: its block recurs elsewhere (a broken
    loop), or it holds another number of blocks than ``n``."""
    s, p = plan.start, plan.period
    windows = np.lib.stride_tricks.sliding_window_view(ids, p)
    matches = np.flatnonzero((windows == ids[s:s + p]).all(axis=1))
    elsewhere = [int(t) for t in matches if t + p <= s or t >= plan.stop]
    if not elsewhere and (n is None or n == plan.count):
        return None
    t0 = min([s, *elsewhere])
    block, pos, how = _walk(eqns, ids, sigs, t0, p, failures)
    at = (f"block {block} (equations {pos}-{pos + p - 1}; blocks of {p} equations counted "
          f"from equation {t0})")
    if elsewhere:
        again = ", ".join(str(t) for t in elsewhere[:4]) + (", ..." if len(elsewhere) > 4 else "")
        return (f"the loop is broken at {at}: {how}. Blocks 0-{plan.count - 1} of the run at "
                f"equation {s} are the same computation, and the same block recurs at "
                f"equation {again}")
    return f"`n={n}` blocks were expected, but {plan.count} were found; the run ends at {at}: {how}"


def no_run(eqns: list, ids: np.ndarray, sigs: Signatures, top: Any, failures: dict) -> str:
    """Why no run of 2 or more blocks was found."""
    effects = [j for j, e in enumerate(eqns) if e.effects]
    note = ""
    if effects:
        note = (f"; equations with effects are never part of a run "
                f"(fn's {describe(eqns[effects[0]], effects[0])} has {len(effects) > 1 and 'some' or 'one'})")
    if top is None:
        return (f"no two consecutive blocks of equations in fn's jaxpr ({len(eqns)} equations) "
                f"are the same computation (primitives, params, shapes and dtypes){note}")
    _, p, a, _ = top
    block, pos, how = _walk(eqns, ids, sigs, a, p, failures)
    return (f"found no run of 2 or more blocks: the longest candidate, blocks of {p} "
            f"equations from equation {a}, breaks at block {block} (equations {pos}-"
            f"{pos + p - 1}): {how}{note}")
