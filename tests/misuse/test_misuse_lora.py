"""The misuse catalogue of `stackwise.lora` and `stackwise.quant`: one row per bad call, the
error it must raise and words its message must hold (the argument or leaf, and the fix)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _misuse import assert_refused, case

import stackwise

KEY = jax.random.key(0)
N = 3
BASE = {"w": jnp.ones((N, 4, 6)), "c": jnp.ones((N, 1, 6)), "t": jnp.ones((N, 2, 2, 2))}
W = ["['w']"]


def _adapters(base=BASE, **kw):
    return stackwise.lora.init(KEY, base, rank=2, targets=W, **kw)


def _dora_misfit():
    lw = _adapters(dora=True)["w"]
    bad = stackwise.lora.LoraWeights(lw.a, lw.b, lw.alpha, magnitude=lw.magnitude[:, :4])
    stackwise.lora.attach(BASE, {"w": bad, "c": None, "t": None})


def _other_depth():
    short = jax.tree.map(lambda v: v[:2], BASE)
    stackwise.lora.attach(BASE, _adapters(short))


def _other_structure():
    stackwise.lora.attach(BASE, {"w": _adapters()["w"]})


def _not_fitting():
    wide = {"w": jnp.ones((N, 5, 6)), "c": BASE["c"], "t": BASE["t"]}
    stackwise.lora.attach(BASE, _adapters(wide))


def _wrong_thing():
    stackwise.lora.attach(BASE, {"w": jnp.ones((N, 4, 2)), "c": None, "t": None})


def _flat_adapter():
    lw = _adapters()["w"]
    bad = stackwise.lora.LoraWeights(lw.a[0], lw.b[0], lw.alpha)
    stackwise.lora.attach(BASE, {"w": bad, "c": None, "t": None})


def _adapter_on_a_vector():
    base = {"w": jnp.ones((N, 4))}
    lw = _adapters()["w"]
    stackwise.lora.attach(base, {"w": lw})


def _mixed_batches():
    base = {"u": BASE["w"], "v": BASE["w"]}
    one = stackwise.lora.init(KEY, base, rank=2)
    batch = stackwise.lora.stack_adapters([one, one])
    stackwise.lora.attach(base, {"u": batch["u"], "v": one["v"]})


def _batch_updating_state():
    """A state updated from each group's rows (a running sum): one state cannot hold g."""
    batch = stackwise.lora.stack_adapters([_adapters(), _adapters()])
    layers = stackwise.lora.stack(lambda p, s, x: (x @ p["w"].T @ p["w"], s + jnp.sum(x)), N,
                                  with_state=True)
    layers.apply(stackwise.lora.attach(BASE, batch), jnp.zeros(N), jnp.ones((2, 1, 6)))


def _batch_without_groups_first():
    batch = stackwise.lora.stack_adapters([_adapters()] * 3)
    layers = stackwise.lora.stack(lambda p, x: x @ p["w"].T @ p["w"], N)
    layers.apply(stackwise.lora.attach(BASE, batch), jnp.ones((2, 1, 6)))


def _two_batch_sizes_in_a_layer():
    two = stackwise.lora.attach(BASE, stackwise.lora.stack_adapters([_adapters()] * 2))
    three = stackwise.lora.attach(BASE, stackwise.lora.stack_adapters([_adapters()] * 3))
    layers = stackwise.lora.stack(lambda p, x: x, N)
    layers.apply({"a": two, "b": three}, jnp.ones((2, 1, 6)))


def _merge_a_batch():
    stackwise.lora.merge(BASE, stackwise.lora.stack_adapters([_adapters(), _adapters()]))


def _unmerge_from_quantized():
    """`merge` requantizes a quantized base; `unmerge` cannot give its codes back."""
    base = stackwise.quant.quantize(BASE, "int8", targets=W)
    stackwise.lora.unmerge(stackwise.lora.merge(base, _adapters(base)), _adapters(base))


def _combine_mismatched():
    trainable, frozen = stackwise.lora.split(stackwise.lora.attach(BASE, _adapters()))
    stackwise.lora.combine(trainable, {"w": frozen.base["w"]})


INTS = {"w": BASE["w"], "i": jnp.ones((N, 4, 6), jnp.int32)}


def _quantized_adapters():
    """Adapters whose `a` went through the quantizer (built by hand: quantize refuses them)."""
    lw = _adapters()["w"]
    a = stackwise.quant.quantize({"a": lw.a})["a"]
    return {"w": stackwise.lora.LoraWeights(a, lw.b, lw.alpha), "c": None, "t": None}


def _merge_into_ints():
    """Adapters made on the float base, merged into a base whose leaf is int32."""
    adapters = stackwise.lora.init(KEY, {"w": BASE["w"], "i": BASE["w"]}, rank=2)
    stackwise.lora.merge(INTS, adapters)


def _stack_unlike_adapters():
    stackwise.lora.stack_adapters(
        [_adapters(), stackwise.lora.init(KEY, BASE, rank=1, targets=W)])


