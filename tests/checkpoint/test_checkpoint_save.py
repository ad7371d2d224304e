"""Saves are all or nothing, and claimed (stackwise._checkpoint.staging).

A failure injected at every file written and at every rename, in a new folder, over an old
checkpoint (overwrite=True) and beside other files: nothing is left behind (no staging
folder, no claim, no ``*.tmp``) and the old checkpoint is as it was, byte for byte. Two
writers into one folder, threads and processes: one succeeds, the other raises naming the
first, and the folder holds the first's model, bitwise. Stale and foreign claims. The
files' metadata (what transformers reads), and torch's reader where torch is installed.
Zero-padded layer numbers and an inferred reshape axis, in both directions."""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _trees import assert_trees_bitwise

import stackwise
from stackwise import Tensor

pytest.importorskip("safetensors")
save = importlib.import_module("stackwise._checkpoint.save")
staging = importlib.import_module("stackwise._checkpoint.staging")

NAMES = {"embed": "embed", "w": Tensor("l.{}.w", transpose=(1, 0)), "b": "l.{}.b"}
LAYER = 4 * 2 * 4 + 2 * 4  # one layer's bytes: files of one layer each, and the others'


def _params(scale=1.0):
    return {"embed": jnp.arange(10.0).reshape(5, 2) * scale,
            "w": jnp.arange(24.0).reshape(3, 4, 2) * scale,
            "b": jnp.arange(6.0).reshape(3, 2) * scale}


def _snapshot(root):
    """Every file under ``root`` (its bytes) and every folder: what a failed save must leave."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(folder, d), root) + "/"] = None
        for f in files:
            path = os.path.join(folder, f)
            with open(path, "rb") as handle:
                out[os.path.relpath(path, root)] = handle.read()
    return out


def _fail_at(monkeypatch, module, attr, k, before=None):
    """``module.attr`` raises OSError at its k-th call (``before(*args)`` run first, as a
    write cut short would leave part of a file), and works at the others."""
    real, calls = getattr(module, attr), [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == k:
            if before is not None:
                before(*args)
            raise OSError(f"injected failure at call {k} of {attr}")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, attr, failing)
    return calls


def _part_written(write, value, path, **kwargs):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"half a file")


def _scenario(root, kind):
    """The target folder of a save: new, an old checkpoint to overwrite, or a folder with a
    model's other files (config.json) and no checkpoint."""
    target = root / "out"
    if kind == "overwrite":
        stackwise.save_safetensors(_params(-1.0), NAMES, target)  # one file
    elif kind == "beside":
        target.mkdir()
        (target / "config.json").write_text('{"model_type": "llama"}')
    return target


@pytest.mark.every_case
@pytest.mark.parametrize("kind", ["new", "overwrite", "beside"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])  # 4 files (the others', 3 layers), the index
def test_a_failed_file_leaves_nothing_and_the_old_checkpoint(tmp_path, monkeypatch, kind, k):
    target = _scenario(tmp_path, kind)
    before = _snapshot(tmp_path)
    calls = _fail_at(monkeypatch, save, "_stage", k, before=_part_written)
    with pytest.raises(OSError, match=f"injected failure at call {k}"):
        stackwise.save_safetensors(_params(2.0), NAMES, target, max_file_bytes=LAYER,
                                   overwrite=True)
    assert calls[0] == k  # it stopped there
    assert _snapshot(tmp_path) == before
    monkeypatch.undo()  # and the next save goes through, in one piece
    written = stackwise.save_safetensors(_params(2.0), NAMES, target, max_file_bytes=LAYER,
                                         overwrite=True)
    assert len(written) == 5
    assert_trees_bitwise(stackwise.load_checkpoint(target, _params(), NAMES), _params(2.0))
    assert sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.every_case
@pytest.mark.parametrize("kind, moves", [("new", 1), ("overwrite", 1 + 5), ("beside", 5)])
def test_a_failed_rename_puts_everything_back(tmp_path, monkeypatch, kind, moves):
    target = _scenario(tmp_path, kind)
    before = _snapshot(tmp_path)
    for k in range(1, moves + 1):
        calls = _fail_at(monkeypatch, staging, "_move", k)
        with pytest.raises(OSError, match=f"injected failure at call {k}"):
            stackwise.save_safetensors(_params(2.0), NAMES, target, max_file_bytes=LAYER,
                                       overwrite=True)
        monkeypatch.undo()
        assert calls[0] >= k and _snapshot(tmp_path) == before, k
    assert calls[0] == 2 * moves - 1  # the last move failed: every other one undone


