"""Quantizing while loading onto 8 simulated devices: the codes take the float leaf's
sharding and the scales its spec where it divides them (the input axis of per-channel
scales, of length 1, left whole), bitwise as quantizing the sharded float load; FSDP and
tensor parallel; a mesh that divides the float leaf but not its packed 4-bit codes, and a
sharding that is neither named, one device nor replicated, are refused before a byte is read.

Runs in a subprocess with 8 simulated CPU devices (see ``_CASES``).
"""

from __future__ import annotations

import numpy as np
import pytest
from _multidevice import result, run_cases, run_module

N, E, F = 4, 16, 8  # layers, model width, hidden width


def _setup():
    import jax
    import jax.numpy as jnp

    import stackwise

    rng = np.random.default_rng(0)
    arrays = {f"model.layers.{i}.mlp.up_proj.weight": rng.normal(size=(F, E)).astype(np.float32)
              for i in range(N)}
    arrays |= {f"model.layers.{i}.mlp.down_proj.weight":
               rng.normal(size=(E, F)).astype(np.float32) for i in range(N)}
    target = {"up": jax.ShapeDtypeStruct((N, E, F), jnp.float32),
              "down": jax.ShapeDtypeStruct((N, F, E), jnp.float32)}
    names = {"up": stackwise.Tensor("model.layers.{}.mlp.up_proj.weight", transpose=(1, 0)),
             "down": stackwise.Tensor("model.layers.{}.mlp.down_proj.weight",
                                      transpose=(1, 0))}
    return jax, stackwise, arrays, target, names


def _layout_case(mesh_shape, axes, specs, kind, block, double=False):
    jax, stackwise, arrays, target, names = _setup()
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh(mesh_shape, axes)
    shardings = {k: NamedSharding(mesh, P(*spec)) for k, spec in specs.items()}
    scheme = stackwise.quant.Scheme(kind, block_size=block, double=double)
    got = stackwise.load_checkpoint(arrays, target, names, shardings=shardings, quantize=scheme)
    floats = stackwise.load_checkpoint(arrays, target, names, shardings=shardings)
    want = stackwise.quant.quantize(floats, kind, block_size=block, double=double)
    bitwise = all(
        bool((np.asarray(a) == np.asarray(b)).all())
        for k in got for a, b in zip(jax.tree.leaves(got[k]), jax.tree.leaves(want[k])))
    return {"bitwise": bitwise,
            "codes": {k: str(got[k].codes.sharding.spec) for k in got},
            "scale": {k: str(got[k].scale.sharding.spec) for k in got},
            "devices": {k: len(got[k].codes.sharding.device_set) for k in got}}


def _refused(call) -> str:
    try:
        call()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "not refused"


def _misuse_case():
    jax, stackwise, arrays, target, names = _setup()
    from jax._src.sharding_impls import GSPMDSharding
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def unread(name, index):
        raise AssertionError(f"read {name} before refusing")

    ckpt = stackwise.Checkpoint("arrays", "here", stackwise.open_checkpoint(arrays).tensors, {},
                                unread)
    mesh = jax.make_mesh((8,), ("data",))
    split = NamedSharding(mesh, P(None, "data"))  # down: in = F = 8 over 8, packed: 4
    gspmd = GSPMDSharding(split._device_assignment, split._to_xla_hlo_sharding(3))
    return {
        "packed": _refused(lambda: stackwise.load_checkpoint(
            ckpt, target, names, shardings=split, quantize="nf4")),
        "int8_fits": str(stackwise.load_checkpoint(
            arrays, target, names, shardings=split, quantize="int8")["down"].codes.sharding.spec),
        "unnamed": _refused(lambda: stackwise.load_checkpoint(
            ckpt, target, names, shardings=gspmd, quantize="int8")),
    }


_CASES = {
    "fsdp": lambda: _layout_case((8,), ("data",), {"up": (None, "data"), "down": (None, None,
                                                                                  "data")},
                                 "nf4", None),
    "fsdp_blocks": lambda: _layout_case((8,), ("data",), {"up": (None, "data"),
                                                          "down": (None, None, "data")},
                                        "int8", 2),
    "tensor_parallel": lambda: _layout_case((2, 4), ("data", "model"),
                                            {"up": (None, "data", "model"),
                                             "down": ("data", "model")}, "int4", None),
    "tensor_parallel_double": lambda: _layout_case((2, 4), ("data", "model"),
                                                   {"up": (None, "data", "model"),
                                                    "down": ("data", "model")}, "nf4", 2, 8),
    "misuse": _misuse_case,
}


@pytest.fixture(scope="module")
def multi_device():
    return run_module(__file__)


def test_fsdp_codes_sharded_as_the_floats_scales_whole_along_one_block(multi_device):
    r = result(multi_device, "fsdp")
    assert r["bitwise"] and r["devices"] == {"up": 8, "down": 8}
    assert r["codes"] == {"up": "P(None, 'data')", "down": "P(None, None, 'data')"}
    assert r["scale"] == {"up": "P(None, None)", "down": "P(None, None, 'data')"}


def test_fsdp_with_blocks_splits_the_scales_like_the_codes(multi_device):
    r = result(multi_device, "fsdp_blocks")  # up's 16 inputs in 8 blocks: over 8 devices
    assert r["bitwise"]
    assert r["scale"] == {"up": "P(None, 'data')", "down": "P(None, None, 'data')"}


def test_tensor_parallel(multi_device):
    r = result(multi_device, "tensor_parallel")
    assert r["bitwise"]
    assert r["codes"] == {"up": "P(None, 'data', 'model')", "down": "P('data', 'model')"}
    assert r["scale"] == {"up": "P(None, None, 'model')", "down": "P('data', None)"}


def test_tensor_parallel_with_double_quantized_scales(multi_device):
    """The double quantization runs jitted on the placed scales (each layer's mean gathered
    by XLA), bitwise as `quantize(..., double=)` of the sharded float load."""
    r = result(multi_device, "tensor_parallel_double")
    assert r["bitwise"]
    assert r["codes"] == {"up": "P(None, 'data', 'model')", "down": "P('data', 'model')"}


def test_shardings_that_cannot_hold_codes_are_refused(multi_device):
    r = result(multi_device, "misuse")
    assert r["packed"].startswith("ValueError: stackwise.load_checkpoint: leaf ['down']")
    assert "codes of shape (4, 4, 16)" in r["packed"] and "two rows a byte" in r["packed"]
    assert "size 8" in r["packed"] and "Shard another axis" in r["packed"]
    assert r["int8_fits"] == "P(None, 'data')"  # 8 rows unpacked: the same mesh divides them
    assert r["unnamed"].startswith("TypeError: stackwise.load_checkpoint: leaf ['down'] is "
                                   "quantized as it loads")
    assert "NamedSharding(mesh, spec)" in r["unnamed"]


if __name__ == "__main__":
    run_cases(_CASES)