LORA = [
    case("rank larger than the layer", lambda: stackwise.lora.init(KEY, BASE, rank=5, targets=W),
         ValueError, "rank 5 is larger", "['w']", "(4, 6)", "smaller `rank`"),
    case("rank zero", lambda: stackwise.lora.init(KEY, BASE, rank=0, targets=W),
         ValueError, "`rank` must be at least 1"),
    case("rank a float", lambda: stackwise.lora.init(KEY, BASE, rank=2.0, targets=W),
         TypeError, "`rank` must be an int"),
    case("alpha negative", lambda: _adapters(alpha=-1.0), ValueError, "`alpha` must be positive"),
    case("alpha a string", lambda: _adapters(alpha="8"), TypeError, "`alpha` must be a number"),
    case("alpha infinite", lambda: _adapters(alpha=float("inf")), ValueError,
         "`alpha` must be positive and finite", "got inf", "alpha / rank"),
    case("rslora a string", lambda: _adapters(rslora="yes"), TypeError,
         "`rslora` must be True or False", "str 'yes'"),
    case("dora a number", lambda: _adapters(dora=1), TypeError,
         "`dora` must be True or False", "int 1"),
    case("a DoRA magnitude of another shape", _dora_misfit, ValueError,
         "DoRA adapter ['w'] has magnitude (3, 4)", "one per output column, (3, 6)"),
    case("unmerge DoRA", lambda: stackwise.lora.unmerge(BASE, _adapters(dora=True)),
         ValueError, "adapter ['w'] is DoRA's", "cannot be taken back out",
         "Keep the base"),
    case("adapters of an int dtype", lambda: _adapters(dtype=jnp.int32), ValueError,
         "`dtype` is int32", "give a float dtype"),
    case("an int leaf as a target", lambda: stackwise.lora.init(KEY, INTS, rank=2,
         targets=["['i']"]), ValueError, "base leaf ['i'] is of dtype int32", "rounded away",
         "leave it out of `targets`"),
    case("merging into an int leaf", _merge_into_ints, ValueError, "stackwise.lora.merge",
         "base leaf ['i'] is of dtype int32", "rounded away"),
    case("attaching quantized adapters", lambda: stackwise.lora.attach(
        BASE, _quantized_adapters()), TypeError, "adapter ['w']'s `a` is quantized",
        "stackwise.lora.attach(stackwise.quant.quantize(base), adapters)"),
    case("merging quantized adapters", lambda: stackwise.lora.merge(
        BASE, _quantized_adapters()), TypeError, "stackwise.lora.merge",
        "adapter ['w']'s `a` is quantized"),
    case("adapters for an attached tree", lambda: stackwise.lora.init(
        KEY, stackwise.lora.attach(BASE, _adapters()), rank=2), TypeError,
        "`params` holds base and adapters attached at <root>", "`params.base`"),
    case("a seed for a key", lambda: stackwise.lora.init(0, BASE, rank=2, targets=W),
         TypeError, "`key`", "jax.random.key"),
    case("target not 2-D per layer",
         lambda: stackwise.lora.init(KEY, BASE, rank=1, targets=["['t']"]),
         ValueError, "['t']", "2-D (in, out)", "leave it out of `targets`"),
    case("unknown target path", lambda: stackwise.lora.init(KEY, BASE, rank=1, targets=["w"]),
         ValueError, "not leaf paths", "['w']", "keystr"),
    case("predicate returning a non-bool",
         lambda: stackwise.lora.init(KEY, BASE, rank=1, targets=lambda p, s: s),
         TypeError, "must return a bool", "`targets(path, shape)`"),
    case("predicate choosing nothing",
         lambda: stackwise.lora.init(KEY, BASE, rank=1, targets=lambda p, s: False),
         ValueError, "chose no leaf"),
    case("adapters of another depth", _other_depth, ValueError, "adapters of another depth",
         "n=3", "stackwise.lora.init"),
    case("merging adapters of another depth", lambda: stackwise.lora.merge(
        BASE, _adapters(jax.tree.map(lambda v: v[:2], BASE))), ValueError,
        "stackwise.lora.merge", "adapters of another depth", "n=3"),
    case("a batch of adapters of another depth", lambda: stackwise.lora.attach(
        BASE, stackwise.lora.stack_adapters([_adapters(jax.tree.map(lambda v: v[:2], BASE))] * 2)),
        ValueError, "adapters of another depth", "n=3"),
    case("a rank larger than the layer's other side",
         lambda: stackwise.lora.init(KEY, {"w": jnp.ones((N, 8, 3))}, rank=4), ValueError,
         "rank 4 is larger", "(8, 3)"),
    case("splitting a tree without adapters",
         lambda: stackwise.lora.split(stackwise.quant.quantize(BASE, targets=W)), ValueError,
         "holds no adapters", "stackwise.lora.attach(base, stackwise.lora.init("),
    case("adapters of another structure", _other_structure, ValueError,
         "not shaped like the base", "stackwise.lora.init(key, base"),
    case("adapters of another width", _not_fitting, ValueError, "do not fit", "['w']"),
    case("an array where an adapter belongs", _wrong_thing, TypeError,
         "where a `LoraWeights` or None belongs", "['w']"),
    case("an adapter without its layer axis", _flat_adapter, ValueError,
         "expected a (n, in, r)"),
    case("an adapter on a vector", _adapter_on_a_vector, ValueError, "not (n, in, out)"),
    case("a batch mixed with one adapter", _mixed_batches, ValueError, "mix batch sizes",
         "stack_adapters"),
    case("a batch of adapters updating one state", _batch_updating_state, ValueError,
         "stackwise.lora.wrap", "batch of 2 adapters", "new state", "different for each group",
         "v[j]", "stackwise.lora.merge"),
    case("a batch of 3 adapters on x of 2 groups", _batch_without_groups_first, ValueError,
         "batch of 3 adapters", "`x` has shape (2, 1, 6)", "g=3", "x.reshape(3, -1"),
    case("two batch sizes in one layer", _two_batch_sizes_in_a_layer, ValueError,
         "batch sizes [2, 3]"),
    case("merging a batch", _merge_a_batch, ValueError, "batch of 2 adapters", "v[j]"),
    case("unmerging from a quantized leaf", _unmerge_from_quantized, ValueError,
         "stackwise.lora.unmerge: base leaf ['w'] is quantized (int8)", "round a second time",
         "Keep the quantized base", "stackwise.quant.dequantize(base)"),
    case("a compute dtype that is no dtype", lambda: stackwise.lora.stack(
        lambda p, x: x, N, dtype="half-ish"), TypeError, "stackwise.lora.wrap",
        "`dtype` must be a float dtype", "'half-ish'"),
    case("an integer compute dtype", lambda: stackwise.lora.wrap(lambda p, x: x,
         dtype=jnp.int8), ValueError, "`dtype` is int8", "jnp.bfloat16"),
    case("combining halves of two trees", _combine_mismatched, ValueError,
         "stackwise.lora.split"),
    case("a batch of adapters of two ranks", _stack_unlike_adapters, ValueError,
         "adapters[1]", "has rank 1 where adapters[0] has rank 2", "one rank"),
    case("a batch of adapters of two alphas", lambda: stackwise.lora.stack_adapters(
        [_adapters(), stackwise.lora.init(KEY, BASE, rank=2, alpha=7.0, targets=W)]),
         ValueError, "differ from adapters 0", "alpha"),
    case("a batch of no adapters", lambda: stackwise.lora.stack_adapters([]), ValueError,
         "at least one"),
    case("wrapping a non-function", lambda: stackwise.lora.wrap({"w": 1}), TypeError,
         "`apply` must be"),
]

