"""orbax's CheckpointManager with stacked training state (params and optimizer state) of every
entry point (the core, Haiku, linen, NNX, Equinox; one manager saves all five, so that orbax's
fixed costs are paid once): saves keeping the last, a bitwise restore onto the abstract state,
and inspect telling the stacked checkpoint from a per-layer one. (Restoring onto another
mesh than the one saved from: the 8-device test_checkpoint_sharded.py.)"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from _checkpoint_models import FRAMEWORKS, config, lm_models
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
