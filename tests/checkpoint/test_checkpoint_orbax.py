"""orbax's CheckpointManager with stacked training state (params and optimizer state) of every
entry point (the core, Haiku, linen, NNX, Equinox; one manager saves all five, so that orbax's
fixed costs are paid once): saves keeping the last, a bitwise restore onto the abstract state,
and inspect telling the stacked checkpoint from a per-layer one. stackwise.save_orbax: stacked
params to the loop's layout, a group of layers at a time, read back by orbax as the loop's tree
and by load_checkpoint bitwise. (Restoring onto another mesh than the one saved from, and
saving from sharded params: the 8-device test_checkpoint_sharded.py.)"""

from __future__ import annotations

import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _checkpoint_models import FRAMEWORKS, config, hf_arrays, lm_models, names_for
from _trees import assert_trees_bitwise

import stackwise

ocp = pytest.importorskip("orbax.checkpoint")
optax = pytest.importorskip("optax")


def test_manager_saves_and_restores_stacked_state_of_every_framework(tmp_path):
    c = config(layers=3)
    opt = optax.adam(1e-3)
    rng = np.random.default_rng(0)
    fill = lambda a: rng.standard_normal(a.shape).astype(a.dtype)  # noqa: E731 (no compiles)
    abstract = {}
    for framework in FRAMEWORKS:
        params = jax.eval_shape(lm_models.build(framework, c).init, jax.random.key(0))
        abstract[framework] = {"params": params, "opt": jax.eval_shape(opt.init, params)}
    states = {}
    with ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(max_to_keep=1)) \
            as manager:
        for step in (1, 2):  # a training loop's saves, the state changing each step
            state = jax.tree.map(fill, abstract)
            states[step] = state
            manager.save(step, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
        assert list(manager.all_steps()) == [2]  # the last kept
        restored = manager.restore(2, args=ocp.args.StandardRestore(abstract))
    for framework in FRAMEWORKS:  # the same pytree types (an Equinox module, optax's states)
        assert_trees_bitwise(restored[framework], states[2][framework])
    layout = stackwise.inspect_checkpoint(tmp_path / "2" / "default")
    assert (layout.kind, layout.layout, layout.depth) == ("orbax", "stacked", 3), layout


def _loop_layers(tree, prefix="") -> set[int]:
    """The layers whose arrays a loop tree (nested by a name's parts) holds."""
    found = set()
    for path, _ in jax.tree_util.tree_leaves_with_path(tree):
        name = ".".join(str(getattr(k, "key", k)) for k in path)
        m = re.match(r"model\.layers\.(\d+)\.", name)
        found |= {int(m.group(1))} if m else set()
    return found


@pytest.mark.slow  # orbax's partial saves, ~2 s (the fast tier has save_orbax's doctest)
def test_save_orbax_writes_the_loop_layout_a_group_at_a_time_bitwise(tmp_path, monkeypatch):
    c = config(layers=5, pattern=("local", "local", "global"))
    abstract = jax.eval_shape(lm_models.build("jax", c).init, jax.random.key(0))
    names = names_for("jax", abstract, c)  # Hugging Face's names, torch's (out, in) layout
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape).astype(a.dtype)),
                          abstract)
    partial = importlib.import_module("orbax.checkpoint.experimental.v1.partial")
    groups, save = [], partial.save
    monkeypatch.setattr(partial, "save", lambda path, tree: (
        groups.append(_loop_layers(tree)), save(path, tree))[1])
    layer_bytes = sum(a[0].nbytes for a in jax.tree.leaves(params["blocks"][0]))
    path = stackwise.save_orbax(params, names, tmp_path / "loop", pattern=3,
                                max_group_bytes=2 * layer_bytes)
    # Two layers at most per write (the leaves outside the stack in a write of their own).
    assert max(len(g) for g in groups) == 2 and set().union(*groups) == set(range(5))
    # The loop's tree as orbax restores it: each layer's arrays in torch's layout, as the
    # per-layer checkpoint written by hand (hf_arrays) has them.
    want = hf_arrays(params, names, c)
    loop = {}
    for name, a in want.items():
        *keys, last = name.split(".")
        node = loop
        for k in keys:
            node = node.setdefault(k, {})
        node[last] = jax.ShapeDtypeStruct(a.shape, a.dtype)
    restored = ocp.StandardCheckpointer().restore(path, loop)
    for name, a in want.items():
        node = restored
        for k in name.split("."):
            node = node[k]
        np.testing.assert_array_equal(np.asarray(node), a, err_msg=name)
        assert np.asarray(node).dtype == a.dtype
    assert stackwise.inspect_checkpoint(path)[:3] == ("orbax", "per-layer", 5)
    # Back into stacked params: bitwise.
    assert_trees_bitwise(stackwise.load_checkpoint(path, abstract, names, pattern=3), params)
    # Never over a checkpoint unless asked; asked, the new one replaces it, whole (an
    # interrupted save's leftovers cleared), and the directory itself opens too.
    with pytest.raises(FileExistsError, match="overwrite=True"):
        stackwise.save_orbax(params, names, tmp_path / "loop", pattern=3)
    (tmp_path / "loop.stackwise-tmp.partial_save").mkdir()
    doubled = jax.tree.map(lambda a: a * 2, params)
    stackwise.save_orbax(doubled, names, tmp_path / "loop", pattern=3, overwrite=True)  # 1 write
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop"]
    back = stackwise.load_checkpoint(tmp_path / "loop", abstract, names, pattern=3)
    assert_trees_bitwise(back, doubled)
    # A file in the way, replaced when asked.
    (tmp_path / "file").write_text("not a checkpoint")
    small = {"w": jnp.arange(6.0).reshape(2, 3)}
    path = stackwise.save_orbax(small, {"w": "l.{}.w"}, tmp_path / "file", overwrite=True)
    assert_trees_bitwise(stackwise.load_checkpoint(path, small, {"w": "l.{}.w"}), small)