def test_an_existing_folders_other_files_are_kept(tmp_path):
    target = _scenario(tmp_path, "beside")
    stackwise.save_safetensors(_params(), NAMES, target, max_file_bytes=LAYER)
    stackwise.save_safetensors(_params(3.0), NAMES, target, overwrite=True)  # 5 files -> 1
    assert sorted(os.listdir(target)) == ["config.json", "model.safetensors"]
    assert (target / "config.json").read_text() == '{"model_type": "llama"}'
    assert_trees_bitwise(stackwise.load_checkpoint(target, _params(), NAMES), _params(3.0))


# --------------------------------------------------------------------------
# orbax


@pytest.fixture
def partial():
    pytest.importorskip("orbax.checkpoint")
    return importlib.import_module("orbax.checkpoint.experimental.v1.partial")


ORBAX_NAMES = {"embed": "embed", "w": Tensor("l_{}.w", transpose=(1, 0)), "b": "l_{}.b"}


@pytest.mark.parametrize("where, k, overwrite", [
    ("save", 2, True), ("save", 1, False), ("save", 4, True), ("finalize", 1, False),
    ("move", 1, False), ("move", 1, True), ("move", 2, True)])  # 4 groups; 1 or 2 renames
def test_a_failed_orbax_save_leaves_nothing(tmp_path, monkeypatch, partial, where, k,
                                            overwrite):
    target = tmp_path / "loop"
    if overwrite:
        stackwise.save_orbax(_params(-1.0), ORBAX_NAMES, target)
    before = _snapshot(tmp_path)
    module, attr = {"save": (partial, "save"), "finalize": (partial, "finalize"),
                    "move": (staging, "_move")}[where]
    real = getattr(module, attr)
    # orbax's own write done, then the failure: its partial save is left to clean up.
    _fail_at(monkeypatch, module, attr, k, before=real if where == "save" else None)
    with pytest.raises(OSError, match="injected failure"):
        stackwise.save_orbax(_params(2.0), ORBAX_NAMES, target, max_group_bytes=LAYER,
                             overwrite=overwrite)
    assert _snapshot(tmp_path) == before
    assert not [p for p in os.listdir(tmp_path) if "stackwise" in p or "partial" in p]
    if overwrite:  # the old checkpoint, loaded as it was
        got = stackwise.load_checkpoint(target, _params(), ORBAX_NAMES)
        assert_trees_bitwise(got, _params(-1.0))


# --------------------------------------------------------------------------
# Claims: one writer per folder.


def _blocking_stage(monkeypatch, entered, go):
    """``_stage`` waits for ``go`` in any thread but the main one (after saying so)."""
    real, main = save._stage, threading.current_thread()

    def blocking(*args, **kwargs):
        if threading.current_thread() is not main:
            entered.set()
            assert go.wait(timeout=120)
        return real(*args, **kwargs)

    monkeypatch.setattr(save, "_stage", blocking)


@pytest.mark.parametrize("saver", ["safetensors", "orbax"])
def test_two_writers_into_one_folder_one_wins_the_other_names_it(tmp_path, monkeypatch, saver):
    if saver == "orbax":
        pytest.importorskip("orbax.checkpoint")
    entered, go, outcome = threading.Event(), threading.Event(), {}
    names = NAMES if saver == "safetensors" else ORBAX_NAMES
    if saver == "safetensors":
        _blocking_stage(monkeypatch, entered, go)
        call = lambda p: stackwise.save_safetensors(p, names, tmp_path / "out")  # noqa: E731
    else:
        real, main = staging.Stage.replace_whole, threading.current_thread()

        def blocking(self):
            if threading.current_thread() is not main:
                entered.set()
                assert go.wait(timeout=120)
            return real(self)

        monkeypatch.setattr(staging.Stage, "replace_whole", blocking)
        call = lambda p: stackwise.save_orbax(p, names, tmp_path / "out")  # noqa: E731

    def first():
        try:
            outcome["first"] = call(_params(1.0))
        except BaseException as e:  # noqa: BLE001 -- reported below
            outcome["first"] = e

    thread = threading.Thread(target=first)
    thread.start()
    assert entered.wait(timeout=120)
    try:
        with pytest.raises(FileExistsError) as info:
            call(_params(2.0))
    finally:
        go.set()
        thread.join()
    message = str(info.value)
    for part in ("is being written by another save", f"pid {os.getpid()}",
                 repr(socket.gethostname()), "out.stackwise-lock", "another directory"):
        assert part in message, (part, message)
    assert not isinstance(outcome["first"], BaseException), outcome["first"]
    assert_trees_bitwise(stackwise.load_checkpoint(tmp_path / "out", _params(), names),
                         _params(1.0))
    assert sorted(os.listdir(tmp_path)) == ["out"]


