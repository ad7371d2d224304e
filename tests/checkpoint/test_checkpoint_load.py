"""A Hugging Face-style per-layer checkpoint (safetensors, torch's (out, in) layout, two files
and an index) loaded straight into the stacked model of every framework: the loop model's
logits and gradients; the same with a 5:1 pattern; transforms, casts, the other sources
(.npz, orbax, a dict), inspection, and saving back bitwise."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _checkpoint_models import (
    FRAMEWORKS,
    config,
    hf_arrays,
    lm_models,
    loop_of,
    names_for,
    random_hf,
    write_hf,
)
from _tolerance import reassociation_bound
from _trees import assert_trees_bitwise, assert_trees_close

import stackwise

pytest.importorskip("safetensors")

# The same float32 sums, ordered by different frameworks' stacks and the loop: each leaf within
# _lm_bound(layers) * eps * its largest magnitude (tests/_tolerance.py). A block chains sums of
# d_model = 8 terms (a norm, q, the softmax's and weights @ v's over 8 positions, o, a norm,
# up), 4 (the scores, per head) and 32 (down); the grads sum 16 tokens: for 3 layers,
# 6 * (2 * 3 * 27.5 + 4) = 1,014 eps.
BLOCK_SUMS = (8, 8, 4, 8, 8, 8, 8, 8, 32)


def _lm_bound(layers: int) -> int:
    return reassociation_bound(depth=layers, width=BLOCK_SUMS, summed=16)


def _loss_and_logits(apply):
    def loss(params, tokens):
        logits = apply(params, tokens)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def _checkpoint(c, tmp_path):
    """A random checkpoint of the model ``c`` in Hugging Face's layout, two files."""
    lm = lm_models.build("jax", c)
    abstract = jax.eval_shape(lm.init, jax.random.key(0))
    names = names_for("jax", abstract, c)
    hf = random_hf(abstract, names, c)
    folder = tmp_path / "hf"
    write_hf(folder, hf)
    return lm, abstract, names, hf, folder


def _reference(c, tmp_path, with_grads=True):
    """A random checkpoint, and the plain loop's logits and grads on it (the loop's params
    read from the checkpoint by hand)."""
    lm, abstract, names, hf, folder = _checkpoint(c, tmp_path)
    tokens = jax.random.randint(jax.random.key(1), (2, c.seq_len), 0, c.vocab)
    loop = loop_of(hf, abstract, names, c)
    if not with_grads:
        return folder, tokens, jax.jit(lm.loop_apply)(loop, tokens), None
    (_, logits), grads = _loss_and_logits(lm.loop_apply)(loop, tokens)
    k = len(c.pattern) if len(c.pattern) > 1 else None
    grads = {**grads, "blocks": stackwise.stack_layers(grads["blocks"], pattern=k)}
    return folder, tokens, logits, hf_arrays(grads, names, c)


@pytest.fixture(scope="module")
def plain_files(tmp_path_factory):
    c = config(layers=3)
    return c, _checkpoint(c, tmp_path_factory.mktemp("files"))[-1]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    c = config(layers=3)
    return (c, *_reference(c, tmp_path_factory.mktemp("plain")))


@pytest.fixture(scope="module")
def pattern(tmp_path_factory):
    c = config(layers=7, pattern=("local",) * 5 + ("global",))  # Gemma 3's 5:1, n = 7
    return (c, *_reference(c, tmp_path_factory.mktemp("pattern"), with_grads=False))


def _check_framework(framework, case):
    """The checkpoint, loaded into the framework's stacked model: the loop's logits, and its
    grads (in the checkpoint's layout, loaded the same way)."""
    c, folder, tokens, logits, grads = case
    lm = lm_models.build(framework, c)
    abstract = jax.eval_shape(lm.init, jax.random.key(0))
    names = names_for(framework, abstract, c)
    k = len(c.pattern) if len(c.pattern) > 1 else None
    params = stackwise.load_checkpoint(folder, abstract, names, pattern=k)
    positions = jnp.arange(c.seq_len)
    apply = lambda p, tokens: lm.apply(p, tokens, positions)[0]  # noqa: E731
    if grads is None:  # the 6-position pattern: logits (its grads' compile is slow)
        assert_trees_close(jax.jit(apply)(params, tokens), logits, _lm_bound(c.layers))
        return
    (_, got), got_grads = _loss_and_logits(apply)(params, tokens)
    assert_trees_close(got, logits, _lm_bound(c.layers))
    assert_trees_close(got_grads, stackwise.load_checkpoint(grads, abstract, names, pattern=k),
                       _lm_bound(c.layers))


@pytest.mark.slow  # 5 frameworks' compiles; the fast tier loads in the tests below
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_hf_checkpoint_into_every_framework(plain, framework):
    _check_framework(framework, plain)


@pytest.mark.slow
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_pattern_checkpoint_into_every_framework(pattern, framework):
    _check_framework(framework, pattern)