QUANT = [
    case("unknown kind", lambda: stackwise.quant.quantize(BASE, "int3"), ValueError,
         "`kind`", "'int8', 'int4', 'nf4'"),
    case("an int target", lambda: stackwise.quant.quantize(
        {"i": jnp.ones((N, 4, 4), jnp.int32)}, targets=["['i']"]), ValueError,
        "of dtype int32", "only float weights"),
    case("quantizing twice", lambda: stackwise.quant.quantize(
        stackwise.quant.quantize(BASE, targets=W), targets=W), ValueError, "already quantized"),
    case("target not 2-D per layer", lambda: stackwise.quant.quantize(BASE, targets=["['t']"]),
         ValueError, "['t']", "2-D (in, out)"),
    case("a block size not dividing the inputs",
         lambda: stackwise.quant.quantize(BASE, "nf4", targets=W, block_size=3), ValueError,
         "['w']", "4 inputs", "`block_size=3` does not divide", "never padded", "e.g. 1"),
    case("a block size of zero", lambda: stackwise.quant.quantize(BASE, block_size=0),
         ValueError, "`block_size` must be at least 1"),
    case("a block size as a float", lambda: stackwise.quant.quantize(BASE, block_size=64.0),
         TypeError, "`block_size` must be an int", "float"),
    case("a block size as a bool", lambda: stackwise.quant.quantize(BASE, block_size=True),
         TypeError, "`block_size` must be an int"),
    case("a block size as the third argument", lambda: stackwise.quant.quantize(
        BASE, "nf4", 2), TypeError, "`targets` must be None", "got int 2",
        "`block_size` is keyword-only, `block_size=2`"),
    case("quantizing base and adapters attached", lambda: stackwise.quant.quantize(
        stackwise.lora.attach(BASE, _adapters()), targets=W), TypeError,
        "holds LoRA adapters at <root>", "Quantize the base alone, then attach",
        "stackwise.lora.attach(stackwise.quant.quantize(base), adapters)"),
    case("quantizing adapters", lambda: stackwise.quant.quantize(_adapters()), TypeError,
         "holds LoRA adapters at ['w']", "adapters stay float"),
    case("a NaN weight", lambda: stackwise.quant.quantize(
        {"w": BASE["w"].at[1, 0, 0].set(jnp.nan)}), ValueError,
        "target leaf ['w'] holds NaN or inf (layers [1])", "leave the leaf out of `targets`"),
    case("double quantization as a string", lambda: stackwise.quant.quantize(
        BASE, "nf4", W, double="fp8"), TypeError, "`double` must be a bool",
        "256 a block", "got str 'fp8'"),
    case("double quantization as a float", lambda: stackwise.quant.quantize(
        BASE, "nf4", W, double=256.0), TypeError, "`double` must be a bool", "float 256.0"),
    case("double quantization of 0 scales a block", lambda: stackwise.quant.quantize(
        BASE, "nf4", W, double=0), ValueError, "`double` must be at least 1", "got 0",
        "pass False"),
    case("dequantizing to an integer dtype", lambda: stackwise.quant.dequantize(
        stackwise.quant.quantize(BASE, targets=W)["w"], jnp.int32), ValueError,
        "stackwise.quant.dequantize: `dtype` is int32"),
    case("a rank-3 weight without contract", lambda: stackwise.quant.quantize(
        BASE, targets=["['t']"]), ValueError, "target leaf ['t'] has shape (2, 2, 2) per layer",
        "not a 2-D (in, out) weight", "`contract={\"['t']\": (0,)}`", "(0, 1) for an (H, Dh, D)"),
    case("contract as a string", lambda: stackwise.quant.quantize(BASE, contract="in"),
         TypeError, "`contract` must be an axis or a tuple of axes", "got str 'in'"),
    case("contract naming a leaf by a non-path", lambda: stackwise.quant.quantize(
        BASE, contract={0: 0}), TypeError, "`contract` maps leaf paths", "the key 0"),
    case("contract of a leaf as a float", lambda: stackwise.quant.quantize(
        BASE, contract={"['t']": 0.0}), TypeError, "`contract`[\"['t']\"] must be an axis",
         "float 0.0"),
    case("contract out of range", lambda: stackwise.quant.quantize(
        BASE, targets=["['t']"], contract=3), ValueError,
         "`contract` gives target leaf ['t'] the axes (3,)", "shape (2, 2, 2) per layer",
         "distinct axes in range(3)"),
    case("contract of every axis", lambda: stackwise.quant.quantize(
        BASE, targets=W, contract=(0, 1)), ValueError, "the axes (0, 1)",
         "at least one axis uncontracted"),
    case("a vector as a target", lambda: stackwise.quant.quantize(
        {"b": jnp.ones((N, 4))}, targets=["['b']"], contract=0), ValueError,
         "target leaf ['b'] has shape (4,) per layer", "a vector has no axis"),
    case("a vector without a layer axis", lambda: stackwise.quant.quantize(
        {"b": jnp.ones(4)}, targets=["['b']"], stacked=False), ValueError,
         "(a weight without a layer axis: `stacked=False`)"),
    case("adapting a projection of rank 3 per layer", lambda: stackwise.lora.init(
        KEY, stackwise.quant.quantize(BASE, targets=["['t']"], contract=0), rank=1,
        targets=["['t']"]), ValueError, "target leaf ['t'] has shape (3, 2, 2, 2)",
        "2-D (in, out) weight per layer"),
    case("stacked as a string", lambda: stackwise.quant.quantize(BASE, stacked="no"),
         TypeError, "`stacked` must be a bool", "str 'no'"),
    case("a lookup in a table quantized along V", lambda: stackwise.quant.take(
        stackwise.quant.quantize(BASE, targets=W)["w"], jnp.array([0])), ValueError,
         "stackwise.quant.take: the table is quantized along its first axis (the default)",
         "contract=1, stacked=False"),
    case("a lookup in a float table", lambda: stackwise.quant.take(BASE["w"], jnp.array([0])),
         TypeError, "`node` must be a stackwise.quant.Quantized table", "got ArrayImpl"),
    case("a lookup of float ids", lambda: stackwise.quant.take(stackwise.quant.quantize(
        BASE, targets=W, contract=1)["w"], jnp.array([0.5])), TypeError,
         "`ids` must be integer token ids", "float32"),
    case("dequantizing to no dtype", lambda: stackwise.quant.dequantize(
        stackwise.quant.quantize(BASE, targets=W)["w"], "eight"), TypeError,
        "`dtype` must be a float dtype", "str 'eight'"),
]


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", LORA + QUANT)
def test_refused(call, error, words):
    assert_refused(call, error, words)


