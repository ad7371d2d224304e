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


# --------------------------------------------------------------------------
# Backend facts of compiled programs, asserted where they hold.
#
# XLA prints a compiled module's aliases (``input_output_alias``) and its parameters' shapes
# (``entry_computation_layout``) on every backend: which donated buffer an output reuses is read
# there. ``memory_analysis()``'s byte counts are the backend's: XLA:CPU lays an array out
# unpadded (its bytes are ``size * itemsize``); the TPU tiles the two minor dimensions (an f32
# ``[..., 2, 8]`` takes a whole ``8 x 128`` tile), and its temporaries hold buffers of its own.
# So a fixed byte count is asserted on the CPU only; on every backend, temp bytes are compared
# between programs compiled on it (what grows with the depth, what one program has more of).

_HLO_TYPES = {"bool": "pred", "int8": "s8", "uint8": "u8", "int16": "s16", "uint16": "u16",
              "int32": "s32", "uint32": "u32", "int64": "s64", "uint64": "u64",
              "float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}


def on_cpu() -> bool:
    """Whether the tests run on XLA:CPU, whose byte counts are the arrays' own (see above)."""
    import jax

    return jax.default_backend() == "cpu"


def hlo_shape(a) -> str:
    """``a``'s shape as XLA prints it, e.g. ``f32[24,2,64,2,8]``."""
    import numpy as np

    return f"{_HLO_TYPES[np.dtype(a.dtype).name]}[{','.join(map(str, a.shape))}]"


def nbytes(leaves) -> int:
    """The logical bytes of ``leaves`` (arrays or ``jax.ShapeDtypeStruct``s): unpadded."""
    import numpy as np

    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in leaves)


def aliased_inputs(compiled) -> list[str]:
    """The shapes of the parameters whose buffers the outputs of ``compiled`` reuse (its
    ``input_output_alias``), sorted: read from the compiled module's text, on any backend."""
    header = compiled.as_text().split("\n", 1)[0]
    numbers = re.findall(r"\{[\d,]*\}: \((\d+), \{[\d,]*\}, (?:may|must)-alias\)", header)
    layout = re.search(r"entry_computation_layout=\{\((.*?)\)->", header)
    params = re.findall(r"(\w+)\[([\d,]*)\]", re.sub(r"/\*.*?\*/", "", layout.group(1)))
    return sorted(f"{t}[{dims}]" for t, dims in (params[int(i)] for i in numbers))


def assert_aliases_exactly(compiled, leaves) -> None:
    """Every buffer of ``leaves`` (the donated cache) is an output's, and nothing else is."""
    assert aliased_inputs(compiled) == sorted(hlo_shape(a) for a in leaves)


def assert_no_copy_per_layer(shallow, deep, leaves_shallow, leaves_deep) -> None:
    """The compiled decode steps of two depths: the deeper one's temporaries grow by less than
    half of what its donated cache grows. A copy of the cache (or of each layer's) costs its
    bytes: at least its logical ones, and a backend's padded ones where it pads (those count in
    ``alias_size_in_bytes``, the donated buffers' bytes on that backend)."""
    a, b = shallow.memory_analysis(), deep.memory_analysis()
    logical = nbytes(leaves_deep) - nbytes(leaves_shallow)
    grown = max(logical, b.alias_size_in_bytes - a.alias_size_in_bytes)
    assert logical > 0 and b.temp_size_in_bytes - a.temp_size_in_bytes < grown / 2, (a, b)


def temp_bytes(compiled) -> int:
    """The temp bytes of a compiled program, as its backend counts them (compare them only
    with another program's on the same backend, or on the CPU: see above)."""
    return compiled.memory_analysis().temp_size_in_bytes
