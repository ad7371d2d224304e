"""The misuse catalogue of the checkpoint calls (load_checkpoint, save_safetensors,
save_orbax, open_checkpoint, inspect_checkpoint): each bad input, the error type, and what the
message must name (the file, the tensor, the layer, the leaf) and the fix it gives. Nothing is
returned partly loaded, and nothing on disk is overwritten unless asked."""

from __future__ import annotations

import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stackwise
from stackwise import Tensor

pytest.importorskip("safetensors")

F32 = jnp.float32


def _abstract(shape, dtype=F32):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A 3-layer checkpoint in two safetensors files with an index, a bf16 one, bad files."""
    from safetensors.numpy import save_file

    root = tmp_path_factory.mktemp("ckpt")
    layers = {f"model.layers.{i}.w": np.full((4, 2), i, np.float32) for i in range(3)}
    save_file(dict(list(layers.items())[:2]), root / "a.safetensors")
    save_file(dict(list(layers.items())[2:]) | {"embed": np.ones((5, 2), np.float32)},
              root / "b.safetensors")
    weight_map = {n: "a.safetensors" for n in list(layers)[:2]}
    weight_map |= {"model.layers.2.w": "b.safetensors", "embed": "b.safetensors"}
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    save_file({f"l.{i}.w": np.zeros(2, jnp.bfloat16) for i in range(2)}, root / "bf16.safetensors")
    whole = (root / "b.safetensors").read_bytes()
    (root / "truncated.safetensors").write_bytes(whole[:-5])
    (root / "corrupt.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    (root / "other").mkdir()
    (root / "bad.json").write_text("[1, 2]")
    (root / "garbage.json").write_bytes(bytes(range(256)) * 4)
    (root / "numbers.json").write_text(json.dumps({"weight_map": {"w": 1}}))
    (root / "list.json").write_text(json.dumps({"weight_map": ["a.safetensors"]}))
    # an index of another checkpoint: it puts a tensor in a file that does not hold it
    (root / "stale.json").write_text(json.dumps({"weight_map": {"embed": "a.safetensors"}}))
    # an index naming a file that was never downloaded
    (root / "partial.json").write_text(json.dumps({"weight_map": {"w": "c.safetensors"}}))
    (root / "model.bin").write_bytes(b"a torch pickle, say")
    (root / "empty.npz").write_bytes(b"")
    np.savez(root / "whole.npz", w=np.zeros((3, 4, 2), np.float32))
    (root / "truncated.npz").write_bytes((root / "whole.npz").read_bytes()[:100])
    np.savez(root / "big.npz", w=np.zeros((3, 4, 4096), np.float32))
    flipped = bytearray((root / "big.npz").read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF  # in w's data, past what its header's read reads
    (root / "corrupt.npz").write_bytes(bytes(flipped))
    step = root / "manager" / "3"
    (step / "default").mkdir(parents=True)
    (step / "default" / "_METADATA").write_text("{}")
    (step / "_CHECKPOINT_METADATA").write_text("{}")
    return root


ONE = {"w": _abstract((3, 2, 4))}
W = {"w": Tensor("model.layers.{}.w", transpose=(1, 0))}


def _load(source, target=ONE, names=W, **kw):
    return lambda root: stackwise.load_checkpoint(
        root / source if isinstance(source, str) else source, target, names, **kw)


def _save(params=None, names=None, **kw):
    return lambda root: stackwise.save_safetensors(
        {"w": jnp.zeros((3, 4, 2))} if params is None else params,
        {"w": "l.{}.w"} if names is None else names, root / "new4", **kw)


CASES = {
    # (call of the fixture's folder, error type, what the message names)
    "missing layer": (
        _load(".", {"w": _abstract((4, 2, 4))}),
        ValueError, ["model.layers.3.w", "layer 3", "index.json", "leaf ['w']", "depth"]),
    "missing tensor": (
        _load(".", {"w": _abstract((3, 2, 4)), "e": _abstract((5, 2))}, {**W, "e": "embeds"}),
        ValueError, ["'embeds'", "index.json", "closest name there is 'embed'", "leaf ['e']"]),
    "extra layer": (
        _load(".", {"w": _abstract((2, 2, 4))}),
        ValueError, ["layer 2's tensor 'model.layers.2.w'", "b.safetensors", "all 3 layers",
                     "slice_layers"]),
    "shape differs (torch's (out, in) kept)": (
        _load(".", names={"w": "model.layers.{}.w"}),
        ValueError, ["leaf ['w']", "layer 0's tensor 'model.layers.0.w'", "a.safetensors",
                     "transpose=(1, 0)"]),
    "shape differs, the same size (a reshape)": (
        _load(".", {"w": _abstract((3, 8, 1))}, {"w": "model.layers.{}.w"}),
        ValueError, ["leaf ['w']", "per layer (8, 1)", "'model.layers.0.w'", "[4, 2]",
                     "To split or merge axes", "stackwise.Tensor(..., reshape=(8, 1))"]),
    "bfloat16 into float32 without a cast": (
        _load("bf16.safetensors", {"w": _abstract((2, 2))}, {"w": "l.{}.w"}),
        TypeError, ["leaf ['w']", "layer 0's tensor 'l.0.w'", "bf16.safetensors", "bfloat16",
                    "never casts", "dtype=jnp.float32"]),
    "a cast to another dtype than the leaf's": (
        _load("bf16.safetensors", {"w": _abstract((2, 2))},
              {"w": Tensor("l.{}.w", dtype="float16")}),
        TypeError, ["leaf ['w']", "'l.0.w'", "float16", "dtype=jnp.float32"]),
    "truncated file": (
        _load("truncated.safetensors"), ValueError,
        ["truncated.safetensors", "truncated or corrupt", "Write it again"]),
    "corrupt file": (
        _load("corrupt.safetensors"), ValueError, ["corrupt.safetensors", "truncated or corrupt"]),
    "a template that matches nothing": (
        _load(".", names={"w": "model.layer.{}.w"}),
        ValueError, ["'model.layer.0.w'", "no tensor matches it", "closest", "model.layers.0.w",
                     "index.json"]),
    "a template with two {}": (
        _load(".", names={"w": "model.layers.{}.{}"}),
        ValueError, ["'model.layers.{}.{}'", "leaf ['w']", "one `{}`"]),
    "a tensor that fills two leaves": (
        _load(".", {"w": _abstract((3, 2, 4)), "v": _abstract((3, 2, 4))}, {**W, "v": W["w"]}),
        ValueError, ["'model.layers.0.w'", "a.safetensors", "['w']", "['v']", "tied"]),
    "a tensor in two files": (
        lambda root: stackwise.open_checkpoint([root / "b.safetensors", root / "b.safetensors"]),
        ValueError, ["tensor 'embed'", "b.safetensors", "two files"]),
    "a leaf without a name": (
        _load(".", {"w": _abstract((3, 2, 4)), "e": _abstract((5, 2))}),
        ValueError, ["leaf ['e']", "no entry 'e'", "Give every array leaf"]),
    "a name for a leaf the target lacks": (
        _load(".", names={**W, "wq": "embed"}),
        ValueError, ["['wq']", "misspelt"]),
    "a subtree given one name": (
        _load(".", {"w": {"a": _abstract((3, 2, 4))}}, W),
        ValueError, ["model.layers.{}.w", "leaf ['w']['a']", "a name per leaf"]),
    "position without pattern": (
        _load(".", names={"w": Tensor("model.layers.{}.w", transpose=(1, 0), position=1)}),
        ValueError, ["leaf ['w']", "position=1", "pattern=k"]),
    "a pattern without positions": (
        _load(".", pattern=2), ValueError, ["pattern=2", "'model.layers.{}.w'", "position=p"]),
    "pattern not an int": (_load(".", pattern="2"), TypeError, ["`pattern`", "'2'"]),
    "pattern 0": (_load(".", pattern=0), ValueError, ["`pattern`", "at least 1", "0"]),
    "an int64 target with x64 off (its values would wrap)": (
        _load(".", {"w": _abstract((3, 2, 4), np.int64)}),
        TypeError, ["load_checkpoint", "leaf ['w']", "int64", "jax_enable_x64"]),
    "transpose not a permutation": (
        _load(".", names={"w": Tensor("model.layers.{}.w", transpose=(0, 2))}),
        TypeError, ["leaf ['w']", "transpose=(0, 2)", "'model.layers.0.w'", "a.safetensors"]),
    "reshape to another size": (
        _load(".", names={"w": Tensor("model.layers.{}.w", reshape=(3, 3))}),
        ValueError, ["leaf ['w']", "'model.layers.0.w'", "(3, 3)"]),
    "a sharding that is not one": (
        _load(".", shardings={"w": "data"}), TypeError, ["leaf ['w']", "str", "stacked_shardings"]),
    "a spec longer than the leaf": (
        lambda root: _load(".", shardings={"w": jax.sharding.NamedSharding(
            jax.make_mesh((1,), ("data",)), jax.sharding.PartitionSpec(None, None, None, "data"))})(
                root),
        ValueError, ["leaf ['w']", "names 4 axes", "stacked_shardings"]),
    "a scalar leaf with a per-layer name": (
        _load(".", {"w": _abstract(())}), ValueError, ["leaf ['w']", "scalar", "without `{}`"]),
    "a source of another type": (
        lambda root: stackwise.open_checkpoint(42), TypeError, ["`source`", "int"]),
    "a path of no checkpoint": (
        lambda root: stackwise.open_checkpoint(root / "model.bin"), ValueError,
        ["model.bin", "cannot tell", ".safetensors file"]),
    "a mistyped folder": (
        lambda root: stackwise.open_checkpoint(root / "othr"), ValueError,
        ["othr does not exist", "did you mean", "other'"]),
    "a mistyped folder, loading": (
        _load("manger"), ValueError, ["manger does not exist", "did you mean", "manager'"]),
    "a CheckpointManager's step folder": (
        lambda root: stackwise.open_checkpoint(root / "manager" / "3"), ValueError,
        ["<dir>/<step>/<item>", "e.g. " + "{root}/manager/3/default"]),
    "a CheckpointManager's directory": (
        lambda root: stackwise.load_checkpoint(root / "manager", ONE, W), ValueError,
        ["<dir>/<step>/<item>", "e.g. " + "{root}/manager/3/default"]),
    "an empty list of files": (
        lambda root: stackwise.open_checkpoint([]), ValueError,
        ["no files given", "empty list", "safetensors files, or its directory"]),
    "an empty list of files, loading": (
        _load([]), ValueError, ["no files given", "its directory"]),
    "an index of binary garbage": (
        lambda root: stackwise.open_checkpoint(root / "garbage.json"), ValueError,
        ["garbage.json", "not a safetensors index", "'weight_map'", "download finished"]),
    "an index whose files are not names": (
        lambda root: stackwise.open_checkpoint(root / "numbers.json"), ValueError,
        ["numbers.json", "not a safetensors index", "'weight_map' of tensor names to files"]),
    "an index whose weight_map is a list": (
        lambda root: stackwise.open_checkpoint(root / "list.json"), ValueError,
        ["list.json", "not a safetensors index"]),
    "a path in a folder that does not exist": (
        lambda root: stackwise.open_checkpoint(root / "nowhere" / "model.safetensors"),
        ValueError, ["model.safetensors does not exist", "nor does its folder", "nowhere"]),
    "an empty .npz": (
        _load("empty.npz"), ValueError,
        ["empty.npz", "not a readable .npz", "empty, truncated", "Write it again"]),
    "a .npz corrupt inside a tensor": (
        _load("corrupt.npz", {"w": _abstract((3, 4, 4096))}, {"w": "w"}), ValueError,
        ["tensor 'w'", "corrupt.npz", "cannot be read", "BadZipFile", "Write the file again"]),
    "a truncated .npz": (
        lambda root: stackwise.open_checkpoint(root / "truncated.npz"), ValueError,
        ["truncated.npz", "not a readable .npz", "BadZipFile", "Write it again"]),
    "a folder of no checkpoint": (
        lambda root: stackwise.open_checkpoint(root / "other"), ValueError,
        ["other", "no safetensors files", "<dir>/<step>/<item>"]),
    "a safetensors file that is not there": (
        lambda root: stackwise.open_checkpoint(root / "nope.safetensors"), ValueError,
        ["nope.safetensors", "does not exist"]),
    "an index that is not one": (
        lambda root: stackwise.open_checkpoint(root / "bad.json"), ValueError,
        ["bad.json", "weight_map"]),
    "an npz that is not there": (
        lambda root: stackwise.open_checkpoint(root / "nope.npz"), ValueError,
        ["nope.npz", "does not exist"]),
    "saving over a checkpoint": (
        lambda root: stackwise.save_safetensors({"w": jnp.zeros((3, 4, 2))}, W, root),
        FileExistsError,
        ["ckpt", "a.safetensors", "already holds a checkpoint", "overwrite=True"]),
    "saving a reshaped leaf without its stored shape": (
        lambda root: stackwise.save_safetensors(
            {"w": jnp.zeros((3, 2, 2, 2))}, {"w": Tensor("l.{}.w", reshape=(2, 2, 2))},
            root / "new"),
        ValueError, ["leaf ['w']", "reshape=(2, 2, 2)", "stored_shape="]),
    "saving two leaves under one name": (
        lambda root: stackwise.save_safetensors(
            {"a": jnp.zeros(2), "b": jnp.zeros(2)}, {"a": "x", "b": "x"}, root / "new2"),
        ValueError, ["['a']", "['b']", "'x'"]),
    "saving abstract params": (
        lambda root: stackwise.save_safetensors(ONE, W, root / "new3"),
        TypeError, ["leaf ['w']", "abstract", "jax.eval_shape", "no values to save"]),
    "saving with pattern not an int": (
        _save(pattern="2"), TypeError, ["save_safetensors", "`pattern`", "'2'"]),
    "saving with pattern 0": (_save(pattern=0), ValueError, ["`pattern`", "at least 1", "0"]),
    "saving with max_file_bytes not an int": (
        _save(max_file_bytes="4GB"), TypeError, ["`max_file_bytes`", "'4GB'"]),
    "saving with overwrite a string": (
        lambda root: stackwise.save_safetensors({"w": jnp.zeros((3, 4, 2))}, W, root,
                                                overwrite="no"),
        TypeError, ["`overwrite`", "True or False", "'no'"]),
    "saving a position without pattern": (
        _save(names={"w": Tensor("l.{}.w", position=1)}), ValueError,
        ["leaf ['w']", "position=1", "pattern=k"]),
    "saving a pattern without positions": (
        _save(pattern=2), ValueError, ["pattern=2", "'l.{}.w'", "position=p"]),
    "saving a scalar under a per-layer name": (
        _save({"w": jnp.zeros(())}), ValueError, ["leaf ['w']", "scalar", "without `{}`"]),
    "saving into a path that is a file": (
        lambda root: stackwise.save_safetensors({"w": jnp.zeros((3, 4, 2))}, W,
                                                root / "bad.json"),
        FileExistsError, ["bad.json is a file, not a folder", "overwrite=True"]),
    "saving under a path that is a file": (
        lambda root: stackwise.save_safetensors({"w": jnp.zeros((3, 4, 2))}, W,
                                                root / "bad.json" / "sub" / "out"),
        FileExistsError, ["cannot make the folder", "bad.json is a file, not a folder"]),
    "saving orbax into a path that is a file": (
        lambda root: stackwise.save_orbax({"w": jnp.zeros((3, 4, 2))}, W, root / "bad.json"),
        FileExistsError, ["save_orbax", "bad.json is a file, not a folder", "overwrite=True"]),
    "saving a transposed 1-D leaf": (
        _save({"w": jnp.zeros((3, 4))}, {"w": Tensor("l.{}.w", transpose=(1, 0))}),
        TypeError, ["save_safetensors", "leaf ['w']", "transpose=(1, 0)", "(4,)",
                    "nothing to transpose", "plain str"]),
    "saving orbax a transposed 1-D leaf": (
        lambda root: stackwise.save_orbax({"w": jnp.zeros((3, 4))},
                                          {"w": Tensor("l.{}.w", transpose=(1, 0))},
                                          root / "new6"),
        TypeError, ["save_orbax", "leaf ['w']", "transpose=(1, 0)", "nothing to transpose"]),
    "saving a PRNG key leaf": (
        _save({"w": jnp.zeros((3, 4, 2)), "k": jax.random.split(jax.random.key(0), 3)},
              {"w": "l.{}.w", "k": "l.{}.k"}),
        TypeError, ["leaf ['k']", "PRNG key", "key<fry>", "jax.random.key_data"]),
    "saving orbax a PRNG key leaf": (
        lambda root: stackwise.save_orbax({"k": jax.random.key(0)}, {"k": "k"}, root / "new6"),
        TypeError, ["save_orbax", "leaf ['k']", "PRNG key", "jax.random.key_data"]),
    "loading into a PRNG key leaf": (
        _load(".", {"k": jax.eval_shape(lambda: jax.random.split(jax.random.key(0), 3))},
              {"k": "model.layers.{}.w"}),
        TypeError, ["load_checkpoint", "leaf ['k']", "PRNG key", "jax.random.key_data",
                    "wrap_key_data"]),
    "saving a dtype safetensors does not hold": (
        _save({"w": jnp.zeros((3, 4, 2), jnp.complex64)}), TypeError,
        ["leaf ['w']", "complex64", "safetensors files do not hold", "save_orbax"]),
    "saving a reshape whose stored shape does not give the leaf": (
        _save({"w": jnp.zeros((3, 2, 3))},
              {"w": Tensor("l.{}.w", reshape=(2, 3), stored_shape=(3, 3))}),
        ValueError, ["leaf ['w']", "(2, 3)", "stored_shape", "(3, 3)"]),
    "a Tensor reshape that infers two axes": (
        lambda root: Tensor("l.{}.w", reshape=(2, -1, -1)), ValueError,
        ["`reshape=(2, -1, -1)`", "one axis (-1)", "(E, H, -1)"]),
    "a Tensor stored_shape with -1": (
        lambda root: Tensor("l.{}.w", stored_shape=(2, -1)), ValueError,
        ["`stored_shape=(2, -1)`", "at least 0"]),
    "a template with a format spec that is not zero-padding": (
        _load(".", names={"w": "model.layers.{:2d}.w"}),
        ValueError, ["'model.layers.{:2d}.w'", "leaf ['w']", "`{:02d}`", "zero-padded"]),
    "a zero-padded checkpoint read with {}": (
        lambda root: stackwise.load_checkpoint({"l.00.w": np.zeros(2, np.float32)},
                                               {"w": _abstract((1, 2))}, {"w": "l.{}.w"}),
        ValueError, ["'l.0.w'", "leaf ['w']", "closest name there is 'l.00.w'"]),
    "saving orbax over a checkpoint": (
        lambda root: stackwise.save_orbax({"w": jnp.zeros((3, 4, 2))}, W, root),
        FileExistsError, ["save_orbax", "ckpt", "already exists and is not empty",
                          "overwrite=True"]),
    "saving orbax abstract params": (
        lambda root: stackwise.save_orbax(ONE, W, root / "new5"),
        TypeError, ["save_orbax", "leaf ['w']", "abstract", "no values to save"]),
    "saving orbax with max_group_bytes 0": (
        lambda root: stackwise.save_orbax({"w": jnp.zeros((3, 4, 2))}, W, root / "new5",
                                          max_group_bytes=0),
        ValueError, ["save_orbax", "`max_group_bytes`", "at least 1"]),
    "saving orbax with overwrite a string": (
        lambda root: stackwise.save_orbax({"w": jnp.zeros((3, 4, 2))}, W, root / "new5",
                                          overwrite="yes"),
        TypeError, ["save_orbax", "`overwrite`", "True or False", "'yes'"]),
    "saving orbax a name inside another's (a leaf, not a subtree)": (
        lambda root: stackwise.save_orbax({"a": jnp.zeros(2), "b": jnp.zeros(2)},
                                          {"a": "x.y", "b": "x.y.z"}, root / "new5"),
        ValueError, ["save_orbax", "'x.y.z'", "leaf ['b']", "prefix", "Rename"]),
    "saving orbax a name over another's subtree": (
        lambda root: stackwise.save_orbax({"a": jnp.zeros(2), "b": jnp.zeros(2)},
                                          {"a": "x.y.z", "b": "x.y"}, root / "new5"),
        ValueError, ["save_orbax", "'x.y'", "leaf ['b']", "prefix", "Rename"]),
    "a Tensor position that is not an int": (
        lambda root: Tensor("l.{}.w", position="1"), TypeError,
        ["stackwise.Tensor('l.{}.w')", "`position`", "'1'"]),
    "a Tensor position that is a bool": (
        lambda root: Tensor("l.{}.w", position=True), TypeError, ["`position`", "bool"]),
    "a Tensor position below 0": (
        lambda root: Tensor("l.{}.w", position=-1), ValueError, ["`position`", "at least 0"]),
    "a Tensor transpose that is one int": (
        lambda root: Tensor("l.{}.w", transpose=1), TypeError,
        ["`transpose`", "tuple of ints", "(1, 0)"]),
    "a Tensor reshape of floats": (
        lambda root: Tensor("l.{}.w", reshape=(2.0, 4)), TypeError, ["`reshape[0]`", "2.0"]),
    "names with a subtree where the target has a leaf": (
        _load(".", names={"w": {"x": "model.layers.{}.w"}}),
        ValueError, ["`names` has a subtree, not a name", "leaf ['w']"]),
    "a Tensor whose name is not a str": (
        _load(".", names={"w": Tensor(7)}), TypeError, ["name of leaf ['w']", "must be a str",
                                                         "got 7"]),
    "saving under a Tensor whose name is not a str": (
        _save(names={"w": Tensor(7)}), TypeError, ["save_safetensors", "name of leaf ['w']",
                                                    "must be a str", "got 7"]),
    "an index of another checkpoint": (
        lambda root: stackwise.open_checkpoint(root / "stale.json"), ValueError,
        ["stale.json", "puts tensor 'embed' in a.safetensors", "does not hold it",
         "different checkpoints"]),
    "an index naming a file that is not there": (
        lambda root: stackwise.open_checkpoint(root / "partial.json"), ValueError,
        ["the safetensors file {root}/c.safetensors does not exist"]),
    "a list of files, one not there": (
        lambda root: stackwise.open_checkpoint([root / "a.safetensors", root / "c.safetensors"]),
        ValueError, ["the safetensors file {root}/c.safetensors does not exist"]),
    "a Tensor stored_shape of strings": (
        lambda root: Tensor("l.{}.w", stored_shape="24"), TypeError, ["`stored_shape`", "'24'"]),
    "a Tensor dtype that is none": (
        lambda root: Tensor("l.{}.w", dtype="floaty"), TypeError,
        ["stackwise.Tensor('l.{}.w')", "`dtype`", "'floaty'", "jnp.bfloat16"]),
}


@pytest.mark.every_case
@pytest.mark.parametrize("case", list(CASES))
def test_misuse(files, case):
    call, error, parts = CASES[case]
    before = {p: p.read_bytes() for p in files.glob("*") if p.is_file()}
    with pytest.raises(error) as info:
        call(files)
    message = str(info.value)
    for part in (p.replace("{root}", str(files)) for p in parts):
        assert part in message, f"{case}: {part!r} not in: {message}"
    assert {p: p.read_bytes() for p in files.glob("*") if p.is_file()} == before


@pytest.mark.parametrize("module, extra", [("safetensors", "safetensors"),
                                           ("orbax.checkpoint", "orbax")])
def test_a_missing_reader_says_which_extra(files, monkeypatch, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    source = files / ("a.safetensors" if extra == "safetensors" else "orbax")
    if extra == "orbax":
        source.mkdir(exist_ok=True)
        (source / "_METADATA").write_text("{}")
    with pytest.raises(ImportError, match=rf"pip install 'stackwise\[{extra}\]'"):
        stackwise.open_checkpoint(source)


@pytest.mark.parametrize("module, hint", [
    ("orbax.checkpoint", "pip install 'stackwise[orbax]'"),
    ("orbax.checkpoint.experimental.v1.partial", "pip install -U orbax-checkpoint")])
def test_save_orbax_without_orbax_or_its_partial_saves_says_what_to_install(
        tmp_path, monkeypatch, module, hint):
    pytest.importorskip("orbax.checkpoint")
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed (or too old)
    with pytest.raises(ImportError, match=re.escape(hint)) as info:
        stackwise.save_orbax({"w": jnp.zeros((2, 1))}, {"w": "l.{}.w"}, tmp_path / "new")
    assert "stackwise.save_orbax" in str(info.value) and not (tmp_path / "new").exists()


def test_an_unreadable_orbax_checkpoint_names_the_folder(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    (tmp_path / "_METADATA").write_text("not json")
    with pytest.raises(ValueError, match="is not a readable orbax checkpoint"):
        stackwise.open_checkpoint(tmp_path)


def test_layers_of_different_shapes_name_the_layer():
    ckpt = {"l.0.w": np.zeros(2, np.float32), "l.1.w": np.zeros(3, np.float32)}
    with pytest.raises(ValueError, match=r"layer 1's tensor 'l.1.w' .* float32\[3\], layer 0's"):
        stackwise.load_checkpoint(ckpt, {"w": _abstract((2, 2))}, {"w": "l.{}.w"})


def test_a_dtype_stackwise_does_not_read_names_the_tensor(tmp_path):
    header = json.dumps({"z": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    path = tmp_path / "c.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(ValueError, match=r"'z' in .*c.safetensors has dtype C64"):
        stackwise.open_checkpoint(path)


def test_an_orbax_folder_whose_metadata_holds_no_arrays_says_which_folder_to_pass(
        tmp_path, monkeypatch):
    # (orbax 0.12 refuses an empty tree itself; the guard is for a version that returns one)
    ocp = pytest.importorskip("orbax.checkpoint")
    (tmp_path / "_METADATA").write_text("{}")
    monkeypatch.setattr(ocp.StandardCheckpointHandler, "metadata", lambda self, path: {})
    with pytest.raises(ValueError, match=r"finds no arrays' metadata in it\. Pass the folder "
                                         r"of one saved pytree"):
        stackwise.open_checkpoint(tmp_path)


def test_a_broken_orbax_metadata_names_the_folder(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    (tmp_path / "_METADATA").write_text("[1]")  # orbax itself fails to read it
    with pytest.raises(ValueError, match=f"{tmp_path} is not a readable orbax checkpoint"):
        stackwise.open_checkpoint(tmp_path)


def test_a_file_cut_short_after_opening_names_the_file_and_tensor(tmp_path):
    from safetensors.numpy import save_file

    path = tmp_path / "m.safetensors"
    save_file({"l.0.w": np.ones((4, 2), np.float32)}, path)
    ckpt = stackwise.open_checkpoint(path)  # valid when opened ...
    path.write_bytes(path.read_bytes()[:-16])  # ... cut short by another process
    with pytest.raises(ValueError, match=r"m.safetensors ends inside tensor 'l.0.w'"):
        stackwise.load_checkpoint(ckpt, {"w": _abstract((1, 4, 2))}, {"w": "l.{}.w"})


def test_a_numpy_integer_pattern_reads_as_an_int(files):
    # One position of a 1-pattern: the same leaf as without a pattern.
    want = stackwise.load_checkpoint(files, ONE, W)
    got = stackwise.load_checkpoint(files, ONE, W, pattern=np.int64(1))
    np.testing.assert_array_equal(got["w"], want["w"])


@pytest.mark.parametrize("saver", ["save_safetensors", "save_orbax"])
def test_saving_into_a_folder_another_save_claims_names_it(tmp_path, saver):
    if saver == "save_orbax":
        pytest.importorskip("orbax.checkpoint")
    claim = {"host": "node-7", "pid": 4242, "who": "stackwise.save_orbax", "since": "noon"}
    (tmp_path / "out.stackwise-lock").write_text(json.dumps(claim))
    with pytest.raises(FileExistsError) as info:
        getattr(stackwise, saver)({"w": jnp.zeros((3, 4, 2))}, {"w": "l.{}.w"}, tmp_path / "out")
    message = str(info.value)
    for part in (f"stackwise.{saver}", "out is being written by another save",
                 "pid 4242 on host 'node-7'", "since noon", "another directory",
                 f"remove {tmp_path / 'out.stackwise-lock'}"):
        assert part in message, (part, message)
    assert sorted(os.listdir(tmp_path)) == ["out.stackwise-lock"]