# --------------------------------------------------------------------------
# PEFT's layout.

MODULES = {"['w']": "self_attn.q_proj"}


def _saved(tmp_path, base=BASE, **config):
    folder = tmp_path / "adapter"
    stackwise.lora.save_peft(folder, _adapters(base), MODULES)
    if config:
        path = folder / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


def _save_batch(tmp_path):
    batch = stackwise.lora.stack_adapters([_adapters(), _adapters()])
    stackwise.lora.save_peft(tmp_path / "a", batch, MODULES)


def _save_two_scalings(tmp_path):
    base = {"u": BASE["w"], "v": BASE["w"]}
    one = stackwise.lora.init(KEY, base, rank=2, targets=["['u']"])
    two = stackwise.lora.init(KEY, base, rank=2, targets=["['v']"], rslora=True)
    stackwise.lora.save_peft(tmp_path / "a", {"u": one["u"], "v": two["v"]},
                             {"['u']": "q_proj", "['v']": "v_proj"})


def _load_onto_fewer_layers(tmp_path):
    short = jax.tree.map(lambda v: v[:2], BASE)
    stackwise.lora.load_peft(_saved(tmp_path), short, MODULES)


def _load_onto_more_layers(tmp_path):
    long = jax.tree.map(lambda v: jnp.concatenate([v, v]), BASE)
    stackwise.lora.load_peft(_saved(tmp_path), long, MODULES)


def _load_onto_another_width(tmp_path):
    wide = {**BASE, "w": jnp.ones((N, 5, 6))}
    stackwise.lora.load_peft(_saved(tmp_path), wide, MODULES)


def _load_with(config):
    def call(tmp_path):
        stackwise.lora.load_peft(_saved(tmp_path, **config), BASE, MODULES)
    return call


def _saved_dora(tmp_path):
    folder = tmp_path / "dora"
    stackwise.lora.save_peft(folder, _adapters(dora=True), MODULES)
    return folder


def _load_dora_with(config):
    def call(tmp_path):
        folder = _saved_dora(tmp_path)
        path = folder / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
        tensors = folder / "adapter_model.safetensors"
        from safetensors import numpy as safetensors_numpy

        kept = {k: v for k, v in safetensors_numpy.load_file(tensors).items()
                if ".layers.2." not in k}
        safetensors_numpy.save_file(kept, tensors)
        stackwise.lora.load_peft(folder, BASE, MODULES)
    return call


def _save_dora_and_plain(tmp_path):
    base = {"u": BASE["w"], "v": BASE["w"]}
    one = stackwise.lora.init(KEY, base, rank=2, targets=["['u']"])
    two = stackwise.lora.init(KEY, base, rank=2, targets=["['v']"], dora=True)
    stackwise.lora.save_peft(tmp_path / "a", {"u": one["u"], "v": two["v"]},
                             {"['u']": "q_proj", "['v']": "v_proj"})


def _load_with_tensor(config, name):
    """A config edited as `_load_with`, and one more tensor in the file."""
    def call(tmp_path):
        from safetensors import numpy as safetensors_numpy

        folder = _saved(tmp_path, **config)
        path = folder / "adapter_model.safetensors"
        tensors = safetensors_numpy.load_file(path)
        safetensors_numpy.save_file({**tensors, name: np.zeros((6,), np.float32)}, path)
        stackwise.lora.load_peft(folder, BASE, MODULES)
    return call


def _load_other_modules(tmp_path):
    """Files that adapt k_proj, loaded as if they adapted q_proj."""
    folder = tmp_path / "adapter"
    stackwise.lora.save_peft(folder, _adapters(), {"['w']": "self_attn.k_proj"})
    stackwise.lora.load_peft(folder, BASE, MODULES)


def _load_without_config(tmp_path):
    folder = _saved(tmp_path)
    (folder / "adapter_config.json").unlink()
    stackwise.lora.load_peft(folder, BASE, MODULES)


def _load_config_text(text):
    def call(tmp_path):
        folder = _saved(tmp_path)
        (folder / "adapter_config.json").write_text(text)
        stackwise.lora.load_peft(folder, BASE, MODULES)
    return call


def _save_as(modules, adapters=None, base=BASE, **kw):
    def call(tmp_path):
        stackwise.lora.save_peft(tmp_path / "a", _adapters(base) if adapters is None
                                 else adapters(), modules, **kw)
    return call


TWO = {"u": BASE["w"], "v": BASE["w"]}
PATTERN = (BASE, BASE)  # a pattern of two positions, each a stack of N layers


def _save_twice(tmp_path):
    _saved(tmp_path)
    _saved(tmp_path)


def _save_over_a_file(tmp_path):
    (tmp_path / "a").write_text("the user's notes")
    try:
        stackwise.lora.save_peft(tmp_path / "a", _adapters(), MODULES, overwrite=True)
    finally:
        assert (tmp_path / "a").read_text() == "the user's notes"  # left as it was


def _peft_modules(names, adapters=None):
    def call(tmp_path):
        del tmp_path
        return stackwise.lora.peft_modules(names, _adapters() if adapters is None else adapters)
    return call


def _two_prefixes():
    two = {"w": BASE["w"], "v": BASE["w"]}
    adapters = stackwise.lora.init(KEY, two, rank=2, targets=["['w']", "['v']"])
    return stackwise.lora.peft_modules(
        {"w": "model.layers.{}.q_proj.weight", "v": "vision.layers.{}.q_proj.weight"}, adapters)


