"""Checkpoints on 8 simulated devices: a per-layer safetensors (and a loop-layout orbax)
checkpoint loaded into FSDP and tensor-parallel shardings equals the unsharded load, each
device's shard read from its own bytes only (counted), whether a leaf's shards are filled
together (CPU) or one at a time (as on accelerators), and taken by the device as the host
array filled, without a copy; orbax's CheckpointManager restores stacked params and
optimizer state onto another mesh than they were saved from; sharded params saved as
per-layer safetensors and as a loop-layout orbax checkpoint (stackwise.save_orbax), bitwise; a
mesh that does not divide a leaf is refused, naming it; the two threads that fill a leaf's
shards go through its layers in step, and an error in one (or a file cut short under the
map) is raised without leaving the other waiting.

Runs in a subprocess with 8 simulated CPU devices (see ``_CASES``).
"""

from __future__ import annotations

import os
import re
import tempfile

import numpy as np
import pytest
from _multidevice import result, run_cases, run_module

N, E, F = 4, 16, 8  # layers, model width, hidden width


def _setup():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from safetensors.numpy import save_file

    import stackwise

    rng = np.random.default_rng(0)
    arrays = {f"model.layers.{i}.mlp.up_proj.weight": rng.normal(size=(F, E)).astype(np.float32)
              for i in range(N)}  # torch's (out, in)
    arrays |= {f"model.layers.{i}.input_layernorm.weight": rng.normal(size=E).astype(np.float32)
               for i in range(N)}
    arrays["model.embed_tokens.weight"] = rng.normal(size=(32, E)).astype(np.float32)
    folder = tempfile.mkdtemp()
    save_file(arrays, os.path.join(folder, "model.safetensors"))
    target = {"blocks": {"up": jax.ShapeDtypeStruct((N, E, F), jnp.float32),
                         "norm": jax.ShapeDtypeStruct((N, E), jnp.float32)},
              "embed": jax.ShapeDtypeStruct((32, E), jnp.float32)}
    names = {"blocks": {"up": stackwise.Tensor("model.layers.{}.mlp.up_proj.weight",
                                               transpose=(1, 0)),
                        "norm": "model.layers.{}.input_layernorm.weight"},
             "embed": "model.embed_tokens.weight"}
    return jax, jnp, NamedSharding, P, stackwise, folder, arrays, target, names


class _Counted:
    """Wraps a Checkpoint: every read's tensor name and bytes."""

    def __init__(self, stackwise, folder):
        ckpt = stackwise.open_checkpoint(folder)
        self.reads = []

        def read(name, index):
            out = ckpt.read(name, index)
            self.reads.append((name, out.nbytes))
            return out

        self.ckpt = stackwise.Checkpoint(ckpt.kind, ckpt.where, ckpt.tensors, {}, read)


def _shardings_case(mesh_shape, axes, base, together=True):
    from stackwise._checkpoint import load

    jax, jnp, NamedSharding, P, stackwise, folder, arrays, target, names = _setup()
    mesh = jax.make_mesh(mesh_shape, axes)
    specs = stackwise.fsdp_specs(target["blocks"], mesh, "data", base=base(P))
    shardings = {"blocks": stackwise.stacked_shardings(mesh, specs),
                 "embed": NamedSharding(mesh, P(None, "data"))}
    unsharded = stackwise.load_checkpoint(folder, target, names)
    counted = _Counted(stackwise, folder)
    # The host arrays the loader fills (to find them in the devices' buffers), and with
    # together=False the shards built one at a time, as on accelerators.
    made, host, zero_copy = [], load._host, load._zero_copy
    load._host = lambda shape, dtype: made.append(host(shape, dtype)) or made[-1]
    if not together:
        load._zero_copy = lambda devices: False
    try:
        sharded = stackwise.load_checkpoint(counted.ckpt, target, names, shardings=shardings)
    finally:
        load._host, load._zero_copy = host, zero_copy
    # Each distinct shard is on one of its devices as the host array filled, not a copy.
    filled, aliased = {a.ctypes.data for a in made}, {}
    for i, a in enumerate(jax.tree.leaves(sharded)):
        for s in a.addressable_shards:
            key = (i, str(s.index))
            aliased[key] = aliased.get(key, False) or s.data.unsafe_buffer_pointer() in filled
    equal = all(bool((np.asarray(a) == np.asarray(b)).all())
                for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(unsharded)))
    # Bytes read = the bytes of the distinct shards built (a replica is read once).
    shard_bytes = sum({(i, str(s.index)): s.data.nbytes
                       for i, a in enumerate(jax.tree.leaves(sharded))
                       for s in a.addressable_shards}.values())
    read_bytes = sum(b for _, b in counted.reads)
    whole = sum(a.nbytes for a in arrays.values())
    specs_out = {jax.tree_util.keystr(p): str(a.sharding.spec)
                 for p, a in jax.tree_util.tree_leaves_with_path(sharded)}
    return {"equal": equal, "read": read_bytes, "shards": shard_bytes, "whole": whole,
            "largest_up_read": max(b for n, b in counted.reads if "up_proj" in n),
            "specs": specs_out, "aliased": list(aliased.values())}