def test_inspect_says_per_layer_depth_pattern_and_names(plain_files):
    layout = stackwise.inspect_checkpoint(plain_files[1])
    assert (layout.kind, layout.layout, layout.depth, layout.pattern) == (
        "safetensors", "per-layer", 3, 1)
    assert "model.layers.{}.self_attn.qkv_proj.weight" in layout.names
    assert layout.other == sorted(["lm_head.bias", "lm_head.weight", "model.embed_tokens.weight",
                                   "model.norm.bias", "model.norm.weight"])
    # Position 5's layers only hold a tensor: a 6-layer pattern is visible in the names.
    arrays = {f"layers.{i}.w": np.zeros(2) for i in range(7)}
    arrays |= {f"layers.{i}.attn_gate": np.zeros(2) for i in (5,)} | {"layers.0.extra": np.zeros(1)}
    assert stackwise.inspect_checkpoint(arrays)[1:4] == ("per-layer", 7, 1)
    arrays = {f"layers.{i}.w": np.zeros(2) for i in range(7)} | {
        f"layers.{i}.local": np.zeros(2) for i in (0, 1, 3, 4, 6)}
    assert stackwise.inspect_checkpoint(arrays)[1:4] == ("per-layer", 7, 3)
    stacked = {"w": np.zeros((4, 2, 2)), "b": np.zeros((4, 2)), "embed": np.zeros((9, 2))}
    assert stackwise.inspect_checkpoint(stacked)[1:3] == ("stacked", 4)
    assert stackwise.inspect_checkpoint({"embed": np.zeros((9, 2))})[1:3] == ("flat", None)


def test_transforms_split_heads_and_cast_on_request(tmp_path):
    from safetensors.numpy import save_file

    heads, d, e = 2, 3, 4
    q = np.arange(3 * heads * d * e, dtype=np.float32).reshape(3, heads * d, e)  # (out, in)
    save_file({f"l.{i}.q": q[i].astype(jnp.bfloat16) for i in range(3)}, tmp_path / "m.safetensors")
    target = {"q": jax.ShapeDtypeStruct((3, e, heads, d), jnp.float32)}
    spec = stackwise.Tensor("l.{}.q", transpose=(1, 0), reshape=(e, heads, d), dtype=jnp.float32)
    got = stackwise.load_checkpoint(tmp_path / "m.safetensors", target, {"q": spec})
    want = q.astype(jnp.bfloat16).astype(np.float32).transpose(0, 2, 1).reshape(3, e, heads, d)
    assert got["q"].dtype == jnp.float32
    np.testing.assert_array_equal(got["q"], want)
    # ... and back: the saved tensors are the stored ones, bitwise.
    spec = stackwise.Tensor("l.{}.q", transpose=(1, 0), reshape=(e, heads, d),
                            stored_shape=(heads * d, e))
    written = stackwise.save_safetensors(got, {"q": spec}, tmp_path / "back")
    back = stackwise.open_checkpoint(written[0])
    np.testing.assert_array_equal(back.read("l.2.q"), want[2].reshape(e, heads * d).T)
    # A transpose alone goes through a staging buffer, cast on the way out of it; in 3-D too.
    r = np.arange(3 * 2 * 3 * 5, dtype=np.float32).reshape(3, 2, 3, 5)
    save_file({f"l.{i}.r": r[i].astype(jnp.bfloat16) for i in range(3)}, tmp_path / "r.safetensors")
    target = {"q": jax.ShapeDtypeStruct((3, e, heads * d), jnp.float32),
              "r": jax.ShapeDtypeStruct((3, 5, 2, 3), jnp.bfloat16)}
    names = {"q": stackwise.Tensor("l.{}.q", transpose=(1, 0), dtype=jnp.float32),
             "r": stackwise.Tensor("l.{}.r", transpose=(2, 0, 1))}
    got = stackwise.load_checkpoint([tmp_path / "m.safetensors", tmp_path / "r.safetensors"],
                                    target, names)
    np.testing.assert_array_equal(got["q"], q.astype(jnp.bfloat16).astype(np.float32)
                                  .transpose(0, 2, 1))
    np.testing.assert_array_equal(got["r"], r.astype(jnp.bfloat16).transpose(0, 3, 1, 2))


def test_npz_orbax_and_dict_sources_load_the_same(plain_files, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    c, folder = plain_files
    lm = lm_models.build("flax", c)
    abstract = jax.eval_shape(lm.init, jax.random.key(0))
    names = names_for("flax", abstract, c)
    want = stackwise.load_checkpoint(folder, abstract, names)
    ckpt = stackwise.open_checkpoint(folder)
    arrays = {n: ckpt.read(n) for n in ckpt.tensors}
    np.savez(tmp_path / "m.npz", **arrays)
    # orbax, in the loop's layout: a tree of per-layer tensors, names joined by dots.
    tree: dict = {}
    for n, a in arrays.items():
        node = tree
        *parents, last = n.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = a
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "orbax", tree)
    checkpointer.wait_until_finished()
    for source in (arrays, tmp_path / "m.npz", tmp_path / "orbax"):
        assert_trees_bitwise(stackwise.load_checkpoint(source, abstract, names), want)
    assert stackwise.inspect_checkpoint(tmp_path / "orbax")[:3] == ("orbax", "per-layer", 3)