PEFT = [
    case("names: a name without a layer field",
         _peft_modules({"w": "lm_head.weight"}), ValueError,
         "['w']", "'lm_head.weight'", "no layer field", "'<layers>.{}.<module>.weight'"),
    case("names: two layer fields", _peft_modules({"w": "m.{}.x.{}.weight"}), ValueError,
         "more than one layer field"),
    case("names: a bias, not a weight", _peft_modules({"w": "model.layers.{}.q_proj.bias"}),
         ValueError, "no `.weight` at its end"),
    case("names: a leaf loaded reshaped (a fused qkv split)", _peft_modules(
        {"w": stackwise.Tensor("transformer.h.{}.attn.c_attn.weight", reshape=(4, 6))}),
         ValueError, "['w']", "reshaped to (4, 6)", "fused projection", "GPT-2's c_attn",
         "without `reshape=`"),
    case("names: a leaf not named", _peft_modules({"c": "model.layers.{}.c.weight"}),
         ValueError, "no tensor name for the target's leaf ['w']"),
    case("names: no adapters", _peft_modules({"w": "model.layers.{}.q.weight"}, BASE),
         TypeError, "holds no LoRA adapters"),
    case("names: layers under two prefixes", lambda t: _two_prefixes(), ValueError,
         "'model.layers.{}'", "'vision.layers.{}'", "different files"),
    case("save: modules not a mapping",
         lambda t: stackwise.lora.save_peft(t / "a", _adapters(), ["q_proj"]), TypeError,
         "`modules` maps each adapted leaf's path"),
    case("save: modules of other leaves",
         lambda t: stackwise.lora.save_peft(t / "a", _adapters(), {"['c']": "q_proj"}),
         ValueError, "one module name per adapted leaf"),
    case("save: a batch", _save_batch, ValueError, "batch of 2 adapters", "v[j]"),
    case("save: rsLoRA and plain LoRA", _save_two_scalings, ValueError,
         "alpha / sqrt(r) (rsLoRA)", "one `use_rslora`", "rslora="),
    case("save: over an adapter", _save_twice, FileExistsError, "overwrite=True"),
    case("save: over a file, with overwrite", _save_over_a_file, ValueError, "is a file",
         "PEFT's layout is a folder", "replaces a folder only"),
    case("save: layers without {i}", _save_as(MODULES, layers="model.layers"), ValueError,
         "`layers` is 'model.layers'", "one `{i}`", "a file would keep the last layer only"),
    case("save: layers of two fields", _save_as(MODULES, layers="m.{i}.{j}"), ValueError,
         "`layers` is 'm.{i}.{j}', with fields ['i', 'j']"),
    case("save: layers with unbalanced braces", _save_as(MODULES, layers="m.{i"), ValueError,
         "unbalanced braces"),
    case("save: layers not a str", _save_as(MODULES, layers=3), TypeError,
         "`layers` names layer i", "int 3"),
    case("save: two leaves to one module", _save_as(
        {"['u']": "self_attn.q_proj", "['v']": "self_attn.q_proj"},
        lambda: stackwise.lora.init(KEY, TWO, rank=2)), ValueError,
        "maps both ['u'] and ['v'] to 'self_attn.q_proj'", "one would overwrite the other",
        "its own module."),
    case("save: a module named as its weight", _save_as({"['w']": "self_attn.q_proj.weight"}),
         ValueError, "'self_attn.q_proj.weight', a tensor's name, not a module's",
         "give 'self_attn.q_proj'"),
    case("save: a module named 'weight'", _save_as({"['w']": "weight"}), ValueError,
         "'weight', a tensor's name", "e.g. 'self_attn.q_proj'"),
    case("save: a module name that is not one", _save_as({"['w']": "q proj"}), ValueError,
         "maps ['w'] to 'q proj', not a module name"),
    case("save: a base model that is not a name", _save_as(
        MODULES, base_model_name_or_path=3), TypeError, "`base_model_name_or_path`",
        "give a str", "int 3"),
    case("save: quantized adapters", _save_as(MODULES, _quantized_adapters), TypeError,
         "stackwise.lora.save_peft: adapter ['w']'s `a` is quantized"),
    case("save: the attached tree", _save_as(
        MODULES, lambda: stackwise.lora.attach(BASE, _adapters())), TypeError,
        "`adapters` holds base and adapters attached at <root>", "`params.adapters`"),
    case("load: layers without {i}", lambda t: stackwise.lora.load_peft(
        _saved(t), BASE, MODULES, layers="model.layers"), ValueError, "one `{i}`"),
    case("load: an int dtype", lambda t: stackwise.lora.load_peft(
        _saved(t), BASE, MODULES, dtype=jnp.int8), ValueError, "`dtype` is int8",
        "would truncate", "give a float dtype"),
    case("load: a dtype that is not one", lambda t: stackwise.lora.load_peft(
        _saved(t), BASE, MODULES, dtype="float33"), TypeError,
        "`dtype` must be a dtype or None", "'float33'"),
    case("load: lora_alpha null", _load_with({"lora_alpha": None}), ValueError,
         "lora_alpha=None", "finite positive number"),
    case("load: lora_alpha infinite", _load_with({"lora_alpha": float("inf")}), ValueError,
         "lora_alpha=inf"),
    case("load: r a string", _load_with({"r": "2"}), ValueError, "r='2'", "an int of at least 1"),
    case("load: bias all, with trained biases", _load_with_tensor(
        {"bias": "all"}, "base_model.model.model.layers.0.self_attn.q_proj.bias"), ValueError,
         "bias='all'", "stackwise does not support", "holds 1 trained biases",
         "layers.0.self_attn.q_proj.bias", "loads bias='none'"),
    case("load: a peft_version of no release, where it decides modules_to_save",
         _load_with_tensor({"modules_to_save": ["norm"], "peft_version": "main"},
                           "base_model.model.model.layers.0.xnorm.weight"), ValueError,
         "peft_version='main'", "a release there, such as '0.21.2'",
         "the module of model.layers.0.xnorm.weight before peft 0.22.0",
         "the version of the PEFT that wrote the file"),
    case("load: modules_to_save, without asking for them", _load_with_tensor(
        {"modules_to_save": ["lm_head"]}, "base_model.model.lm_head.weight"), ValueError,
         "modules_to_save=['lm_head']", "holds full trained copies", "e.g. lm_head.weight",
         "would lose", "`modules_to_save=True`", "adapters, saved ="),
    case("load: modules_to_save a str", _load_with({"modules_to_save": "lm_head"}),
         ValueError, "modules_to_save='lm_head'", "a list of module names"),
    case("load: modules_to_save= not a bool", lambda t: stackwise.lora.load_peft(
        _saved(t), BASE, MODULES, modules_to_save="lm_head"), TypeError,
         "`modules_to_save` must be True or False", "str 'lm_head'"),
    case("save: modules_to_save not a mapping",
         _save_as(MODULES, modules_to_save=["lm_head"]), TypeError,
         "`modules_to_save` maps each saved tensor's name", "list ['lm_head']"),
    case("save: modules_to_save names a module, not a tensor",
         _save_as(MODULES, modules_to_save={"lm_head": jnp.ones((4, 4))}), ValueError,
         "names 'lm_head', not a tensor's name", "'lm_head.weight'"),
    case("save: modules_to_save names an adapted module", _save_as(
        MODULES, modules_to_save={"model.layers.0.self_attn.q_proj.weight": jnp.ones((4, 4))}),
         ValueError, "of module 'model.layers.0.self_attn.q_proj', which holds an adapter",
         "PEFT adapts no module it saves whole"),
    case("save: modules_to_save of a whole layer", _save_as(
        MODULES, modules_to_save={"model.layers.1.weight": jnp.ones((4, 4))}),
         ValueError, "of module 'model.layers.1', which holds an adapter "
         "(model.layers.1.self_attn.q_proj)"),
    case("save: modules_to_save an int tensor", _save_as(
        MODULES, modules_to_save={"lm_head.weight": jnp.ones((4, 4), jnp.int32)}), TypeError,
         "`modules_to_save`['lm_head.weight'] is of dtype int32", "float tensor"),
    case("save: modules_to_save a quantized tensor", _save_as(
        MODULES, modules_to_save={"lm_head.weight": stackwise.quant.quantize(
            {"w": jnp.ones((1, 4, 4))})["w"]}), TypeError,
         "`modules_to_save`['lm_head.weight'] is quantized", "(dequantized)"),
    case("save: modules_to_save a list", _save_as(
        MODULES, modules_to_save={"lm_head.weight": [[1.0]]}), TypeError,
         "`modules_to_save`['lm_head.weight'] is list"),
    case("load: layers_to_transform, with the left-out layer's tensors",
         _load_with({"layers_to_transform": [0, 1]}), ValueError,
         "layers.2.self_attn.q_proj.lora_A.weight", "fit no layer",
         "layers_to_transform leave without an adapter"),
    case("load: into a served base", lambda t: stackwise.lora.load_peft(
        _saved(t), stackwise.to_serving(BASE), MODULES), TypeError,
        "`base` is in the serving layout", "stackwise.from_serving(tree)"),
    case("load: into the attached tree", lambda t: stackwise.lora.load_peft(
        _saved(t), stackwise.lora.attach(BASE, _adapters()), MODULES), TypeError,
        "`base` holds base and adapters attached", "`params.base`"),
    case("load: no such folder",
         lambda t: stackwise.lora.load_peft(t / "none", BASE, MODULES), FileNotFoundError,
         "adapter_config.json", "save_pretrained"),
    case("load: files of a deeper model", _load_onto_fewer_layers, ValueError,
         "fit no layer of the base", "layers.2.self_attn.q_proj", "another model"),
    case("load: files of a shallower model", _load_onto_more_layers, ValueError,
         "layers.3.self_attn.q_proj.lora_A.weight is missing", "another model"),
    case("load: files of another width", _load_onto_another_width, ValueError,
         "of shape (2, 4), expected (2, 5)", "another model"),
    case("load: DoRA without its magnitudes", _load_with({"use_dora": True}), ValueError,
         "layers.0.self_attn.q_proj.lora_magnitude_vector is missing", "another model"),
    case("load: another PEFT type", _load_with({"peft_type": "IA3"}), ValueError,
         "peft_type='IA3'"),
    case("load: files of other target modules", _load_other_modules, ValueError,
         "layers.0.self_attn.q_proj.lora_A.weight is missing", "another model", "`modules`"),
    case("load: no adapter_config.json", _load_without_config, FileNotFoundError,
         "lacks adapter_config.json", "save_pretrained"),
    case("load: a config that is not JSON", _load_config_text("{r: 2"), ValueError,
         "is not JSON", "save_pretrained"),
    case("load: a config without a rank", _load_config_text('{"peft_type": "LORA"}'),
         ValueError, "lacks ['r', 'lora_alpha']", "not a PEFT adapter config"),
    case("load: a config that is a list", _load_config_text("[]"), ValueError,
         "lacks ['peft_type', 'r', 'lora_alpha']"),
    case("load: a module not in the base",
         lambda t: stackwise.lora.load_peft(_saved(t), BASE, {"['x']": "q_proj"}), ValueError,
         "`modules` names [\"['x']\"]", "not leaf paths"),
    case("save: an unknown weight layout",
         lambda t: stackwise.lora.save_peft(t / "a", _adapters(), MODULES, layout="torch"),
         ValueError, "`layout` is 'torch'", "'in_out'", "'out_in'"),
    case("load: an unknown weight layout",
         lambda t: stackwise.lora.load_peft(_saved(t), BASE, MODULES, layout=None), ValueError,
         "`layout` is None", "Equinox"),
]