def _case_fsdp():
    return _shardings_case((8,), ("data",), lambda P: None)


def _case_fsdp_one_shard_at_a_time():
    return _shardings_case((8,), ("data",), lambda P: None, together=False)


def _case_tensor_parallel():
    # FSDP over "data" on top of tensor parallel over "model": the up projection's output
    # (the torch weight's first axis, the JAX leaf's last) split over "model".
    return _shardings_case((4, 2), ("data", "model"), lambda P: {"up": P(None, "model"),
                                                                 "norm": None})


def _case_mesh_does_not_divide():
    jax, jnp, NamedSharding, P, stackwise, folder, arrays, target, names = _setup()
    mesh = jax.make_mesh((8,), ("data",))
    shardings = {"blocks": {"up": NamedSharding(mesh, P("data")), "norm": None},
                 "embed": None}
    try:
        stackwise.load_checkpoint(folder, target, names, shardings=shardings)
    except ValueError as e:
        return {"message": str(e)}
    return {"message": ""}


def _case_orbax_loop_layout_and_manager():
    import optax
    import orbax.checkpoint as ocp

    jax, jnp, NamedSharding, P, stackwise, folder, arrays, target, names = _setup()
    # A loop model's orbax checkpoint: one tree per layer, as the loop keeps them.
    loop = {"layers": {str(i): {"up": arrays[f"model.layers.{i}.mlp.up_proj.weight"].T.copy(),
                                "norm": arrays[f"model.layers.{i}.input_layernorm.weight"]}
                       for i in range(N)},
            "embed": arrays["model.embed_tokens.weight"]}
    path = os.path.join(tempfile.mkdtemp(), "loop")
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, loop)
    checkpointer.wait_until_finished()
    mesh = jax.make_mesh((8,), ("data",))
    fsdp = {"blocks": stackwise.stacked_shardings(
        mesh, stackwise.fsdp_specs(target["blocks"], mesh, "data")),
        "embed": NamedSharding(mesh, P("data"))}
    loop_names = {"blocks": {"up": "layers.{}.up", "norm": "layers.{}.norm"}, "embed": "embed"}
    counted = _Counted(stackwise, path)
    params = stackwise.load_checkpoint(counted.ckpt, target, loop_names, shardings=fsdp)
    want = stackwise.load_checkpoint(folder, target, names)
    loop_equal = all(bool((np.asarray(a) == np.asarray(b)).all())
                     for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want)))
    loop_read = sum(b for _, b in counted.reads)
    # Stacked params and optimizer state, saved FSDP over 8 devices, restored onto a 2 x 4
    # mesh with tensor parallel over "model".
    opt = optax.adam(1e-3)
    state = {"params": params, "opt": opt.init(params), "step": jnp.int32(7)}
    manager = ocp.CheckpointManager(tempfile.mkdtemp(),
                                    options=ocp.CheckpointManagerOptions(max_to_keep=2))
    for step in (1, 2, 3):
        manager.save(step, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
    other = jax.make_mesh((2, 4), ("data", "model"))
    def onto(a):
        spec = P(*([None] * (a.ndim - 1)), "model") if a.ndim and a.shape[-1] % 4 == 0 else P()
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(other, spec))
    restored = manager.restore(manager.latest_step(),
                               args=ocp.args.StandardRestore(jax.tree.map(onto, state)))
    same = all(bool((np.asarray(a) == np.asarray(b)).all())
               for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)))
    moved = {str(a.sharding.spec) for a in jax.tree.leaves(restored["params"])}
    return {"loop_equal": loop_equal, "loop_read": loop_read,
            "whole": sum(a.nbytes for a in arrays.values()), "steps": list(manager.all_steps()),
            "restored_equal": same, "restored_specs": sorted(moved),
            "restored_mesh": str(dict(jax.tree.leaves(restored)[0].sharding.mesh.shape))}


