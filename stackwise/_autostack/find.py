"""Finding the run of repeated blocks in a jaxpr, and what each block reads.

Two steps. :func:`candidates` finds runs of ``k >= 2`` consecutive windows of ``p``
equations whose signatures (:mod:`stackwise._autostack.signature`) repeat, longest first.
:func:`follow` then follows the data through a candidate: each operand of block ``i`` must
be a value block ``i`` makes itself (where block 0 makes its own), a value the previous
block made (the carry, where block 0 reads a value from before the run), or a value from
before the run (the same in every block: shared; different: a param leaf of that block, or
a per-block input that the scan takes stacked). The first operand that is none of these
cuts the run at its block, and says why.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from stackwise._autostack.signature import describe

__all__ = ["Failure", "Plan", "candidates", "follow"]


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
                    reason = f"reads {_origin(xm, i)} where block 0 reads a value from before the run"
                if reason is not None:
                    failure = Failure(i, f"its {describe(eqn, j)} {reason} (operand {a})")
                    plan = None
                    if i >= 2:
                        plan, _ = follow(jaxpr, start, p, i, n_params, readers)
                    return plan, failure
    return _plan(jaxpr, start, p, count, n_params, readers, made, carry_of, inits, outer), None


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