# PEFT's LoraConfig fields stackwise does not apply: each refused by name, with its value and
# what stackwise loads (docs/finetune.md's table).
REFUSED_FIELDS = {
    "lora_bias": True, "trainable_token_indices": [0, 1], "layer_replication": [[0, 2]],
    "target_parameters": ["experts.down_proj"], "alora_invocation_tokens": [5],
    "use_qalora": True, "megatron_config": {"tp": 2}, "velora_config": {"rank": 2},
    "monteclora_config": {"num_samples": 2}, "use_bdlora": {"nblocks": 2},
    "arrow_config": {"top_k": 2}, "kasa_config": {"beta": 1.0},
}
PEFT_FIELDS = [
    case(f"load: {field}", _load_with({field: value}), ValueError, f"{field}={value!r}",
         "stackwise does not support", "stackwise loads LoRA (W + scale * B A", f"{field} unset")
    for field, value in REFUSED_FIELDS.items()
] + [
    case("load: a field stackwise does not know", _load_with({"lora_magic": 3}), ValueError,
         "lora_magic=3", "a field stackwise does not know",
         "stackwise loads LoRA (W + scale * B A"),
    case("load: use_rslora a string", _load_with({"use_rslora": "yes"}), ValueError,
         "use_rslora='yes'", "true or false"),
    case("load: use_dora a string", _load_with({"use_dora": "yes"}), ValueError,
         "use_dora='yes'", "true or false"),
    case("load: DoRA with layers left without adapters", _load_dora_with(
        {"layers_to_transform": [0, 1]}), ValueError, "use_dora=True",
         "with layers_to_transform PEFT leaves some layers of ['w'] without an adapter",
         "a DoRA adapter cannot stand for none", "DoRA on every layer of a module"),
    case("load: DoRA with a module PEFT adapts on no layer", _load_dora_with(
        {"exclude_modules": ["q_proj"]}), ValueError, "use_dora=True",
         "with exclude_modules PEFT leaves some layers of ['w'] without an adapter",
         "PEFT adapts ['w']'s module on no layer: leave it out of `modules`"),
    case("load: DoRA onto an (out, in) base", lambda t: stackwise.lora.load_peft(
        _saved_dora(t), {**BASE, "w": jnp.ones((N, 6, 4))}, MODULES, layout="out_in"),
         ValueError, "use_dora=True", "columns of weights used as x @ W",
         "layout='in_out'"),
    case("save: DoRA beside plain LoRA", _save_dora_and_plain, ValueError,
         "some adapters are DoRA's", "one `use_dora`", "dora="),
    case("save: DoRA with layout out_in", _save_as(
        MODULES, lambda: _adapters(dora=True), layout="out_in"), ValueError,
         "DoRA adapters with layout='out_in'", "layout='in_out'"),
    case("load: a rank_pattern rank of 0", _load_with({"rank_pattern": {"q_proj": 0}}),
         ValueError, "rank_pattern={'q_proj': 0}", "an int rank of at least 1"),
    case("load: a rank_pattern that is a list", _load_with({"rank_pattern": [["q_proj", 2]]}),
         ValueError, "rank_pattern=[['q_proj', 2]]", "maps module-name patterns"),
    case("load: an alpha_pattern alpha of inf",
         _load_with({"alpha_pattern": {"q_proj": float("inf")}}), ValueError,
         "alpha_pattern={'q_proj': inf}", "a finite positive alpha"),
    case("load: a rank_pattern key that is no regex", _load_with({"rank_pattern": {"q(": 2}}),
         ValueError, "rank_pattern={'q(': 2}", "its key 'q(' is not a regular expression"),
    case("load: rank_pattern per layer", _load_with(
        {"rank_pattern": {r"model\.layers\.1\.self_attn\.q_proj": 1}}), ValueError,
        "rank_pattern=", "several (rank, alpha) pairs", "one rank and alpha for all its layers",
        "e.g. 'q_proj', not one layer's"),
    case("load: alpha_pattern per layer", _load_with(
        {"alpha_pattern": {"layers.0.self_attn.q_proj": 1}}), ValueError,
        "alpha_pattern={'layers.0.self_attn.q_proj': 1}", "several (rank, alpha) pairs",
        "model.layers.0.self_attn.q_proj: (2, 1)"),
    case("load: layers_to_transform a string", _load_with({"layers_to_transform": "0"}),
         ValueError, "layers_to_transform='0'", "a layer index or a list of them"),
    case("load: layers_pattern a number", _load_with(
        {"layers_to_transform": [0], "layers_pattern": 3}), ValueError, "layers_pattern=3",
        "a str or a list of str"),
    case("load: exclude_modules a dict", _load_with({"exclude_modules": {"q_proj": 1}}),
         ValueError, "exclude_modules={'q_proj': 1}", "a str or a list of str"),
    case("load: layers_pattern alone", _load_with({"layers_pattern": "layers"}), ValueError,
         "layers_pattern='layers'", "only with layers_to_transform"),
    case("load: lora_dropout above 1", _load_with({"lora_dropout": 2}), ValueError,
         "lora_dropout=2", "a probability in [0, 1]"),
    case("load: lora_dropout of 1", _load_with({"lora_dropout": 1.0}), ValueError,
         "lora_dropout=1.0", "drops every input", "would never train", "[0, 1)"),
    case("load: bias of another kind", _load_with({"bias": "some"}), ValueError,
         "bias='some'", "'none', 'all' or 'lora_only'"),
    case("load: a PiSSA adapter", _load_with({"init_lora_weights": "pissa"}), ValueError,
         "init_lora_weights='pissa'", "changed the base weights",
         "path_initial_model_for_weight_conversion", "'gaussian'"),
    case("save: lora_dropout above 1", _save_as(MODULES, lora_dropout=1.5), ValueError,
         "`lora_dropout` is 1.5", "a number in [0, 1)", "would never train"),
    case("save: lora_dropout of 1", _save_as(MODULES, lora_dropout=1), ValueError,
         "`lora_dropout` is 1", "a number in [0, 1)"),
    case("save: lora_dropout a string", _save_as(MODULES, lora_dropout="0.1"), TypeError,
         "`lora_dropout` must be a number", "str '0.1'"),
]


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", PEFT_FIELDS)
def test_refused_peft_fields(call, error, words, tmp_path):
    assert_refused(lambda: call(tmp_path), error, words)


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", PEFT)
def test_refused_peft(call, error, words, tmp_path):
    assert_refused(lambda: call(tmp_path), error, words)