def _case_save_sharded():
    jax, jnp, NamedSharding, P, stackwise, folder, arrays, target, names = _setup()
    mesh = jax.make_mesh((8,), ("data",))
    fsdp = {"blocks": stackwise.stacked_shardings(
        mesh, stackwise.fsdp_specs(target["blocks"], mesh, "data")),
        "embed": NamedSharding(mesh, P("data"))}
    params = stackwise.load_checkpoint(folder, target, names, shardings=fsdp)
    out = tempfile.mkdtemp()
    written = stackwise.save_safetensors(params, names, out, max_file_bytes=E * F * 4 * 2)
    back = stackwise.open_checkpoint(out)
    same = sorted(back.tensors) == sorted(arrays) and all(
        bool((back.read(n) == a).all()) for n, a in arrays.items())
    # The same params to an orbax checkpoint in the loop's layout, two layers at a time, and
    # back onto the mesh, bitwise.
    path = stackwise.save_orbax(params, names, os.path.join(tempfile.mkdtemp(), "loop"),
                                max_group_bytes=2 * (E * F + E) * 4)
    loop = stackwise.open_checkpoint(path)
    loop_same = sorted(loop.tensors) == sorted(arrays) and all(
        bool((loop.read(n) == a).all()) for n, a in arrays.items())
    again = stackwise.load_checkpoint(path, target, names, shardings=fsdp)
    again_same = all(bool((np.asarray(a) == np.asarray(b)).all()) and a.sharding == b.sharding
                     for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params)))
    return {"files": len(written), "bitwise": same, "orbax_bitwise": loop_same,
            "orbax_back_bitwise": again_same}


