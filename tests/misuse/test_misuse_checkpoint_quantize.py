"""The misuse catalogue of ``load_checkpoint(..., quantize=)``: a kind it does not know, a value
that is neither a kind nor a ``stackwise.quant.Scheme``, targets that are not float weights 2-D
per layer, a block size that does not divide a target's inputs: each refused, naming the
argument or leaf and the fix, before a byte of the checkpoint is read. (A mesh that does not
divide the packed 4-bit codes, and a sharding that says nothing of codes and scales, need
several devices: tests/checkpoint/test_checkpoint_quantized_sharded.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _misuse import assert_refused, case

import stackwise

N = 3
CKPT = {f"layers.{i}.w": np.full((4, 6), i + 1.0, np.float32) for i in range(N)}
CKPT |= {f"layers.{i}.n": np.ones(6, np.float32) for i in range(N)}
CKPT |= {f"layers.{i}.k": np.ones((6, 4), np.int32) for i in range(N)}
TARGET = {"w": jax.ShapeDtypeStruct((N, 6, 4), jnp.float32),
          "n": jax.ShapeDtypeStruct((N, 6), jnp.float32),
          "k": jax.ShapeDtypeStruct((N, 6, 4), jnp.int32)}
NAMES = {"w": stackwise.Tensor("layers.{}.w", transpose=(1, 0)), "n": "layers.{}.n",
         "k": "layers.{}.k"}
Scheme = stackwise.quant.Scheme


def _unread():
    """The checkpoint above, whose every read fails the test: the checks come first."""
    ckpt = stackwise.open_checkpoint(CKPT)

    def read(name, index):
        raise AssertionError(f"read {name} before refusing")

    return stackwise.Checkpoint(ckpt.kind, ckpt.where, ckpt.tensors, {}, read)


def _load(quantize):
    return lambda: stackwise.load_checkpoint(_unread(), TARGET, NAMES, quantize=quantize)


W = ["['w']"]

CASES = [
    case("an unknown kind", _load("int3"), ValueError, "stackwise.load_checkpoint",
         "`quantize` must be one of ('int8', 'int4', 'nf4')", "'int3'"),
    case("a kind in a Scheme unknown", _load(Scheme("fp8", W)), ValueError,
         "`quantize` must be one of", "'fp8'"),
    case("a number for quantize", _load(8), TypeError, "`quantize` must be a kind",
         "stackwise.quant.Scheme(kind, targets, block_size, double)", "int 8"),
    case("a dict for quantize", _load({"kind": "nf4"}), TypeError,
         "stackwise.quant.Scheme(kind, targets, block_size, double)"),
    case("a block size not dividing the inputs", _load(Scheme("nf4", W, 4)), ValueError,
         "target leaf ['w'] has 6 inputs", "`block_size=4` does not divide",
         "never padded", "e.g. 2"),
    case("a block size as a float", _load(Scheme("nf4", W, 2.0)), TypeError,
         "`block_size` must be an int"),
    case("an int target", _load(Scheme("int8", ["['k']"])), ValueError,
         "target leaf ['k'] is of dtype int32", "only float weights"),
    case("a target not 2-D per layer", _load(Scheme("int8", ["['n']"])), ValueError,
         "target leaf ['n']", "2-D (in, out) weight per layer", "contract=..."),
    case("a target of rank 3 per layer", lambda: stackwise.load_checkpoint(
        _unread(), {"t": jax.ShapeDtypeStruct((N, 2, 3, 4), jnp.float32)},
        {"t": "layers.{}.t"}, quantize=Scheme("nf4", ["['t']"])), ValueError,
        "target leaf ['t'] has shape (3, 2, 3, 4), [2, 3, 4] per layer", "as floats",
        "stackwise.quant.quantize(params, kind, targets, contract=...)"),
    case("a target the tree lacks", _load(Scheme("int8", ["['q']"])), ValueError,
         "not leaf paths", "['q']", "keystr"),
    case("a predicate choosing nothing", _load(Scheme("int8", lambda p, s: False)),
         ValueError, "chose no leaf"),
    case("a block size as a Scheme's second field", _load(Scheme("nf4", 64)), TypeError,
         "`targets` must be None", "got int 64", "`block_size=64`"),
    case("double quantization as a string", _load(Scheme("nf4", W, 2, "yes")), TypeError,
         "stackwise.load_checkpoint: `double` must be a bool", "got str 'yes'"),
    case("double quantization of -1 scales a block", _load(Scheme("nf4", W, 2, -1)),
         ValueError, "`double` must be at least 1", "got -1"),
]

#: The stacked base as floats, quantized, and attached to its adapters (whole and per leaf).
BASE = {"w": jnp.ones((N, 6, 4)), "n": jnp.ones((N, 6))}
QUANTIZED = stackwise.quant.quantize(BASE, targets=["['w']"])
ADAPTERS = stackwise.lora.init(jax.random.key(0), BASE, rank=2, targets=["['w']"])
WN = {"w": NAMES["w"], "n": NAMES["n"]}


def _into(tree):
    return lambda tmp_path: stackwise.load_checkpoint(_unread(), jax.eval_shape(lambda: tree), WN)


def _save(saver, tree):
    return lambda tmp_path: getattr(stackwise, saver)(tree, WN, tmp_path / "ckpt")


FINETUNED = [
    case("loading into a quantized target", _into(QUANTIZED), TypeError,
         "`target` holds a quantized weight (int8) at ['w']", "`quantize='int8'`"),
    case("loading into base and adapters attached", _into(stackwise.lora.attach(
        BASE, ADAPTERS)), TypeError, "`target` holds a base and its adapters attached at <root>",
        "`params.base`", "stackwise.lora.load_peft"),
    *[case(f"{saver} of a quantized tree", _save(saver, QUANTIZED), TypeError,
           f"stackwise.{saver}: `params` holds a quantized weight (int8) at ['w']",
           "Save the float params", "quantize=") for saver in ("save_safetensors", "save_orbax")],
    case("saving base and adapters attached per leaf", _save("save_safetensors",
         stackwise.lora.attach(BASE, ADAPTERS, per_leaf=True)), TypeError,
         "attached at ['w']", "the tree given to `attach`", "stackwise.lora.save_peft"),
]


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", FINETUNED)
def test_a_quantized_or_attached_tree_is_refused(call, error, words, tmp_path):
    assert_refused(lambda: call(tmp_path), error, words)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", CASES)
def test_refused(call, error, words):
    assert_refused(call, error, words)


def _load_non_finite(value, quantize, layer=1):
    """The checkpoint above with one weight of ``layer``'s `w` set to ``value``."""
    w = CKPT[f"layers.{layer}.w"].copy()
    w[2, 3] = value
    ckpt = {**CKPT, f"layers.{layer}.w": w}
    return lambda: stackwise.load_checkpoint(ckpt, TARGET, NAMES, quantize=quantize)


