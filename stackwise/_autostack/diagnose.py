"""Why a traced model's blocks could not be stacked, in words: the first block that differs,
which of its equations, and how."""

from __future__ import annotations

from typing import Any

import numpy as np

from stackwise._autostack.find import Plan, Search, candidates, free_parts
from stackwise._autostack.signature import (
    KEPT,
    Signatures,
    describe,
    difference,
    effect_words,
    unkept,
)

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


def broken(eqns: list, ids: np.ndarray, sigs: Signatures, search: Search,
           n: Any) -> str | None:
    """Why the runs found are not the whole loops, or None: a run's block recurs outside
    every run (a broken loop), or the runs hold other numbers of blocks than ``n`` (an int:
    one run's; a tuple: each run's, in program order)."""
    plans, failures = search.plans, search.failures
    for plan in plans:
        s, p = plan.start, plan.period
        windows = np.lib.stride_tricks.sliding_window_view(ids, p)
        matches = np.flatnonzero((windows == ids[s:s + p]).all(axis=1))
        elsewhere = [int(t) for t in matches
                     if not any(t < c.stop and c.start < t + p for c in plans)]
        if elsewhere:
            t0 = min([s, *elsewhere])
            block, pos, how = _walk(eqns, ids, sigs, t0, p, failures)
            again = ", ".join(map(str, elsewhere[:4])) + (", ..." if len(elsewhere) > 4 else "")
            return (f"the loop is broken at {_at(block, pos, p, t0)}: {how}. Blocks "
                    f"0-{plan.count - 1} of the run at equation {s} are the same computation, "
                    f"and the same block recurs at equation {again}")
    if n is None:
        return None
    if not isinstance(n, (tuple, list)):
        if len(plans) > 1:
            counts = tuple(plan.count for plan in plans)
            return (f"`n={n}` expects one run, but {_runs(plans)}; pass `n={counts}`, the "
                    "blocks of each run in program order")
        return _counted(eqns, ids, sigs, plans[0], n, f"`n={n}` blocks were expected, but "
                        f"{plans[0].count} were found; the run ends at", failures)
    if len(n) != len(plans):
        return (f"`n={tuple(n)}` expects {len(n)} run{'s' if len(n) > 1 else ''}, but "
                f"{_runs(plans)}"
                + (_elsewhere(eqns, ids, sigs, search) if len(n) > len(plans) else ""))
    for r, (plan, want) in enumerate(zip(plans, n)):
        problem = _counted(eqns, ids, sigs, plan, want, f"`n={tuple(n)}`: run {r} (from "
                           f"equation {plan.start}) has {plan.count} blocks, not {want}; it "
                           "ends at", failures)
        if problem is not None:
            return problem
    return None


def _counted(eqns: list, ids: np.ndarray, sigs: Signatures, plan: Plan, n: int, what: str,
             failures: dict) -> str | None:
    """Why ``plan`` ends after other than ``n`` blocks (``what`` leads), or None."""
    if plan.count == n:
        return None
    block, pos, how = _walk(eqns, ids, sigs, plan.start, plan.period, failures)
    return f"{what} {_at(block, pos, plan.period, plan.start)}: {how}"


def _at(block: int, pos: int, p: int, t0: int) -> str:
    return (f"block {block} (equations {pos}-{pos + p - 1}; blocks of {p} equations counted "
            f"from equation {t0})")


def _runs(plans: list[Plan]) -> str:
    """``2 were found (6 blocks of 4 equations from equation 0, ...)``."""
    each = ", ".join(f"{plan.count} blocks of {plan.period} equations from equation "
                     f"{plan.start}" for plan in plans)
    return f"{len(plans)} {'was' if len(plans) == 1 else 'were'} found ({each})"


def _elsewhere(eqns: list, ids: np.ndarray, sigs: Signatures, search: Search) -> str:
    """Why no other run was found outside the runs: a repeat passed over and why, or the
    longest repeat there and where it breaks, or that nothing repeats there."""
    if search.passed_over:
        plan, why = search.passed_over[0]
        return (f"; outside them, {plan.count} blocks of {plan.period} equations from "
                f"equation {plan.start} repeat, but {why} (a run besides the longest is a "
                "stack of layers)")
    for _, p, a, k in candidates(ids):
        for start, _ in free_parts(a, a + k * p, p, search.plans):
            block, pos, how = _walk(eqns, ids, sigs, start, p, search.failures)
            return (f"; outside them, the longest candidate, blocks of {p} equations from "
                    f"equation {start}, breaks at block {block} (equations {pos}-"
                    f"{pos + p - 1}): {how}")
    return "; outside them no two consecutive blocks of equations are the same computation"


def no_run(eqns: list, ids: np.ndarray, sigs: Signatures, top: Any, failures: dict) -> str:
    """Why no run of 2 or more blocks was found."""
    effects = [j for j, e in enumerate(eqns) if unkept(e)]
    note = ""
    if effects:
        first = eqns[effects[0]]
        note = (f"; equations with effects other than callbacks' are never part of a run "
                f"(fn's {describe(first, effects[0])} has the effect "
                f"{effect_words(unkept(first))}; {KEPT})")
    if top is None:
        return (f"no two consecutive blocks of equations in fn's jaxpr ({len(eqns)} equations) "
                f"are the same computation (primitives, params, shapes and dtypes){note}")
    _, p, a, _ = top
    block, pos, how = _walk(eqns, ids, sigs, a, p, failures)
    return (f"found no run of 2 or more blocks: the longest candidate, blocks of {p} "
            f"equations from equation {a}, breaks at block {block} (equations {pos}-"
            f"{pos + p - 1}): {how}{note}")