# A pattern's adapters (a tuple of k stacked trees, position p holding layers p, p+k, ...):
# `pattern=k` numbers position p's row j as layer p + j*k; every name checked first.
PATTERN_W = ["[0]['w']", "[1]['w']"]
PATTERN_MODULES = {"[0]['w']": "self_attn.q_proj", "[1]['w']": "self_attn.q_proj"}


def _pattern_adapters(base=PATTERN):
    return stackwise.lora.init(KEY, base, rank=2, targets=PATTERN_W)


def _pattern_saved(tmp_path):
    folder = tmp_path / "adapter"
    stackwise.lora.save_peft(folder, _pattern_adapters(), PATTERN_MODULES, pattern=2)
    return folder


def _uneven(n0, n1):
    """A pattern whose positions hold n0 and n1 layers."""
    return (jax.tree.map(lambda v: v[:n0], BASE), jax.tree.map(lambda v: v[:n1], BASE))


def _save_uneven_depths(tmp_path):
    one = _adapters()
    short = _adapters(jax.tree.map(lambda v: v[:2], BASE))
    stackwise.lora.save_peft(tmp_path / "a", {"u": one["w"], "v": short["w"]},
                             {"['u']": "q_proj", "['v']": "v_proj"})


PEFT_PATTERN = [
    case("save: a pattern without pattern=", _save_as(PATTERN_MODULES, _pattern_adapters),
         TypeError, "`adapters` is a tuple of 2 trees", "pass `pattern=2`",
         "numbered from 0, as the wrong layers"),
    case("load: a pattern without pattern=", lambda t: stackwise.lora.load_peft(
        _pattern_saved(t), PATTERN, PATTERN_MODULES), TypeError,
        "`base` is a tuple of 2 trees", "pass `pattern=2`"),
    case("save: pattern not an int", _save_as(PATTERN_MODULES, _pattern_adapters,
                                              pattern="2"), TypeError,
         "`pattern` must be None or the number k", "str '2'"),
    case("save: pattern of another length", _save_as(PATTERN_MODULES, _pattern_adapters,
                                                     pattern=3), TypeError,
         "with pattern=3, `adapters` must be a tuple of 3 stacked trees",
         "got a tuple of 2 trees"),
    case("load: pattern= for one stack", lambda t: stackwise.lora.load_peft(
        _saved(t), BASE, MODULES, pattern=2), TypeError,
        "with pattern=2, `base` must be a tuple of 2 stacked trees", "got dict"),
    case("save: two leaves of one position to one module", _save_as(
        {"[0]['u']": "self_attn.q_proj", "[0]['v']": "self_attn.q_proj"},
        lambda: stackwise.lora.init(KEY, (TWO, TWO), rank=2, targets=["[0]['u']", "[0]['v']"]),
        pattern=2), ValueError, "maps both [0]['u'] and [0]['v'] to 'self_attn.q_proj'",
        "of one pattern position"),
    case("save: leaves of one stack of different depths", _save_uneven_depths, ValueError,
         "hold different numbers of layers (['u']: 3, ['v']: 2)", "`stackwise.lora.init`"),
    case("save: positions in the wrong order", _save_as(
        PATTERN_MODULES, lambda: _pattern_adapters(_uneven(2, 3)), pattern=2), ValueError,
        "position 0: 2, position 1: 3 layers, which no depth gives", "in order"),
    case("load: positions no model has", lambda t: stackwise.lora.load_peft(
        _pattern_saved(t), _uneven(3, 1), PATTERN_MODULES, pattern=2), ValueError,
        "position 0: 3, position 1: 1 layers, which no depth gives"),
]


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", PEFT_PATTERN)
def test_refused_peft_pattern_before_writing(call, error, words, tmp_path):
    before = sorted(p.name for p in tmp_path.iterdir())
    assert_refused(lambda: call(tmp_path), error, words)
    after = sorted(p.name for p in tmp_path.iterdir())
    assert after == before or after == ["adapter"]  # (a load's own folder, saved first)


