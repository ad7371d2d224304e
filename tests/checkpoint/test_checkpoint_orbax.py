"""orbax's CheckpointManager with stacked training state (params and optimizer state) in every
entry point: periodic saves keeping the last few, a bitwise restore onto the abstract state,
a stacked checkpoint read back per layer into a loop's layout."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from _checkpoint_models import FRAMEWORKS, config, lm_models
from _trees import assert_trees_bitwise

import stackwise

ocp = pytest.importorskip("orbax.checkpoint")
optax = pytest.importorskip("optax")


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_manager_saves_and_restores_stacked_state(tmp_path, framework):
    c = config(layers=3)
    lm = lm_models.build(framework, c)
    params = lm.init(jax.random.key(0))
    opt = optax.adam(1e-3)
    state = {"params": params, "opt": opt.init(params)}
    options = ocp.CheckpointManagerOptions(max_to_keep=2)
    states = {}
    with ocp.CheckpointManager(tmp_path, options=options) as manager:
        for step in range(1, 4):  # a training loop's saves, the state changing each step
            state["opt"] = jax.tree.map(lambda a: a + step if a.dtype == np.float32 else a,
                                        state["opt"])
            states[step] = dict(state)
            manager.save(step, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
        assert list(manager.all_steps()) == [2, 3]  # the last 2 kept
        abstract = jax.eval_shape(lambda: state)
        restored = manager.restore(2, args=ocp.args.StandardRestore(abstract))
    assert_trees_bitwise(restored, states[2])
    # inspect tells a stacked checkpoint from a per-layer one.
    layout = stackwise.inspect_checkpoint(tmp_path / "2" / "default")
    assert (layout.kind, layout.layout, layout.depth) == ("orbax", "stacked", 3), layout
