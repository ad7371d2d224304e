"""Finding the runs of repeated blocks in a jaxpr, and what each block reads.

Two steps, and a choice. :func:`candidates` finds runs of ``k >= 2`` consecutive windows of ``p``
equations whose signatures (:mod:`stackwise._autostack.signature`) repeat, longest first.
:func:`follow` then follows the data through a candidate: each operand of block ``i`` must
be a value block ``i`` makes itself (where block 0 makes its own), a value the previous
block made (the carry, where block 0 reads a value from before the run), or a value from
before the run (the same in every block: shared; different: a param leaf of that block, or
a per-block input that the scan takes stacked), and a static ``slice`` that starts
elsewhere than block 0's (``keys[i]``) must slice one shared array at a start stepping alike
along one axis (``Plan.indexed``). The first operand or slice that is none of these cuts
the run at its block, and says why. :func:`runs` takes the longest run, then every
other run that overlaps none taken, repeats another block and is a run of layers (each block
reads param leaves of its own and the previous block's values: an encoder's layers, then a
decoder's).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from stackwise._autostack.signature import describe, is_index

__all__ = ["Failure", "Plan", "Search", "candidates", "follow", "free_parts", "layer_run",
           "runs"]


class Failure(NamedTuple):
    """Block ``block`` of the run at ``start`` breaks it: ``text`` says how."""

    block: int
    text: str


class Plan(NamedTuple):
    """A run of ``count`` blocks of ``period`` equations from equation ``start``, and where
    each operand of the template (block 0) comes from.

    ``roles[j][a]`` is the role of operand ``a`` of the template's equation ``j``:
    ``("own", j', o)`` (output ``o`` of its equation ``j'``), ``("carry", c)``,
    ``("param", q)``, ``("scan", q)``, ``("shared", h)`` or ``("literal", literal)``.
    """

    start: int
    period: int
    count: int
    roles: tuple
    carry: tuple  # (j, o) of each carried value, as the template makes it
    carry_init: tuple  # the atom each carry starts from (None: zeros, never read first)
    ys: tuple  # (j, o) of each value the code after the run reads from every block
    params: tuple  # per param slot: the params-leaf index of each block's leaf
    scanned: tuple  # per scanned slot: each block's atom (a Var or a Literal)
    shared: tuple  # atoms every block reads alike
    indexed: tuple = ()  # (j, axis, step): the template's `slice` j, block i's at i * step

    @property
    def stop(self) -> int:
        return self.start + self.period * self.count


def candidates(ids: np.ndarray) -> list[tuple[int, int, int, int]]:
    """``(equations covered, period, start, blocks)`` of every maximal run of repeated
    signature windows with at least 2 blocks: most equations first, then the shorter period,
    then the earlier start."""
    m, found = len(ids), []
    for p in range(1, m // 2 + 1):
        same = np.concatenate([[0], (ids[:-p] == ids[p:]).astype(np.int8), [0]])
        edges = np.diff(same)
        starts, stops = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        for a, length in zip(starts, stops - starts):
            if length >= p:
                k = int(length) // p + 1
                found.append((k * p, p, int(a), k))
    found.sort(key=lambda c: (-c[0], c[1], c[2]))
    return found


class Search(NamedTuple):
    """What :func:`runs` found: ``plans``, the runs to stack in program order (none: no run
    of 2 or more blocks); ``failures``, ``(first equation of a block, period)`` -> how it
    breaks its run; ``top``, the longest candidate (words for why nothing was found);
    ``passed_over``, ``(plan, why)`` of the repeats besides the longest run not taken."""

    plans: list
    failures: dict
    top: tuple | None
    passed_over: list


def layer_run(plan: Plan) -> str | None:
    """Why ``plan``, a repeat besides the longest run, is not a run of layers (None: it is):
    each block reads param leaves of its own, a value flows from each block to the next, and
    a block is more than one equation (two consecutive broadcasts of a norm's scale and
    offset repeat, but are no stack)."""
    if not plan.params:
        return "no block reads param leaves of its own"
    if not plan.carry:
        return "no value flows from one block to the next"
    if plan.period < 2:
        return "each block is one equation"
    return None


def runs(jaxpr: Any, ids: np.ndarray, n_params: int, readers: dict) -> Search:
    """The runs to stack: the longest, then each other repeat that overlaps none taken, is
    another block than theirs and is a run of layers (:func:`layer_run`)."""
    found = candidates(ids) if len(ids) >= 2 else []
    failures: dict = {}
    best, top = None, None

    def aligned(lo: int, hi: int, p: int) -> Plan | None:
        """The best run of ``p``-equation blocks in the repeated region ``[lo, hi)``, over
        where its blocks may start: the most equations, then the fewest values carried
        from block to block (a layer's own boundary), then the earliest."""
        plans = []
        for start in range(lo, lo + (hi - lo) % p + 1):
            plan, failure = follow(jaxpr, start, p, (hi - lo) // p, n_params, readers)
            if failure is not None:
                failures.setdefault((start + failure.block * p, p), failure.text)
            plans += [plan] if plan is not None else []
        return min(plans, key=_rank, default=None)

    for covered, p, a, k in found:
        if best is not None and covered <= best.period * best.count:
            break
        top = top or (covered, p, a, k)
        plan = aligned(a, _region_end(ids, a, p, k), p)
        if plan is not None and (best is None or _rank(plan) < _rank(best)):
            best = plan
    if best is None:
        return Search([], failures, top, [])
    chosen, passed_over = [best], []
    for _, p, a, k in found:
        for lo, hi in free_parts(a, _region_end(ids, a, p, k), p, chosen):
            plan = aligned(lo, hi, p)
            if plan is None or any(_same_block(ids, plan, c) for c in chosen):
                continue
            why = layer_run(plan)
            if why is None:
                chosen.append(plan)
                break
            passed_over.append((plan, why))
    return Search(sorted(chosen, key=lambda plan: plan.start), failures, top, passed_over)


def _rank(plan: Plan) -> tuple:
    return (-plan.period * plan.count, len(plan.carry), plan.start)


def _region_end(ids: np.ndarray, a: int, p: int, k: int) -> int:
    """One past the last equation of the repeated region whose first ``k`` blocks of ``p``
    start at ``a`` (up to ``p - 1`` equations more repeat after them)."""
    end = a + k * p
    while end < len(ids) and end - a - k * p < p - 1 and ids[end] == ids[end - p]:
        end += 1
    return end


def free_parts(a: int, e: int, p: int, chosen: list[Plan]) -> list[tuple[int, int]]:
    """The parts of the region ``[a, e)`` that no chosen run covers and that hold at least
    2 blocks of ``p`` equations."""
    parts = [(a, e)]
    for c in chosen:
        parts = [piece for lo, hi in parts
                 for piece in ((lo, min(hi, c.start)), (max(lo, c.stop), hi))
                 if piece[1] > piece[0]]
    return [(lo, hi) for lo, hi in parts if hi - lo >= 2 * p]


def _same_block(ids: np.ndarray, plan: Plan, other: Plan) -> bool:
    """Whether ``plan``'s block is ``other``'s, or a rotation of it (the same loop)."""
    if plan.period != other.period:
        return False
    mine = ids[plan.start:plan.start + plan.period]
    theirs = ids[other.start:other.start + other.period]
    return any((np.roll(theirs, r) == mine).all() for r in range(other.period))


def _literal_key(atom: Any) -> tuple:
    value = np.asarray(atom.val)
    return ("literal", str(atom.aval), value.tobytes())


def follow(jaxpr: Any, start: int, period: int, count: int, n_params: int,
           readers: dict) -> tuple[Plan | None, Failure | None]:
    """The plan of the run of ``count`` blocks at ``start``, or the longest valid prefix of
    it (``None`` below 2 blocks) and the failure that cut it.

    ``readers`` maps a variable to the indices of the equations that read it (``-1``: the
    jaxpr's outputs); ``n_params`` leading invars are the params' leaves."""
    from jax.extend.core import Literal

    eqns, p = jaxpr.eqns, period
    made: dict = {}
    for i in range(count):
        for j in range(p):
            for o, v in enumerate(eqns[start + i * p + j].outvars):
                made[v] = (i, j, o)

    def where(v):
        return None if isinstance(v, Literal) else made.get(v)

    steps: dict = {}  # `slice` j -> (axis, step) where block 1's starts elsewhere, or None
    carry_of: dict = {}  # operand (j, a) -> the carried (j', o) block 1 reads there
    inits: dict = {}  # carried (j', o) -> block 0's atom there
    outer: dict = {}  # operand (j, a) -> the atoms of blocks 1.. from before the run
    for i in range(1, count):
        for j in range(p):
            template, eqn = eqns[start + j], eqns[start + i * p + j]
            for a, (t, x) in enumerate(zip(template.invars, eqn.invars)):
                tm, xm = where(t), where(x)
                reason = None
                if tm is not None:  # block 0 reads its own value
                    if xm != (i, *tm[1:]):
                        reason = (
                            f"reads {_origin(xm, i)} where block 0 reads its own "
                            f"equation {tm[1]}'s output"
                        )
                elif xm is None:
                    if (j, a) in carry_of:
                        reason = "reads a value from before the run where block 1 reads block 0's"
                    outer.setdefault((j, a), []).append(x)
                elif xm[0] == i - 1:
                    slot = xm[1:]
                    if i == 1:
                        carry_of[(j, a)] = slot
                        if slot in inits and not _same_atom(inits[slot], t):
                            reason = (
                                f"reads block 0's equation {slot[0]} output at two places where "
                                "block 0 reads two different values"
                            )
                        inits[slot] = t
                    elif carry_of.get((j, a)) != slot:
                        reason = f"reads {_origin(xm, i)} where block 1 reads another value"
                else:
                    reason = (f"reads {_origin(xm, i)} where block 0 reads a value from "
                              "before the run")
                if reason is not None:
                    failure = Failure(i, f"its {describe(eqn, j)} {reason} (operand {a})")
                    break
            else:
                failure = None
                if is_index(template):
                    reason = _index_step(template, eqn, i, j, steps, where)
                    failure = reason and Failure(i, f"its {describe(eqn, j)}: {reason}")
            if failure is not None:
                plan = None
                if i >= 2:
                    plan, _ = follow(jaxpr, start, p, i, n_params, readers)
                return plan, failure
    indexed = tuple((j, *step) for j, step in sorted(steps.items()) if step is not None)
    plan = _plan(jaxpr, start, p, count, n_params, readers, made, carry_of, inits, outer)
    return plan._replace(indexed=indexed), None


def _index_step(template: Any, eqn: Any, i: int, j: int, steps: dict, where: Any) -> str | None:
    """Why block ``i``'s static ``slice`` ``eqn`` does not start where the run's blocks step
    to (block ``i`` at block 0's start plus ``i`` steps along one axis, of one array from
    before the run), or None. Block 1 sets the axis and step (``steps[j]``)."""
    first, here = template.params["start_indices"], eqn.params["start_indices"]
    moved = [axis for axis, (a, b) in enumerate(zip(first, here)) if a != b]
    why = None
    if i == 1:
        steps[j] = (moved[0], here[moved[0]] - first[moved[0]]) if moved else None
        shared = where(template.invars[0]) is None and eqn.invars[0] is template.invars[0]
        if len(moved) > 1:
            why = f"it starts elsewhere along {len(moved)} axes, not one"
        elif moved and not shared:
            why = ("it slices another array than block 0's, or a value made in the run, "
                   "not one array from before the run that every block slices")
    else:
        axis, step = steps[j] or (0, 0)
        want = tuple(a + (i * step if k == axis else 0) for k, a in enumerate(first))
        if tuple(here) != want:
            why = (f"block 1 steps {step} along axis {axis} from block 0, so block {i} would "
                   f"start at {want}: the starts are no arithmetic progression")
    if why is None:
        return None
    return (f"its param `start_indices` is {tuple(here)} where block 0's is {tuple(first)}: "
            f"{why} (blocks may slice one array at indices stepping alike from block to "
            "block, `keys[i]`; else pass each layer's value in its params, or as a traced "
            "value the blocks read)")


def _origin(xm: tuple | None, i: int) -> str:
    if xm is None:
        return "a value from before the run"
    if xm[0] == i:
        return f"its own equation {xm[1]}'s output"
    back = i - xm[0]
    if back == 1:
        return f"the previous block's equation {xm[1]} output"
    return (f"a value block {xm[0]} made (its equation {xm[1]}), {back} blocks back: a block "
            "reads only its own values, the previous block's, and values from before the run")


def _same_atom(a: Any, b: Any) -> bool:
    from jax.extend.core import Literal

    if isinstance(a, Literal) or isinstance(b, Literal):
        both = isinstance(a, Literal) and isinstance(b, Literal)
        return both and _literal_key(a) == _literal_key(b)
    return a is b


def _plan(jaxpr, start, p, count, n_params, readers, made, carry_of, inits, outer) -> Plan:
    from jax.extend.core import Literal

    eqns = jaxpr.eqns
    stop = start + p * count
    param_index = {v: k for k, v in enumerate(jaxpr.invars[:n_params])}
    roles: list[list] = [[None] * len(eqns[start + j].invars) for j in range(p)]
    carry = sorted(set(carry_of.values()))
    # Values the code after the run reads: a carried value of the last block from the final
    # carry, every other from the scan's stacked outputs (a value no block reads from the
    # previous one, e.g. each layer's updated KV cache, is never carried: a carry of it
    # would start from zeros and pass through every step).
    ys = set()
    for v, (i, j, o) in made.items():
        if any(r == -1 or not start <= r < stop for r in readers.get(v, ())):
            if i < count - 1 or (j, o) not in carry:
                ys.add((j, o))
    varying: dict = {}  # the atoms' keys -> the atoms, per distinct per-block slot
    shared: dict = {}
    for j in range(p):
        for a, t in enumerate(eqns[start + j].invars):
            tm = None if isinstance(t, Literal) else made.get(t)
            if tm is not None:
                roles[j][a] = ("own", tm[1], tm[2])
            elif (j, a) in carry_of:
                roles[j][a] = ("carry", carry.index(carry_of[(j, a)]))
            else:
                atoms = [t, *outer.get((j, a), [])]
                keys = tuple(_literal_key(x) if isinstance(x, Literal) else x for x in atoms)
                if all(key == keys[0] for key in keys):
                    if isinstance(t, Literal):
                        roles[j][a] = ("literal", t)
                    else:
                        roles[j][a] = ("shared", shared.setdefault(t, len(shared)))
                else:
                    roles[j][a] = ("varying", varying.setdefault(keys, atoms) and keys)
    # A per-block slot is a stacked param when it holds distinct param leaves, each read by
    # its own block only; any other (literals, activations, a leaf read twice) is scanned.
    seen: dict = {}
    for keys in varying:
        for key in keys:
            seen[key] = seen.get(key, 0) + 1

    def stackable(keys: tuple) -> bool:
        return all(
            key in param_index and seen[key] == 1 and keys.count(key) == 1
            and all(start + i * p <= r < start + (i + 1) * p for r in readers.get(key, ()))
            for i, key in enumerate(keys)
        )

    params, scanned, slot_of = [], [], {}
    for keys, atoms in varying.items():
        if stackable(keys):
            slot_of[keys] = ("param", len(params))
            params.append(tuple(param_index[v] for v in atoms))
        else:
            slot_of[keys] = ("scan", len(scanned))
            scanned.append(tuple(atoms))
    for row in roles:
        for a, role in enumerate(row):
            if role[0] == "varying":
                row[a] = slot_of[role[1]]
    return Plan(
        start=start,
        period=p,
        count=count,
        roles=tuple(tuple(r) for r in roles),
        carry=tuple(carry),
        carry_init=tuple(inits.get(c) for c in carry),
        ys=tuple(sorted(ys)),
        params=tuple(params),
        scanned=tuple(scanned),
        shared=tuple(shared),
    )