def test_save_round_trip_is_bitwise_and_never_overwrites(plain_files, tmp_path):
    c, folder = plain_files
    lm = lm_models.build("haiku", c)
    abstract = jax.eval_shape(lm.init, jax.random.key(0))
    names = names_for("haiku", abstract, c)
    params = stackwise.load_checkpoint(folder, abstract, names)
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)  # bfloat16 too
    layer = sum(a[0].nbytes for k, v in params.items() if "blocks" in k for a in v.values())
    written = stackwise.save_safetensors(params, names, tmp_path / "out", max_file_bytes=layer)
    assert len(written) == 3 + 1 + 1  # the 3 layers, the others (first), the index
    # The files hold the stored layout: what the hand-written checkpoint held, cast.
    ckpt, source = stackwise.open_checkpoint(tmp_path / "out"), stackwise.open_checkpoint(folder)
    assert sorted(ckpt.tensors) == sorted(source.tensors)
    for n in source.tensors:
        np.testing.assert_array_equal(ckpt.read(n), source.read(n).astype(jnp.bfloat16))
    abstract16 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16), abstract)
    assert_trees_bitwise(stackwise.load_checkpoint(tmp_path / "out", abstract16, names), params)
    before = {p: pathlib.Path(p).read_bytes() for p in written}
    with pytest.raises(FileExistsError, match="overwrite=True"):
        stackwise.save_safetensors(params, names, tmp_path / "out")
    assert {p: pathlib.Path(p).read_bytes() for p in written} == before
    # Asked, the new checkpoint (one file) replaces the old one whole: the old files and
    # index are gone (a stale index would be read instead of the new file).
    doubled = jax.tree.map(lambda a: a * 2, params)
    stackwise.save_safetensors(doubled, names, tmp_path / "out", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]
    assert_trees_bitwise(stackwise.load_checkpoint(tmp_path / "out", abstract16, names), doubled)
    # A file where the folder should be: the error, at once, and the file as it was.
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(FileExistsError, match="file"):
        stackwise.save_safetensors(params, names, tmp_path / "file")
    assert (tmp_path / "file").read_text() == "not a folder"


def test_numpy_integers_and_sequences_read_as_in_the_core(tmp_path):
    """`Tensor`'s position, transpose and shapes and `save_safetensors`' pattern and
    max_file_bytes take NumPy integers and any sequence, as `stackwise._core.checks.integer`
    does."""
    params = {"a": jnp.arange(12.0).reshape(2, 3, 2), "b": jnp.arange(8.0).reshape(2, 4)}
    names = {"a": stackwise.Tensor("l.{}.a", position=np.int64(0), transpose=np.array([1, 0])),
             "b": stackwise.Tensor("l.{}.b", position=np.int32(1), reshape=[4],
                                   stored_shape=np.array([2, 2]))}
    assert names["a"].transpose == (1, 0) and names["b"].reshape == (4,)
    assert names["b"].stored_shape == (2, 2)
    written = stackwise.save_safetensors(params, names, tmp_path, pattern=np.int64(2),
                                         max_file_bytes=np.int64(24), overwrite=np.False_)
    ckpt = stackwise.open_checkpoint(tmp_path)
    assert sorted(ckpt.tensors) == ["l.0.a", "l.1.b", "l.2.a", "l.3.b"] and len(written) == 5
    np.testing.assert_array_equal(ckpt.read("l.2.a"), params["a"][1].T)
    np.testing.assert_array_equal(ckpt.read("l.3.b"), params["b"][1].reshape(2, 2))
    back = stackwise.load_checkpoint(tmp_path, params, names, pattern=2)
    assert_trees_bitwise(back, params)


def test_leaves_that_are_not_arrays_are_kept_and_empty_tensors_load():
    """A target's functions and static numbers come back as they are (no name needed), and a
    per-layer tensor with no elements loads into its stacked leaf."""
    arrays = {f"l.{i}.w": np.arange(6.0, dtype=np.float32).reshape(2, 3) + i for i in range(3)}
    arrays |= {f"l.{i}.e": np.zeros((0, 3), np.float32) for i in range(3)}
    target = {"w": jax.ShapeDtypeStruct((3, 2, 3), jnp.float32),
              "e": jax.ShapeDtypeStruct((3, 0, 3), jnp.float32),
              "eps": 1e-5, "act": jax.nn.gelu, "depth": 3}
    back = stackwise.load_checkpoint(arrays, target, {"w": "l.{}.w", "e": "l.{}.e"})
    assert back["eps"] == 1e-5 and back["act"] is jax.nn.gelu and back["depth"] == 3
    assert back["e"].shape == (3, 0, 3) and back["e"].dtype == jnp.float32
    np.testing.assert_array_equal(back["w"], np.stack([arrays[f"l.{i}.w"] for i in range(3)]))