_CHILD = """
import sys, stackwise, jax.numpy as jnp
from stackwise._checkpoint import save
real = save._stage
def waiting(*args, **kwargs):
    print("writing", flush=True)
    sys.stdin.readline()
    return real(*args, **kwargs)
save._stage = waiting
params = {"embed": jnp.full((5, 2), 7.0), "w": jnp.full((3, 4, 2), 7.0), "b": jnp.full((3, 2), 7.0)}
names = {"embed": "embed", "w": stackwise.Tensor("l.{}.w", transpose=(1, 0)), "b": "l.{}.b"}
stackwise.save_safetensors(params, names, sys.argv[1])
"""


@pytest.mark.slow  # a second Python process with jax (~3 s)
def test_two_processes_into_one_folder(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path / "out")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "writing"  # it holds the claim
        with pytest.raises(FileExistsError, match=f"pid {child.pid} on host"):
            stackwise.save_safetensors(_params(), NAMES, tmp_path / "out")
    finally:
        child.communicate("go\n", timeout=120)
    assert child.returncode == 0
    got = stackwise.load_checkpoint(tmp_path / "out", _params(), NAMES)
    assert_trees_bitwise(got, jax.tree.map(lambda a: jnp.full_like(a, 7.0), _params()))
    assert sorted(os.listdir(tmp_path)) == ["out"]


def _claim(tmp_path, **claim):
    lock = tmp_path / "out.stackwise-lock"
    lock.write_text(json.dumps({"who": "stackwise.save_safetensors", "since": "then", **claim}))
    return lock


