"""Reading lowered programs in the tests: what passes an optimization barrier."""

import re


def barrier_operand_types(text):
    """The tensor types of every `optimization_barrier` operand in StableHLO `text`."""
    types = []
    for line in text.splitlines():
        if "optimization_barrier" in line:
            types += re.findall(r"tensor<([^>]*)>", line.rsplit(":", 1)[1])
    return types
