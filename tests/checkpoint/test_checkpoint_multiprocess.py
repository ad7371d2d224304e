"""Checkpoints on several hosts: 2 JAX processes owning 4 CPU devices each (jax.distributed on
127.0.0.1, gloo collectives; the multi-process example's launcher) load a per-layer safetensors
checkpoint onto a (data=2, model=4) mesh whose "data" axis crosses them, each process reading
only its own devices' bytes (counted), and equal to the load in this one process; they save it
with save_safetensors (process 0 writes; byte for byte the files this process writes) and
save_orbax, which this process loads bitwise, and they load what this process saved. A
checkpoint in the way, or a write that fails on process 0, raises on both processes.

This module is also the processes' script (``__main__``): each writes ``process_<i>.json``
(what it read and what raised) and ``process_<i>.npz`` (what it loaded, gathered whole).
"""

from __future__ import annotations

import json
import os
import pathlib

import _multiprocess
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stackwise

pytestmark = pytest.mark.slow  # 2 processes, each importing JAX, compiling the gathers

N, E, F, V = 4, 8, 16, 12  # layers, width, hidden width, vocabulary
#: The one-process reference saves and the processes' saves: two layers a file.
LAYER_BYTES = (E * F * 2 + E * 4)  # a bfloat16 up projection and a float32 norm
GROUP_BYTES = 2 * LAYER_BYTES
TIMEOUT_S = 240  # both processes, from their start (a loaded 2-core machine: ~3x idle)


def _model():
    """The target (abstract params), the names, and the checkpoint's tensors: torch's
    (out, in) bfloat16 up projections, float32 norms, an embedding and a final norm."""
    rng = np.random.default_rng(0)
    arrays = {f"model.layers.{i}.mlp.up_proj.weight":
              rng.normal(size=(F, E)).astype(jnp.bfloat16) for i in range(N)}
    arrays |= {f"model.layers.{i}.input_layernorm.weight": rng.normal(size=E).astype(np.float32)
               for i in range(N)}
    arrays["model.embed_tokens.weight"] = rng.normal(size=(V, E)).astype(np.float32)
    arrays["model.norm.weight"] = rng.normal(size=E).astype(np.float32)
    target = {"blocks": {"up": jax.ShapeDtypeStruct((N, E, F), jnp.bfloat16),
                         "norm": jax.ShapeDtypeStruct((N, E), jnp.float32)},
              "embed": jax.ShapeDtypeStruct((V, E), jnp.float32),
              "norm": jax.ShapeDtypeStruct((E,), jnp.float32)}
    names = {"blocks": {"up": stackwise.Tensor("model.layers.{}.mlp.up_proj.weight",
                                               transpose=(1, 0)),
                        "norm": "model.layers.{}.input_layernorm.weight"},
             "embed": "model.embed_tokens.weight",
             "norm": "model.norm.weight"}
    return target, names, arrays


# --------------------------------------------------------------------------
# Each process (this module run as a script).


def _raised(call) -> str:
    try:
        call()
    except Exception as e:  # noqa: BLE001 -- reported to the test
        return f"{type(e).__name__}: {e}"
    return ""