def _model():
    base = stackwise.quant.quantize(BASE, targets=W)
    return stackwise.lora.attach(base, _adapters(base))


def _to_stackwise_optax(which):
    def call():
        import optax

        import stackwise.optax

        model = _model()
        if which == "layerwise":
            stackwise.optax.layerwise(optax.adam(1e-3)).init(
                {"base": stackwise.quant.quantize(BASE, targets=W), "adapters": _adapters()})
        elif which == "attached":  # the whole model, adapters and base
            stackwise.optax.layerwise(optax.adam(1e-3)).init(model)
        elif which == "frozen half":  # split's halves swapped
            trainable, frozen = stackwise.lora.split(model)
            stackwise.optax.layerwise(optax.adam(1e-3)).init(frozen)
        elif which == "layer_mask":
            stackwise.optax.layer_mask(optax.adam(1e-3), layers=[0]).init(model)
        else:
            stackwise.optax.muon_dimensions()(model)
    return call


OPTIMIZER = [
    case(f"a quantized leaf to stackwise.optax ({which})", _to_stackwise_optax(which), TypeError,
         "quantized weight", "int8", "Optimize the adapters only", "stackwise.lora.split",
         "tx.init(trainable)")
    for which in ("layerwise", "attached", "frozen half", "layer_mask", "muon_dimensions")
]


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", OPTIMIZER)
def test_a_quantized_leaf_given_to_the_optimizer_is_refused(call, error, words):
    pytest.importorskip("optax")
    assert_refused(call, error, words)


def test_the_trainable_half_goes_to_the_optimizer():
    """What the rows above refuse, done as the message says: no error, adapters only."""
    import optax

    import stackwise.optax

    trainable, _ = stackwise.lora.split(_model())
    state = stackwise.optax.layerwise(optax.adam(1e-3)).init(trainable)
    shapes = {v.shape for v in jax.tree.leaves(state) if getattr(v, "ndim", 0) == 3}
    assert shapes == {(N, 4, 2), (N, 2, 6)}


def test_the_fix_it_names_works_on_a_quantized_base():
    # stackwise.lora.split puts each quantized weight in the frozen half whole: the optimizer
    # takes the trainable half, and moves the adapters only.
    import optax

    import stackwise.optax

    base = stackwise.quant.quantize(BASE, targets=W)
    trainable, frozen = stackwise.lora.split(stackwise.lora.attach(base, _adapters()))
    tx = stackwise.optax.layerwise(optax.adam(1e-3), stackwise.lora.layer_axes(trainable))
    grads = jax.tree.map(jnp.ones_like, trainable)
    updates, _ = tx.update(grads, tx.init(trainable), trainable)
    assert all(bool((u != 0).all()) for u in jax.tree.leaves(updates))
    back = stackwise.lora.combine(updates, frozen).base  # the codes untouched, not copied
    assert all(a is b for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(base), strict=True))
