"""Reading programs in the tests: what passes an optimization barrier, what goes to the host."""

import re

import jax
import jax.extend


def barrier_operand_types(text):
    """The tensor types of every `optimization_barrier` operand in StableHLO `text`."""
    types = []
    for line in text.splitlines():
        if "optimization_barrier" in line:
            types += re.findall(r"tensor<([^>]*)>", line.rsplit(":", 1)[1])
    return types


def put_on_host(jaxpr) -> list[tuple[str, tuple[int, ...]]]:
    """``(primitive, shape)`` of every value a traced program places in host memory, in every
    sub-jaxpr (a remat policy's offload: ``device_put`` of a layer's value inside the scan's
    body, the scan's stacked output in host memory)."""
    found = []
    for eqn in jaxpr.eqns:
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += put_on_host(sub)
        for v in eqn.outvars:
            if "host" in str(getattr(v.aval, "memory_space", "")).lower():
                found.append((eqn.primitive.name, tuple(v.aval.shape)))
    return found