def _process(out: pathlib.Path) -> dict:
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    target, names, _ = _model()
    mesh = jax.make_mesh((2, 4), ("data", "model"))  # "data" across the two processes
    shardings = {"blocks": {"up": NamedSharding(mesh, P(None, "data", "model")),
                            "norm": NamedSharding(mesh, P(None, "data"))},
                 "embed": NamedSharding(mesh, P(None, "data")),
                 "norm": NamedSharding(mesh, P())}  # replicated: every process reads it
    ckpt, reads = stackwise.open_checkpoint(out / "source"), []

    def read(name, index):
        x = ckpt.read(name, index)
        reads.append(x.nbytes)
        return x

    counted = stackwise.Checkpoint(ckpt.kind, ckpt.where, ckpt.tensors, {}, read)
    params = stackwise.load_checkpoint(counted, target, names, shardings=shardings)
    read_bytes = sum(reads)
    loaded = {"source": params}
    for name in ("one_safetensors", "one_orbax"):  # what one process saved
        loaded[name] = stackwise.load_checkpoint(out / name, target, names, shardings=shardings)
    # Every process gets every array whole (one program, each replicated on every device).
    whole = jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, P()))(loaded)
    pid = jax.process_index()
    np.savez(out / f"process_{pid}.npz", **{
        jax.tree_util.keystr(path): np.asarray(a.addressable_data(0)).view(np.uint8)
        for path, a in jax.tree_util.tree_leaves_with_path(whole)})
    shards = {(i, str(s.index)): s.data.nbytes
              for i, a in enumerate(jax.tree.leaves(params)) for s in a.addressable_shards}
    # Unsharded (no shardings): on the first device, process 0's; the other has no shard.
    default = stackwise.load_checkpoint(out / "source", {"e": target["embed"]},
                                        {"e": names["embed"]})["e"]
    written = stackwise.save_safetensors(params, names, out / "two_safetensors",
                                         max_file_bytes=GROUP_BYTES)
    orbax = stackwise.save_orbax(params, names, out / "two_orbax", max_group_bytes=GROUP_BYTES)
    # A sharding other than a NamedSharding across the processes (jax's own GSPMDSharding,
    # as jax.jit may give), gathered replicated.
    from jax._src.sharding_impls import GSPMDSharding

    gspmd = jax.device_put(np.arange(6, dtype=np.float32).reshape(2, 3),
                           GSPMDSharding.get_replicated(jax.devices()))
    stackwise.save_safetensors({"g": gspmd}, {"g": "l.{}.g"}, out / "gspmd")
    # A leaf on process 1's devices alone: process 0, the writer, cannot read it.
    theirs = NamedSharding(Mesh(np.array(jax.devices()[4:]), ("d",)), P())
    alone = jax.make_array_from_callback((2, 3), theirs, lambda i: np.ones((2, 3), np.float32)[i],
                                         dtype=np.float32)
    quantized_reads = _quantized(out, counted, reads, target, names, mesh)
    return {
        "quantized_reads": quantized_reads,
        "process": pid,
        "devices": [jax.local_device_count(), jax.device_count()],
        "read_bytes": read_bytes,
        "shard_bytes": sum(shards.values()),
        "default": [len(default.addressable_shards), str(default.dtype), list(default.shape)],
        "written": [os.path.relpath(p, out) for p in written],
        "orbax": os.path.relpath(orbax, out),
        "raised": {
            "again": _raised(lambda: stackwise.save_safetensors(
                params, names, out / "two_safetensors")),
            "again_orbax": _raised(lambda: stackwise.save_orbax(params, names, out / "two_orbax")),
            "into_a_file": _raised(lambda: stackwise.save_safetensors(
                params, names, out / "a_file")),
            "another_process_leaf": _raised(lambda: stackwise.save_safetensors(
                {"w": alone}, {"w": "w"}, out / "never")),
        },
    }


#: Quantizing while loading the up projection (E=8 rows, F=16 columns, N=4 layers), by
#: (kind, block size, spec): per-channel scales need a column's every row, so with the rows
#: across the processes each reads them all; blocks of 4 rows let each read its own rows
#: only, and the layers across the processes each its own layers. On process 0's first
#: device alone (spec None), process 1 reads nothing.
QUANTIZED = {"int8_rows": ("int8", None, (None, "data", "model")),
             "nf4_blocks": ("nf4", 4, (None, "data", "model")),
             "int4_layers": ("int4", None, ("data", None, "model")),
             "int8_one_device": ("int8", None, None)}