def _case_threads():
    """The shards filled by two threads, each going through the layers on its own (what
    large leaves get; `_PARALLEL_BYTES = 0` gives it to these small ones): the same arrays,
    every layer's pages let go of once and after its last read, no thread more than
    `_AHEAD` layers ahead of the slowest; and a read that fails in one thread raises,
    without leaving the other waiting."""
    import threading
    import time

    from safetensors.numpy import save_file

    from stackwise._checkpoint import load

    jax, jnp, NamedSharding, P, stackwise, _, _, _, _ = _setup()
    layers = 12
    rng = np.random.default_rng(1)
    arrays = {f"l.{i}.w": rng.normal(size=(F, E)).astype(np.float32) for i in range(layers)}
    arrays |= {f"l.{i}.b": rng.normal(size=E).astype(np.float32) for i in range(layers)}
    path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    save_file(arrays, path)
    target = {"w": jax.ShapeDtypeStruct((layers, E, F), jnp.float32),
              "b": jax.ShapeDtypeStruct((layers, E), jnp.float32)}
    names = {"w": stackwise.Tensor("l.{}.w", transpose=(1, 0)), "b": "l.{}.b"}
    mesh = jax.make_mesh((8,), ("data",))
    shardings = stackwise.stacked_shardings(mesh, stackwise.fsdp_specs(target, mesh, "data"))
    want = stackwise.load_checkpoint(path, target, names)

    ckpt = stackwise.open_checkpoint(path)
    events, lock = [], threading.Lock()
    into, release = ckpt._into, ckpt._release

    def counted_into(name, index, out):
        with lock:
            events.append(("read", name, threading.get_ident()))
        return into(name, index, out)

    def counted_release(name):
        with lock:
            events.append(("release", name, threading.get_ident()))
        release(name)

    ckpt._into, ckpt._release = counted_into, counted_release
    parallel = load._PARALLEL_BYTES
    load._PARALLEL_BYTES = 0
    try:
        got = stackwise.load_checkpoint(ckpt, target, names, shardings=shardings)
        equal = all(bool((np.asarray(got[k]) == np.asarray(want[k])).all()) for k in target)
        # The schedule, per leaf: reads of layer n only once layers n - _AHEAD and before
        # were let go of, and each layer let go of once, after its last read.
        order_ok, threads = True, []  # the threads that read each leaf
        for prefix in ("l.{}.w", "l.{}.b"):
            mine = [e for e in events if e[1] in {prefix.format(i) for i in range(layers)}]
            released, readers = [], set()
            for kind, name, thread in mine:
                n = int(name.split(".")[1])
                if kind == "release":
                    released.append(n)
                    continue
                readers.add(thread)
                order_ok &= n not in released and len(released) >= n - load._AHEAD + 1
            order_ok &= sorted(released) == list(range(layers))
            threads.append(len(readers))
        # One thread's read fails (the first read of layer 3): the load raises that error
        # and returns, the other thread not left waiting for layer 3 to be let go of.
        # Then the file is cut short after opening: the reads from its map (a shard's
        # columns of "w") raise, naming it, rather than fault (SIGBUS).
        outcome, failed = {}, []

        def fail_once(name, index, out):
            with lock:
                first = name == "l.3.w" and not failed
                if first:
                    failed.append(name)
            if first:  # once the other thread has run ahead and waits for layer 3
                time.sleep(0.5)
                raise ValueError("injected read error")
            return into(name, index, out)

        def load(key, checkpoint, leaves):
            try:
                stackwise.load_checkpoint(checkpoint, {k: target[k] for k in leaves},
                                          {k: names[k] for k in leaves},
                                          shardings={k: shardings[k] for k in leaves})
                outcome[key] = ""
            except ValueError as e:
                outcome[key] = str(e)

        ckpt._into, ckpt._release = fail_once, release
        cut = stackwise.open_checkpoint(path)
        workers = [threading.Thread(target=load, args=("one", ckpt, "bw"), daemon=True)]
        workers[0].start()
        workers[0].join(timeout=120)
        with open(path, "r+b") as fh:
            fh.truncate(os.path.getsize(path) // 2)
        workers.append(threading.Thread(target=load, args=("cut", cut, "w"), daemon=True))
        workers[1].start()
        workers[1].join(timeout=120)
    finally:
        load._PARALLEL_BYTES = parallel
    return {"equal": equal, "order_ok": bool(order_ok), "threads": threads,
            "returned": [not w.is_alive() for w in workers],
            "one": outcome.get("one"), "cut": outcome.get("cut")}


def _case_layouts_in_pieces():
    """Each layer filled in pieces of 64 bytes by two threads (what large layers get), into
    FSDP over 8, tensor parallel over the leaves' last axis, and the layer axis over 4
    stages (one shard holds each layer, split for both threads): bitwise the unsharded load."""
    from stackwise._checkpoint import load

    jax, jnp, NamedSharding, P, stackwise, folder, arrays, target, names = _setup()
    want = stackwise.load_checkpoint(folder, target, names)
    fsdp = jax.make_mesh((8,), ("data",))
    grid = jax.make_mesh((4, 2), ("stage", "model"))
    layouts = {
        "fsdp": stackwise.stacked_shardings(fsdp, stackwise.fsdp_specs(target, fsdp, "data")),
        "tensor_parallel": jax.tree.map(
            lambda a: NamedSharding(grid, P(*[None] * (a.ndim - 1), "model")), target),
        "stages": {"blocks": NamedSharding(grid, P("stage")), "embed": None},
    }
    saved = load._PIECE_BYTES, load._PARALLEL_BYTES, load._THREADS
    load._PIECE_BYTES, load._PARALLEL_BYTES, load._THREADS = 64, 0, 2
    try:
        out = {}
        for name, shardings in layouts.items():
            got = stackwise.load_checkpoint(folder, target, names, shardings=shardings)
            out[name] = all(bool((np.asarray(a) == np.asarray(b)).all())
                            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
            out[name + "_specs"] = str(got["blocks"]["up"].sharding.spec)
    finally:
        load._PIECE_BYTES, load._PARALLEL_BYTES, load._THREADS = saved
    return out


_CASES = {
    "fsdp": _case_fsdp,
    "fsdp_one_shard_at_a_time": _case_fsdp_one_shard_at_a_time,
    "tensor_parallel": _case_tensor_parallel,
    "mesh_does_not_divide": _case_mesh_does_not_divide,
    "orbax": _case_orbax_loop_layout_and_manager,
    "save_sharded": _case_save_sharded,
    "threads": _case_threads,
    "layouts_in_pieces": _case_layouts_in_pieces,
}


@pytest.fixture(scope="module")
def multi_device():
    pytest.importorskip("safetensors")
    pytest.importorskip("orbax.checkpoint")
    return run_module(__file__)


@pytest.mark.parametrize("case", ["fsdp", "tensor_parallel", "fsdp_one_shard_at_a_time"])
def test_each_device_reads_only_its_shard(multi_device, case):
    r = result(multi_device, case)
    assert r["equal"]
    assert r["read"] == r["shards"]  # not a byte more than the shards hold
    assert r["read"] == r["whole"]  # each byte of the checkpoint read once
    # One read per layer and device, of that device's slice of the layer alone.
    assert r["largest_up_read"] == E * F * 4 // 8


@pytest.mark.parametrize("case", ["fsdp", "tensor_parallel", "fsdp_one_shard_at_a_time"])
def test_cpu_devices_take_the_filled_host_arrays_without_a_copy(multi_device, case):
    # What keeps a CPU load's host memory at the final arrays while a leaf's shards are
    # filled together: jax's CPU client takes each aligned host array as the device buffer.
    aliased = result(multi_device, case)["aliased"]
    assert aliased and all(aliased)


def test_fsdp_and_tensor_parallel_specs(multi_device):
    assert result(multi_device, "fsdp")["specs"]["['blocks']['up']"] == "P(None, 'data')"
    tp = result(multi_device, "tensor_parallel")["specs"]["['blocks']['up']"]
    assert tp == "P(None, 'data', 'model')"


def test_a_mesh_that_does_not_divide_is_refused(multi_device):
    message = result(multi_device, "mesh_does_not_divide")["message"]
    assert "leaf ['blocks']['up']" in message and "axis 0 (length 4)" in message
    assert "size 8" in message and "fsdp_specs" in message


def test_orbax_loop_layout_and_manager_onto_another_mesh(multi_device):
    r = result(multi_device, "orbax")
    assert r["loop_equal"] and r["loop_read"] == r["whole"]  # FSDP: each byte read once
    assert r["steps"] == [2, 3]  # max_to_keep=2
    assert r["restored_equal"]
    assert r["restored_mesh"] == "{'data': 2, 'model': 4}"
    assert "P(None, None, 'model')" in r["restored_specs"]


def test_save_from_sharded_params_is_bitwise(multi_device):
    r = result(multi_device, "save_sharded")
    assert r["bitwise"] and r["files"] > 2
    assert r["orbax_bitwise"] and r["orbax_back_bitwise"]


def test_two_threads_fill_layer_by_layer_and_an_error_in_one_returns(multi_device):
    r = result(multi_device, "threads")
    assert r["equal"] and r["threads"] == [2, 2]  # each leaf
    assert r["order_ok"]  # no read after its layer's release, none too far ahead
    assert r["returned"] == [True, True]  # not left waiting for a layer that never came
    assert r["one"] == "injected read error"
    assert re.search(r"model.safetensors ends inside tensor 'l\.\d+\.w'", r["cut"])


def test_layouts_filled_in_pieces_equal_the_unsharded_load(multi_device):
    r = result(multi_device, "layouts_in_pieces")
    assert r["fsdp"] and r["tensor_parallel"] and r["stages"]
    assert r["stages_specs"] == "P('stage',)"
    assert r["tensor_parallel_specs"] == "P(None, None, 'model')"


if __name__ == "__main__":
    run_cases(_CASES)
