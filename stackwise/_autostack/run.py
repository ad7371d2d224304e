"""Re-emitting a traced model with each run of blocks as one ``lax.scan``.

The equations between the runs are bound as traced; each run becomes a scan whose body binds
block 0's equations, each operand read from its role in the :class:`Plan` (the carry, the
layer's params slice, a scanned input, a shared value, a literal, or an earlier output of
the body; a static ``slice`` of ``Plan.indexed`` is sliced at the layer's index); the
equations after the run read the last block's values from the final carry
and every other block's from the scan's stacked outputs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from stackwise._autostack.find import Plan
from stackwise._core.stack import CARRY_NAME
from stackwise._upstream import jax as jax_ties

__all__ = ["evaluate"]


def _read(env: dict, atom: Any) -> Any:
    from jax.extend.core import Literal

    return atom.val if isinstance(atom, Literal) else env[atom]


def _stack_atoms(env: dict, atoms: tuple) -> Any:
    from jax.extend.core import Literal

    dtype = atoms[0].aval.dtype
    if all(isinstance(a, Literal) for a in atoms):  # a constant of the program
        return np.stack([np.asarray(a.val, dtype) for a in atoms])
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return jnp.stack([_read(env, a) for a in atoms])
    return jnp.stack([jnp.asarray(_read(env, a), dtype) for a in atoms])


def _slice_at(eqn: Any, operand: Any, layer: Any, axis: int, step: int) -> Any:
    """The static ``slice`` ``eqn`` (block 0's) of ``operand``, started ``layer * step``
    further along ``axis``: the same values as block ``layer``'s slice."""
    start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
    starts = [np.int32(a) for a in start]
    starts[axis] = np.int32(start[axis]) + layer * np.int32(step)
    return jax.lax.dynamic_slice(operand, starts, [b - a for a, b in zip(start, limit)])


def _bind_all(eqns: list, env: dict) -> None:
    for eqn in eqns:
        outs = jax_ties.bind(eqn, [_read(env, v) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs))


def evaluate(jaxpr: Any, env: dict, plans: tuple[Plan, ...], blocks: list,
             remat: tuple) -> list:
    """The jaxpr's outputs, with ``env`` holding its constants and inputs (the stacked param
    leaves apart: ``blocks``, one array per param slot of each plan, in the plans' order)."""
    eqns, done = jaxpr.eqns, 0
    for plan in plans:
        _bind_all(eqns[done:plan.start], env)
        _scan(eqns, env, plan, blocks[:len(plan.params)], remat)
        blocks, done = blocks[len(plan.params):], plan.stop
    _bind_all(eqns[done:], env)
    return [_read(env, v) for v in jaxpr.outvars]


def _scan(eqns: list, env: dict, plan: Plan, blocks: list, remat: tuple) -> None:
    """Binds ``plan``'s run as one scan: its values that code after it reads into ``env``."""
    s, p, k = plan.start, plan.period, plan.count
    template = eqns[s:s + p]
    init = []
    for (j, o), atom in zip(plan.carry, plan.carry_init):
        if atom is None:  # (read after the run only: the first block never reads it)
            aval = template[j].outvars[o].aval
            init.append(jnp.zeros(aval.shape, aval.dtype))
        else:
            init.append(_read(env, atom))
    scanned = [_stack_atoms(env, atoms) for atoms in plan.scanned]
    shared = [_read(env, atom) for atom in plan.shared]

    indexed = {j: (axis, step) for j, axis, step in plan.indexed}

    def body(carry: list, xs: tuple) -> tuple[list, list]:
        params, scanned, layer = xs
        sources = {
            "carry": [checkpoint_name(c, CARRY_NAME) for c in carry],
            "param": params,
            "scan": scanned,
            "shared": shared,
        }
        own: dict = {}
        for j, eqn in enumerate(template):
            ins = []
            for role in plan.roles[j]:
                if role[0] == "own":
                    ins.append(own[role[1:]])
                elif role[0] == "literal":
                    ins.append(role[1].val)
                else:
                    ins.append(sources[role[0]][role[1]])
            if j in indexed:  # (`keys[i]`: block 0's slice, moved `layer` steps)
                outs = [_slice_at(eqn, ins[0], layer, *indexed[j])]
            else:
                outs = jax_ties.bind(eqn, ins)
            own.update(((j, o), out) for o, out in enumerate(outs))
        return [own[c] for c in plan.carry], [own[y] for y in plan.ys]

    rematted, policy = remat
    if rematted:
        body = jax.checkpoint(body, prevent_cse=False, policy=policy)
    layers = jnp.arange(k, dtype=np.int32) if indexed else None
    carry, ys = jax.lax.scan(body, init, (list(blocks), scanned, layers), length=k)
    last = s + (k - 1) * p
    for (j, o), value in zip(plan.carry, carry):
        env[eqns[last + j].outvars[o]] = value
    for (j, o), stacked in zip(plan.ys, ys):
        for i in range(k):
            env[eqns[s + i * p + j].outvars[o]] = stacked[i]
