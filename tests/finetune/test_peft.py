"""Adapters in Hugging Face PEFT's layout: PEFT's documented names, shapes and config; an exact
round trip; the torch-layout tensors meaning the same layer; all-or-nothing writes; and PEFT
itself loading them when it is installed."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _reference import trained

import stackwise

safetensors_numpy = pytest.importorskip("safetensors.numpy")

KEY = jax.random.key(0)
N, D, F = 3, 8, 12
MODULES = {"['q']": "self_attn.q_proj", "['down']": "mlp.down_proj"}
#: The fields of PEFT's `LoraConfig` (peft/tuners/lora/config.py) that a LoRA adapter's
#: `adapter_config.json` holds and that PEFT reads to rebuild the adapter.
PEFT_FIELDS = {"peft_type", "task_type", "base_model_name_or_path", "r", "lora_alpha",
               "target_modules", "lora_dropout", "bias", "fan_in_fan_out", "use_rslora",
               "use_dora", "modules_to_save", "layers_to_transform", "rank_pattern",
               "alpha_pattern", "inference_mode", "init_lora_weights"}


def _base(dtype="float32"):
    k1, k2 = jax.random.split(KEY)
    return {"q": jax.random.normal(k1, (N, D, D)).astype(dtype),
            "down": jax.random.normal(k2, (N, F, D)).astype(dtype),
            "norm": jnp.ones((N, 1, D), dtype)}


def _adapters(base, rank=4, alpha=8.0):
    return trained(stackwise.lora.init(KEY, base, rank=rank, alpha=alpha, targets=list(MODULES)))


def test_layout_is_peft_s(tmp_path):
    adapters = _adapters(_base())
    folder = tmp_path / "adapter"
    files = stackwise.lora.save_peft(folder, adapters, MODULES, base_model_name_or_path="tiny")
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    assert sorted(os.listdir(folder)) == files  # no staging left behind
    assert sorted(os.listdir(tmp_path)) == ["adapter"]
    tensors = safetensors_numpy.load_file(folder / "adapter_model.safetensors")
    want = {}
    for i in range(N):
        for module, (d_in, d_out) in (("self_attn.q_proj", (D, D)), ("mlp.down_proj", (F, D))):
            name = f"base_model.model.model.layers.{i}.{module}"
            want[f"{name}.lora_A.weight"] = (4, d_in)   # torch: (r, in)
            want[f"{name}.lora_B.weight"] = (d_out, 4)  # torch: (out, r)
    assert {k: v.shape for k, v in tensors.items()} == want
    config = json.loads((folder / "adapter_config.json").read_text())
    assert PEFT_FIELDS <= set(config)
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert config["target_modules"] == ["down_proj", "q_proj"]
    assert config["base_model_name_or_path"] == "tiny"


def test_torch_layout_means_the_same_layer(tmp_path):
    """torch's y = x W^T + s (x A^T) B^T with the saved tensors is the wrapped layer's x @ W'."""
    base = _base()
    adapters = _adapters(base)
    stackwise.lora.save_peft(tmp_path / "a", adapters, MODULES)
    tensors = safetensors_numpy.load_file(tmp_path / "a" / "adapter_model.safetensors")
    x = np.asarray(jax.random.normal(jax.random.key(1), (2, D)))
    layers = stackwise.lora.stack(lambda p, x: x @ p["q"], 1)
    for i in range(N):
        name = f"base_model.model.model.layers.{i}.self_attn.q_proj"
        w_torch = np.asarray(base["q"][i]).T                     # nn.Linear's (out, in)
        a, b = tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"]
        y_torch = x @ w_torch.T + adapters["q"].scale * (x @ a.T) @ b.T
        layer = jax.tree.map(lambda v, i=i: v[i : i + 1], (base, adapters))
        y = layers.apply(stackwise.lora.attach(*layer), jnp.asarray(x))
        np.testing.assert_allclose(y, y_torch, rtol=1e-5, atol=1e-5)