def _quantized(out, counted, reads, target, names, mesh) -> dict:
    """Each :data:`QUANTIZED` load's bytes read here (``reads``' new entries); the codes and
    scales, gathered whole, into ``quantized_<i>.npz``."""
    from jax.sharding import NamedSharding, SingleDeviceSharding
    from jax.sharding import PartitionSpec as P

    read, loaded = {}, {}
    for label, (kind, block, spec) in QUANTIZED.items():
        start = len(reads)
        sharding = (SingleDeviceSharding(jax.devices()[0]) if spec is None
                    else NamedSharding(mesh, P(*spec)))
        node = stackwise.load_checkpoint(
            counted, {"up": target["blocks"]["up"]}, {"up": names["blocks"]["up"]},
            shardings={"up": sharding},
            quantize=stackwise.quant.Scheme(kind, block_size=block))["up"]
        read[label] = sum(reads[start:])
        loaded[label] = node if spec is None else jax.jit(  # gathered onto every device
            lambda t: t, out_shardings=NamedSharding(mesh, P()))(node)
    np.savez(out / f"quantized_{jax.process_index()}.npz", **{
        f"{label}.{field}": np.asarray(getattr(node, field).addressable_data(0))
        for label, node in loaded.items() for field in ("codes", "scale")
        if getattr(node, field).addressable_shards})
    return read


def _main() -> None:
    example = _multiprocess.example()
    args = example.parse_args()
    example.join(args.process_id, args.num_processes, args.coordinator)
    view = _process(args.out)
    (args.out / f"process_{jax.process_index()}.json").write_text(json.dumps(view))


# --------------------------------------------------------------------------
# The tests (this process: one JAX process, one device).


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """This process's load and saves, the two processes' views and loads, and what this
    process loads of their saves."""
    pytest.importorskip("safetensors")
    pytest.importorskip("orbax.checkpoint")
    from safetensors.numpy import save_file

    out = tmp_path_factory.mktemp("checkpoint_multiprocess")
    target, names, arrays = _model()
    (out / "source").mkdir()
    ordered = sorted(arrays)
    files = {"model-00001-of-00002.safetensors": ordered[::2],
             "model-00002-of-00002.safetensors": ordered[1::2]}
    for file, part in files.items():
        save_file({n: arrays[n] for n in part}, out / "source" / file)
    (out / "source" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: file for file, part in files.items() for n in part}}))
    (out / "a_file").write_text("not a folder")
    one = stackwise.load_checkpoint(out / "source", target, names)
    one_written = stackwise.save_safetensors(one, names, out / "one_safetensors",
                                             max_file_bytes=GROUP_BYTES)
    stackwise.save_orbax(one, names, out / "one_orbax", max_group_bytes=GROUP_BYTES)
    processes = _multiprocess.example().Processes(2, out, _multiprocess.env(), script=__file__)
    try:
        views = processes.wait(TIMEOUT_S)
    finally:
        processes.kill()
    return {
        "out": out, "one": one, "arrays": arrays, "one_written": one_written, "views": views,
        "loaded": [dict(np.load(out / f"process_{i}.npz")) for i in range(2)],
        "quantized": [dict(np.load(out / f"quantized_{i}.npz")) for i in range(2)],
        "two_safetensors": stackwise.load_checkpoint(out / "two_safetensors", target, names),
        "two_orbax": stackwise.load_checkpoint(out / "two_orbax", target, names),
        "paths": [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(one)],
    }


def test_each_process_loads_what_one_process_loads_bitwise(run):
    one = [np.asarray(a).view(np.uint8) for a in jax.tree.leaves(run["one"])]
    for view, loaded in zip(run["views"], run["loaded"]):
        assert view["devices"] == [4, 8]
        for source in ("source", "one_safetensors", "one_orbax"):  # what one process saved too
            got = [loaded[f"['{source}']{p}"] for p in run["paths"]]
            assert all(np.array_equal(a, b) for a, b in zip(got, one)), (view["process"], source)


def test_each_process_reads_only_its_devices_shards(run):
    whole = sum(a.nbytes for a in run["arrays"].values())
    replicated = run["arrays"]["model.norm.weight"].nbytes  # P(): every process reads it
    views = run["views"]
    for view in views:
        assert view["read_bytes"] == view["shard_bytes"]  # a replica on 4 devices read once
        assert view["read_bytes"] == (whole - replicated) // 2 + replicated
    assert sum(v["read_bytes"] for v in views) == whole + replicated