#: A NaN or inf weight refused as `stackwise.quant.quantize` refuses it (its message's kind),
#: naming the leaf and the layer, with the way to load it as floats.
NON_FINITE = [
    case("a NaN weight", _load_non_finite(np.nan, "int8"), ValueError,
         "stackwise.load_checkpoint: target leaf ['w'] holds NaN or inf (layers [1])",
         "every weight sharing its scale would be lost", "load it as floats",
         "stackwise.quant.Scheme(kind, targets)"),
    case("an inf weight in blocks", _load_non_finite(np.inf, Scheme("nf4", W, 2), layer=2),
         ValueError, "target leaf ['w'] holds NaN or inf (layers [2])"),
    case("a -inf weight", _load_non_finite(-np.inf, "int4", layer=0), ValueError,
         "target leaf ['w'] holds NaN or inf (layers [0])"),
]


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", NON_FINITE)
def test_a_non_finite_weight_is_refused(call, error, words):
    assert_refused(call, error, words)


def test_the_default_targets_skip_ints_and_vectors():
    """What the rows above refuse by name, the default leaves alone: int and 1-D leaves."""
    got = stackwise.load_checkpoint(CKPT, TARGET, NAMES, quantize="int4")
    assert isinstance(got["w"], stackwise.quant.Quantized)
    assert got["k"].dtype == jnp.int32 and got["n"].shape == (N, 6)