def test_a_stale_claim_of_a_process_gone_is_taken_over(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _claim(tmp_path, host=socket.gethostname(), pid=gone.pid)
    (tmp_path / "out.stackwise-tmp" / "new").mkdir(parents=True)  # its half-written stage
    (tmp_path / "out.stackwise-tmp" / "new" / "model.safetensors").write_bytes(b"half")
    stackwise.save_safetensors(_params(), NAMES, tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert_trees_bitwise(stackwise.load_checkpoint(tmp_path / "out", _params(), NAMES),
                         _params())


def test_a_live_or_foreign_claim_is_never_taken_over(tmp_path):
    alive = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        lock = _claim(tmp_path, host=socket.gethostname(), pid=alive.pid)
        before = _snapshot(tmp_path)
        with pytest.raises(FileExistsError, match=f"pid {alive.pid} on host") as info:
            stackwise.save_safetensors(_params(), NAMES, tmp_path / "out")
        assert f"remove {lock}" in str(info.value) and _snapshot(tmp_path) == before
    finally:
        alive.communicate(timeout=60)
    _claim(tmp_path, host="another-host", pid=alive.pid)  # its pid means nothing here
    with pytest.raises(FileExistsError, match="on host 'another-host'"):
        stackwise.save_orbax(_params(), ORBAX_NAMES, tmp_path / "out")
    _claim(tmp_path, host=socket.gethostname(), pid=alive.pid)  # now gone: taken over
    stackwise.save_safetensors(_params(), NAMES, tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_claim_removed_while_saving_moves_nothing_into_place(tmp_path, monkeypatch):
    real = save._stage

    def removing(*args, **kwargs):
        (tmp_path / "out.stackwise-lock").unlink(missing_ok=True)
        return real(*args, **kwargs)

    monkeypatch.setattr(save, "_stage", removing)
    with pytest.raises(FileExistsError, match="was removed or taken by another writer"):
        stackwise.save_safetensors(_params(), NAMES, tmp_path / "out")
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------
# What other readers need, and names in both directions.


def test_files_carry_the_metadata_transformers_requires(tmp_path):
    """transformers 4.x refuses a safetensors file whose metadata "format" is not one of
    its frameworks' ("pt", as save_pretrained writes, "tf", "flax", "mlx")."""
    from safetensors import safe_open

    written = stackwise.save_safetensors(_params(), NAMES, tmp_path, max_file_bytes=LAYER)
    for path in written[:-1]:
        with safe_open(path, framework="numpy") as f:
            assert f.metadata() == {"format": "pt"}, path


def test_torch_reads_the_files(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    written = stackwise.save_safetensors(_params(), NAMES, tmp_path)
    tensors = load_file(written[0])
    assert torch.equal(tensors["l.2.w"], torch.tensor(np.asarray(_params()["w"][2]).T))


def test_zero_padded_layer_numbers_both_ways(tmp_path):
    params = {"w": jnp.arange(36.0).reshape(12, 3)}  # 12 layers: 00 .. 11
    stackwise.save_safetensors(params, {"w": "layers.{:02d}.w"}, tmp_path)
    ckpt = stackwise.open_checkpoint(tmp_path)
    assert sorted(ckpt.tensors)[:2] == ["layers.00.w", "layers.01.w"]
    layout = stackwise.inspect_checkpoint(tmp_path)
    assert (layout.names, layout.depth) == (["layers.{:02d}.w"], 12)
    back = stackwise.load_checkpoint(tmp_path, params, {"w": layout.names[0]})
    assert_trees_bitwise(back, params)
    # `{}` is the unpadded number alone: the padded checkpoint is not read as it.
    with pytest.raises(ValueError, match="'layers.0.w' for leaf"):
        stackwise.load_checkpoint(tmp_path, params, {"w": "layers.{}.w"})


def test_a_reshape_with_one_inferred_axis_both_ways(tmp_path):
    e, heads, d = 4, 2, 3
    params = {"q": jnp.arange(2 * e * heads * d, dtype=jnp.float32).reshape(2, e, heads, d)}
    names = {"q": Tensor("l.{}.q", transpose=(1, 0), reshape=(e, heads, -1),
                         stored_shape=(heads * d, e))}
    stackwise.save_safetensors(params, names, tmp_path)
    stored = stackwise.open_checkpoint(tmp_path).read("l.1.q")
    np.testing.assert_array_equal(stored, np.asarray(params["q"][1]).reshape(e, -1).T)
    assert_trees_bitwise(stackwise.load_checkpoint(tmp_path, params, names), params)


def test_per_layer_scalars_round_trip(tmp_path):
    """Found by the oracle (test_checkpoint_oracle.py): a per-layer scalar (a gate, a
    scale) was saved with shape (1,) (np.ascontiguousarray makes a 0-d array 1-D), and a
    per-layer scalar tensor loaded as zeros (its row was a copy, not a view)."""
    params = {"gate": jnp.array([1.5, -2.0, 3.25]), "scale": jnp.array(0.5)}
    names = {"gate": "l.{}.gate", "scale": "scale"}
    stackwise.save_safetensors(params, names, tmp_path)
    ckpt = stackwise.open_checkpoint(tmp_path)
    assert {n: s.shape for n, s in ckpt.tensors.items()} == {
        "l.0.gate": (), "l.1.gate": (), "l.2.gate": (), "scale": ()}
    assert_trees_bitwise(stackwise.load_checkpoint(tmp_path, params, names), params)
    arrays = {f"l.{i}.gate": np.float32(i + 0.5) for i in range(3)}
    got = stackwise.load_checkpoint(arrays, {"gate": params["gate"]}, {"gate": "l.{}.gate"})
    np.testing.assert_array_equal(got["gate"], [0.5, 1.5, 2.5])


# --------------------------------------------------------------------------
# The claim's corner cases, one by one.


@pytest.mark.every_case
@pytest.mark.parametrize("content", [b"\xff\xfe not json", b"[1, 2]"])
def test_an_unreadable_claim_is_never_taken_for_stale(tmp_path, content):
    (tmp_path / "out.stackwise-lock").write_bytes(content)
    with pytest.raises(FileExistsError, match="a writer whose claim file cannot be read"):
        stackwise.save_safetensors(_params(), NAMES, tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["out.stackwise-lock"]


def test_a_claim_that_keeps_changing_hands_is_given_up(tmp_path, monkeypatch):
    monkeypatch.setattr(staging.Stage, "_link", lambda self: False)  # never ours, yet
    with pytest.raises(FileExistsError, match="other writers keep claiming"):  # never there
        stackwise.save_safetensors(_params(), NAMES, tmp_path / "out")
    assert os.listdir(tmp_path) == []


def test_taking_over_a_stale_claim_leaves_a_fresh_one_alone(tmp_path, monkeypatch):
    stage = staging.Stage(str(tmp_path / "out"), "test")
    stale = {"host": socket.gethostname(), "pid": -1}
    stage._take_over(stale)  # gone already: nothing to do
    fresh = {"host": socket.gethostname(), "pid": os.getpid(), "who": "another save"}
    lock = tmp_path / "out.stackwise-lock"
    lock.write_text(json.dumps(fresh))  # claimed afresh after `stale` was read
    stage._take_over(stale)
    assert json.loads(lock.read_text()) == fresh and os.listdir(tmp_path) == [lock.name]
    # ... and if a third writer claimed while it was aside, the third keeps the claim.
    real = staging.Stage._read

    def third_claims(path):
        got = real(path)
        if path.endswith(".stale"):
            lock.write_text(json.dumps({"who": "third"}))
        return got

    monkeypatch.setattr(staging.Stage, "_read", staticmethod(third_claims))
    stage._take_over(stale)
    assert json.loads(lock.read_text()) == {"who": "third"}
    assert os.listdir(tmp_path) == [lock.name]


def test_another_users_process_is_alive(monkeypatch):
    def denied(pid, signal):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(staging.os, "kill", denied)
    assert staging._alive(1)


def test_a_failed_save_removes_the_folders_it_made(tmp_path, monkeypatch):
    _fail_at(monkeypatch, save, "_stage", 1)
    with pytest.raises(OSError, match="injected"):
        stackwise.save_safetensors(_params(), NAMES, tmp_path / "a" / "b" / "out")
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()  # one that another program put a file into meanwhile is kept
    _fail_at(monkeypatch, save, "_stage", 1,
             before=lambda *args: (tmp_path / "a" / "theirs").write_text("kept"))
    with pytest.raises(OSError, match="injected"):
        stackwise.save_safetensors(_params(), NAMES, tmp_path / "a" / "b" / "out")
    assert _snapshot(tmp_path) == {"a/": None, "a/theirs": b"kept"}


def test_orbax_zero_padded_names_and_an_inferred_axis_both_ways(tmp_path, partial):
    params = {"w": jnp.arange(24.0).reshape(3, 2, 4), "s": jnp.arange(3.0)}
    names = {"w": Tensor("layers_{:02d}.w", transpose=(1, 0), reshape=(2, -1),
                         stored_shape=(4, 2)), "s": "layers_{:02d}.s"}
    path = stackwise.save_orbax(params, names, tmp_path / "loop")
    layout = stackwise.inspect_checkpoint(path)
    assert (layout.names, layout.depth) == (["layers_{:02d}.s", "layers_{:02d}.w"], 3)
    np.testing.assert_array_equal(stackwise.open_checkpoint(path).read("layers_02.w"),
                                  np.asarray(params["w"][2]).T)
    assert_trees_bitwise(stackwise.load_checkpoint(path, params, names), params)


@pytest.mark.parametrize("saver", ["safetensors", "orbax"])
def test_signalling_nans_are_saved_bit_for_bit(tmp_path, saver):
    """Found by the oracle: a bfloat16 row taken by JAX's indexing had its signalling NaN
    quieted (0x7fbf -> 0x7fc0) by XLA's older CPU code generator (the one the tests run):
    the savers take rows as unsigned integers of the same width."""
    if saver == "orbax":
        pytest.importorskip("orbax.checkpoint")
    bits = np.array([[0x7FBF, 0x7F81], [0xFF80 | 1, 0x3F80]], np.uint16)
    params = {"w": jnp.asarray(bits.view(jnp.bfloat16)),
              "f": jnp.asarray(np.array([[0x7F800001], [0x7FC00000]], np.uint32)
                               .view(np.float32))}
    names = {"w": "l.{}.w", "f": "l.{}.f"}
    save_call = stackwise.save_safetensors if saver == "safetensors" else stackwise.save_orbax
    path = save_call(params, names, tmp_path / "out")
    ckpt = stackwise.open_checkpoint(path if saver == "orbax" else tmp_path / "out")
    for i in range(2):
        np.testing.assert_array_equal(ckpt.read(f"l.{i}.w").view(np.uint16), bits[i])
    assert ckpt.read("l.0.f").view(np.uint32).tolist() == [0x7F800001]
    assert_trees_bitwise(stackwise.load_checkpoint(path, params, names), params)


def test_writers_racing_unhindered_leave_one_whole_model(tmp_path):
    """Four threads save four models into one new folder at once, nothing held back: one
    wins, each other raises FileExistsError (the folder claimed by another save, or already
    holding a checkpoint), and the folder holds the winner's model, bitwise."""
    start, outcome = threading.Barrier(4), {}

    def one(i):
        start.wait()
        try:
            outcome[i] = stackwise.save_safetensors(_params(i + 1.0), NAMES, tmp_path / "out",
                                                    max_file_bytes=LAYER)
        except FileExistsError as e:
            outcome[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [i for i, got in outcome.items() if not isinstance(got, Exception)]
    assert len(won) == 1 and len(outcome) == 4, outcome
    for i, got in outcome.items():
        if i != won[0]:
            assert ("is being written by another save" in str(got)
                    or "already holds a checkpoint" in str(got)), got
    back = stackwise.load_checkpoint(tmp_path / "out", _params(), NAMES)
    assert_trees_bitwise(back, _params(won[0] + 1.0))
    assert sorted(os.listdir(tmp_path)) == ["out"]