def test_quantizing_while_loading_reads_only_what_the_processs_shards_are_made_of(run):
    up = run["one"]["blocks"]["up"]  # bfloat16 (N, E, F), loaded whole in this process
    whole = up.nbytes
    expected = {"int8_rows": [whole, whole],  # each column's scale needs its every row
                "nf4_blocks": [whole // 2, whole // 2],  # each its own blocks of rows
                "int4_layers": [whole // 2, whole // 2],  # each its own layers
                "int8_one_device": [whole, 0]}  # process 0's device alone
    for label, (kind, block, _) in QUANTIZED.items():
        want = stackwise.quant.quantize({"up": up}, kind, block_size=block)["up"]
        assert [v["quantized_reads"][label] for v in run["views"]] == expected[label], label
        holders = run["quantized"][:1] if label == "int8_one_device" else run["quantized"]
        assert "int8_one_device.codes" not in run["quantized"][1]  # no shard on process 1
        for loaded in holders:  # the same bits as quantizing the one-process load
            for field in ("codes", "scale"):
                got, ref = loaded[f"{label}.{field}"], np.asarray(getattr(want, field))
                assert got.dtype == ref.dtype and np.array_equal(got, ref), (label, field)


def test_unsharded_leaves_are_on_process_0s_first_device(run):
    assert [v["default"] for v in run["views"]] == [[1, "float32", [V, E]],
                                                    [0, "float32", [V, E]]]


def test_saved_from_two_processes_is_what_one_process_saves(run):
    out = run["out"]
    written = [os.path.relpath(p, out / "one_safetensors") for p in run["one_written"]]
    assert len(written) == 4  # the embedding and final norm, 2 x 2 layers, the index
    for view in run["views"]:
        assert view["written"] == [f"two_safetensors/{f}" for f in written]
        assert view["orbax"] == "two_orbax/state"
    for f in written:  # byte for byte
        assert (out / "two_safetensors" / f).read_bytes() == (out / "one_safetensors" / f
                                                              ).read_bytes(), f
    assert sorted(os.listdir(out / "two_safetensors")) == sorted(written)  # nothing staged
    for saved in ("two_safetensors", "two_orbax"):  # loaded in one process: bitwise
        for a, b in zip(jax.tree.leaves(run[saved]), jax.tree.leaves(run["one"])):
            assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert not any(p.name.startswith("two_orbax.") for p in out.iterdir())
    gspmd = stackwise.open_checkpoint(out / "gspmd")
    assert [gspmd.read(f"l.{i}.g").tolist() for i in range(2)] == [[0, 1, 2], [3, 4, 5]]


def test_process_0s_refusals_and_failures_raise_on_every_process(run):
    first, second = (v["raised"] for v in run["views"])
    assert first["again"].startswith("FileExistsError: stackwise.save_safetensors: ")
    assert "model-00001-of-00003.safetensors" in first["again"]
    assert second["again"].startswith("FileExistsError: ")
    assert "(as process 0 sees it)" in second["again"] and "overwrite=True" in second["again"]
    for raised in (first, second):
        assert raised["again_orbax"].startswith("FileExistsError: stackwise.save_orbax: ")
    # A file where the folder should be: process 0's finding, the same error on each.
    for raised in (first, second):
        assert raised["into_a_file"].startswith("FileExistsError: stackwise.save_safetensors: ")
        assert "a_file is a file, not a folder" in raised["into_a_file"]
    assert first["another_process_leaf"].startswith(
        "ValueError: stackwise.save_safetensors: leaf ['w'] is on the devices of "
        "process(es) [1] alone")
    assert second["another_process_leaf"].startswith("RuntimeError: ")
    assert not (run["out"] / "never").exists()


if __name__ == "__main__":
    _main()