def test_out_in_weights_write_the_same_files(tmp_path):
    """An Equinox-style base stores each weight (out, in), so its adapters are a (out, r), b
    (r, in): the same layers written with layout="out_in" are PEFT's same tensors, and
    load back bitwise onto the (out, in) base."""
    base = _base()
    adapters = _adapters(base)
    base_t = jax.tree.map(lambda v: jnp.swapaxes(v, 1, 2), base)   # (n, out, in)
    # W^T + (a b)^T = W^T + b^T a^T: the transposed model's adapter is (b^T, a^T).
    adapters_t = {k: stackwise.lora.LoraWeights(jnp.swapaxes(v.b, 1, 2),
                                                jnp.swapaxes(v.a, 1, 2), v.alpha)
                  if v is not None else None for k, v in adapters.items()}
    stackwise.lora.save_peft(tmp_path / "in_out", adapters, MODULES)
    stackwise.lora.save_peft(tmp_path / "out_in", adapters_t, MODULES, layout="out_in")
    one, other = (safetensors_numpy.load_file(tmp_path / f / "adapter_model.safetensors")
                  for f in ("in_out", "out_in"))
    assert one.keys() == other.keys()
    for name in one:
        np.testing.assert_array_equal(other[name], one[name])
    back = stackwise.lora.load_peft(tmp_path / "out_in", base_t, MODULES, layout="out_in")
    jax.tree.map(np.testing.assert_array_equal, back, adapters_t)
    # Read as the other layout, the (out, in) base's shapes do not fit: refused, not guessed.
    with pytest.raises(ValueError, match="PEFT files from another model"):
        stackwise.lora.load_peft(tmp_path / "out_in", base_t, MODULES)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_is_bitwise(tmp_path, dtype):
    base = _base(dtype)
    adapters = _adapters(base)
    stackwise.lora.save_peft(tmp_path / "a", adapters, MODULES)
    back = stackwise.lora.load_peft(tmp_path / "a", base, MODULES)
    assert jax.tree.structure(back) == jax.tree.structure(adapters)
    jax.tree.map(np.testing.assert_array_equal, back, adapters)
    assert back["q"].a.dtype == jnp.dtype(dtype)
    # Loaded onto a quantized base too (the leaves' shapes are the float weight's).
    qbase = stackwise.quant.quantize(base, "nf4", targets=list(MODULES))
    back = stackwise.lora.load_peft(tmp_path / "a", qbase, MODULES, dtype=jnp.float32)
    assert back["down"].a.dtype == jnp.float32


