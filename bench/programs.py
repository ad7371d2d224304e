"""Whether two compiled programs are the same, up to names, and how many instructions differ.

The input is XLA's optimised HLO, ``jax.jit(f).lower(...).compile().as_text()``. Two
programs with the same :func:`program_fingerprint` run the same machine code on the same
inputs, so their step times differ only by measurement noise.
"""

from __future__ import annotations

import collections
import hashlib
import re
from collections.abc import Sequence

__all__ = ["instructions_unlike", "program_fingerprint", "program_instructions"]

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
    return hashlib.sha256("\n".join(program_instructions(hlo_text)).encode()).hexdigest()[:16]


def program_instructions(hlo_text: str) -> list[str]:
    """The instruction lines of an HLO text, in order, names and metadata blanked.

    >>> program_instructions('%x.1 = f32[3] parameter(0), metadata={op_name="x"}')
    ['% = f32[3] parameter(0)']
    """
    lines = []
    for line in hlo_text.splitlines():
        line = line.strip()
        if " = " in line and not line.startswith(("HloModule", "//")):
            lines.append(_NAME.sub("%", _METADATA.sub("", line)))
    return lines


def instructions_unlike(a: Sequence[str], b: Sequence[str]) -> int:
    """How many instructions two programs do not share (a multiset difference, both ways).

    ``a`` and ``b`` are :func:`program_instructions` of the two programs; 0: the same program.

    >>> instructions_unlike(["% = add", "% = mul"], ["% = add", "% = sub"])
    2
    """
    ca, cb = collections.Counter(a), collections.Counter(b)
    return sum((ca - cb).values()) + sum((cb - ca).values())