def test_overwrite_replaces_whole_and_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    base = _base()
    one, two = _adapters(base), _adapters(base, alpha=2.0)
    folder = tmp_path / "a"
    stackwise.lora.save_peft(folder, one, MODULES)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        stackwise.lora.save_peft(folder, two, MODULES)
    stackwise.lora.save_peft(folder, two, MODULES, overwrite=True)
    assert stackwise.lora.load_peft(folder, base, MODULES)["q"].alpha == 2.0
    assert sorted(os.listdir(tmp_path)) == ["a"]

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors_numpy, "save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        stackwise.lora.save_peft(tmp_path / "b", one, MODULES)
    with pytest.raises(OSError, match="disk full"):
        stackwise.lora.save_peft(folder, one, MODULES, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["a"]  # no b, no staging; a as it was
    assert stackwise.lora.load_peft(folder, base, MODULES)["q"].alpha == 2.0


# transformers 5 warns of its own deprecations while PEFT wraps a model (measured with
# transformers 5.25, peft 0.21.2, torch 2.13): not stackwise's to fix.
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_peft_loads_them_onto_a_transformers_model(tmp_path):
    """PEFT itself, when installed (the suite does not install torch): each adapted q_proj of a
    tiny Llama gives the wrapped layer's output."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=D, intermediate_size=F, num_hidden_layers=N,
                                      num_attention_heads=2, num_key_value_heads=2,
                                      vocab_size=16)
    model = transformers.LlamaForCausalLM(config).eval()
    layers_ = model.model.layers
    base = {"q": jnp.stack([jnp.asarray(layer.self_attn.q_proj.weight.detach().numpy().T)
                            for layer in layers_]),
            "down": jnp.stack([jnp.asarray(layer.mlp.down_proj.weight.detach().numpy().T)
                               for layer in layers_]),
            "norm": jnp.ones((N, 1, D))}
    adapters = _adapters(base)
    stackwise.lora.save_peft(tmp_path / "a", adapters, MODULES)
    peft_model = peft.PeftModel.from_pretrained(model, str(tmp_path / "a")).eval()
    x = np.array(jax.random.normal(jax.random.key(1), (2, D)), np.float32)  # (writable, for torch)
    one = stackwise.lora.stack(lambda p, x: x @ p["q"], 1)
    for i in range(N):
        q_proj = peft_model.base_model.model.model.layers[i].self_attn.q_proj
        with torch.no_grad():
            y_peft = q_proj(torch.from_numpy(x)).numpy()
        layer = jax.tree.map(lambda v, i=i: v[i : i + 1], (base, adapters))
        y = one.apply(stackwise.lora.attach(*layer), jnp.asarray(x))
        np.testing.assert_allclose(y, y_peft, rtol=1e-5, atol=1e-5)


def test_a_failed_rename_puts_the_old_adapter_back(tmp_path, monkeypatch):
    base = _base()
    folder = tmp_path / "a"
    stackwise.lora.save_peft(folder, _adapters(base), MODULES)
    real = os.replace

    def replace(src, dst):
        src = os.fspath(src)  # the new folder, staged in a private .stackwise-peft-* holder
        if os.path.basename(os.path.dirname(src)).startswith(".stackwise-peft-") and (
                os.path.basename(src) == "adapter"):
            raise OSError("rename refused")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="rename refused"):
        stackwise.lora.save_peft(folder, _adapters(base, alpha=2.0), MODULES, overwrite=True)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["a"]
    assert stackwise.lora.load_peft(folder, base, MODULES)["q"].alpha == 8.0


def test_without_safetensors_the_message_says_what_to_install(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'stackwise\[safetensors\]'"):
        stackwise.lora.save_peft(tmp_path / "a", _adapters(_base()), MODULES)


def test_layers_takes_a_bare_field_and_base_model_a_path(tmp_path):
    """`{}` names layer i as `{i}` does (as every other stackwise name takes it), and a
    `pathlib.Path` base model is written to the config as its str."""
    base = _base()
    adapters = _adapters(base)
    stackwise.lora.save_peft(tmp_path / "i", adapters, MODULES)
    stackwise.lora.save_peft(tmp_path / "bare", adapters, MODULES,
                             layers="base_model.model.model.layers.{}",
                             base_model_name_or_path=tmp_path / "llama")
    one, two = (safetensors_numpy.load_file(tmp_path / f / "adapter_model.safetensors")
                for f in ("i", "bare"))
    assert sorted(one) == sorted(two) and len(one) == 2 * 2 * N
    assert all((one[k] == two[k]).all() for k in one)
    config = json.loads((tmp_path / "bare" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "llama")
    back = stackwise.lora.load_peft(tmp_path / "bare", base, MODULES,
                                    layers="base_model.model.model.layers.{}")
    np.testing.assert_array_equal(back["q"].a, adapters["q"].a)


@pytest.mark.parametrize("umask, folder, file", [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)],
                         ids=["umask 022", "umask 027"])
def test_the_folder_and_files_take_the_umask_s_modes(tmp_path, umask, folder, file):
    """As any folder and file made under the umask (not the 0700/0600 of a private staging
    folder, or of safetensors' writer): a serving job of another user can read them."""
    import stat

    adapters = _adapters(_base())
    old = os.umask(umask)
    try:
        stackwise.lora.save_peft(tmp_path / "a", adapters, MODULES)
        stackwise.lora.save_peft(tmp_path / "b", adapters, MODULES)
        stackwise.lora.save_peft(tmp_path / "b", adapters, MODULES, overwrite=True)
    finally:
        os.umask(old)
    for name in ("a", "b"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == folder
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            assert stat.S_IMODE(os.stat(tmp_path / name / f).st_mode) == file
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]


def _pattern_model(n=5):
    """A pattern of two kinds of layer, a b a b a, as its loop's per-layer params (layer i
    of kind i % 2) and the stacked model of them: both kinds have `q`, only the second `up`."""
    keys = iter(jax.random.split(jax.random.key(3), 2 * n))
    loop = [{"q": jax.random.normal(next(keys), (D, D)) / D} if i % 2 == 0 else
            {"q": jax.random.normal(next(keys), (D, D)) / D,
             "up": jax.random.normal(next(keys), (D, D)) / D} for i in range(n)]

    def apply_a(p, x):
        return x + jnp.tanh(x @ p["q"])

    def apply_b(p, x):
        return x + jnp.tanh(x @ p["q"]) @ p["up"]

    return loop, (apply_a, apply_b)


PATTERN_MODULES = {"[0]['q']": "self_attn.q_proj", "[1]['q']": "self_attn.q_proj",
                   "[1]['up']": "mlp.up_proj"}


def test_a_pattern_s_file_names_the_model_s_layers(tmp_path):
    """With `pattern=2`, the file's layer i is the adapter the stacked pattern model applies at
    its layer i: a loop over the loop model's layers, each adapted with its file tensors
    (torch's layout), gives the stacked model's outputs; positions share `self_attn.q_proj`,
    each layer once; and `load_peft(pattern=2)` reads it back bitwise."""
    n = 5
    loop, kinds = _pattern_model(n)
    base = stackwise.stack_layers(loop, pattern=2)      # positions of 3 and 2 layers
    adapters = trained(stackwise.lora.init(KEY, base, rank=2, alpha=4.0,
                                           targets=list(PATTERN_MODULES)))
    stackwise.lora.save_peft(tmp_path / "a", adapters, PATTERN_MODULES, pattern=2)
    tensors = safetensors_numpy.load_file(tmp_path / "a" / "adapter_model.safetensors")
    names = {f"base_model.model.model.layers.{i}.{module}.lora_{ab}.weight"
             for i in range(n) for module, leaves in (("self_attn.q_proj", ("q",)),
                                                       ("mlp.up_proj", ("up",)))
             for leaf in leaves if leaf in loop[i] for ab in "AB"}
    assert set(tensors) == names  # every layer of the loop, once: q on 0-4, up on 1 and 3

    x = jax.random.normal(jax.random.key(4), (2, D))
    stacked = stackwise.lora.stack(list(kinds), n).apply(
        tuple(map(stackwise.lora.attach, base, adapters)), x)
    scale = adapters[0]["q"].scale
    y = x
    for i, layer in enumerate(loop):  # the loop model, layer i adapted from the file alone
        adapted = {}
        for leaf, w in layer.items():
            module = {"q": "self_attn.q_proj", "up": "mlp.up_proj"}[leaf]
            name = f"base_model.model.model.layers.{i}.{module}"
            a, b = tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"]
            adapted[leaf] = w + scale * (a.T @ b.T)      # torch: W^T + s B A, as (in, out)
        y = kinds[i % 2](adapted, y)
    np.testing.assert_allclose(stacked, y, rtol=1e-5, atol=1e-5)

    back = stackwise.lora.load_peft(tmp_path / "a", base, PATTERN_MODULES, pattern=2)
    assert jax.tree.structure(back) == jax.tree.structure(adapters)
    jax.tree.map(np.testing.assert_array_equal, back, adapters)


def test_a_pattern_s_file_is_the_loop_model_s(tmp_path):
    """The same adapters unstacked into the loop's layer order and saved as one stack give the
    same file, tensor for tensor (the example's way before `pattern=`)."""
    loop, _ = _pattern_model(4)
    loop = [{"q": layer["q"]} for layer in loop]  # one structure, so that it stacks as one
    base = stackwise.stack_layers(loop, pattern=2)
    adapters = trained(stackwise.lora.init(KEY, base, rank=2))
    modules = {"[0]['q']": "self_attn.q_proj", "[1]['q']": "self_attn.q_proj"}
    stackwise.lora.save_peft(tmp_path / "pattern", adapters, modules, pattern=2)
    in_order = jax.tree.map(lambda *v: jnp.stack(v),
                            *stackwise.unstack_layers(adapters, pattern=2))
    stackwise.lora.save_peft(tmp_path / "loop", in_order, {"['q']": "self_attn.q_proj"})
    one, other = (safetensors_numpy.load_file(tmp_path / f / "adapter_model.safetensors")
                  for f in ("pattern", "loop"))
    assert one.keys() == other.keys()
    for name in one:
        np.testing.assert_array_equal(one[name], other[name])


def test_one_stack_of_a_tuple_of_trees_saves_in_a_dict(tmp_path):
    """A tuple of trees without `pattern=` is refused (a pattern's params look the same); one
    stack whose params are a tuple of trees saves as the refusal says, in a dict, as the same
    stack's dict of trees does."""
    base = _base()
    adapters = _adapters(base)
    as_tuple = ({"q": adapters["q"]}, {"down": adapters["down"]})
    with pytest.raises(TypeError, match="pass `pattern=2`"):
        stackwise.lora.save_peft(tmp_path / "t", as_tuple, {"[0]['q']": "self_attn.q_proj",
                                                            "[1]['down']": "mlp.down_proj"})
    stackwise.lora.save_peft(tmp_path / "t", {"layers": as_tuple},
                             {"['layers'][0]['q']": "self_attn.q_proj",
                              "['layers'][1]['down']": "mlp.down_proj"})
    stackwise.lora.save_peft(tmp_path / "d", adapters, MODULES)
    one, other = (safetensors_numpy.load_file(tmp_path / f / "adapter_model.safetensors")
                  for f in ("t", "d"))
    assert one.keys() == other.keys()
    for name in one:
        np.testing.assert_array_equal(one[name], other[name])


def test_modules_and_layers_come_from_a_checkpoints_names(tmp_path):
    """A GPT-2-style model's names (not Llama's): the file names each layer's module under
    the checkpoint's own prefix, and reads back bitwise with the same names."""
    import safetensors.numpy

    base = {"attn": {"c_q": jnp.zeros((3, 4, 4)), "c_v": jnp.zeros((3, 4, 4))},
            "ln": jnp.ones((3, 4))}
    names = {"attn": {"c_q": stackwise.Tensor("transformer.h.{}.attn.c_q.weight",
                                              transpose=(1, 0)),
                      "c_v": "transformer.h.{}.attn.c_v.weight"},
             "ln": "transformer.h.{}.ln_1.weight"}
    adapters = stackwise.lora.init(jax.random.key(0), base, rank=2,
                                   targets=lambda path, shape: "attn" in path)
    adapters = jax.tree.map(lambda v: v + 0.5, adapters)  # b != 0
    modules, layers = stackwise.lora.peft_modules(names, adapters)
    assert modules == {"['attn']['c_q']": "attn.c_q", "['attn']['c_v']": "attn.c_v"}
    assert layers == "base_model.model.transformer.h.{i}"
    stackwise.lora.save_peft(tmp_path / "a", adapters, modules, layers=layers)
    keys = safetensors.numpy.load_file(tmp_path / "a" / "adapter_model.safetensors")
    assert "base_model.model.transformer.h.2.attn.c_v.lora_B.weight" in keys
    back = stackwise.lora.load_peft(tmp_path / "a", base, modules, layers=layers)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(adapters)):
        np.testing.assert_array_equal(got, want)
