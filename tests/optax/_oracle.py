"""The differential oracle of `stackwise.optax`: the wrapped optimizer on stacked params
against plain optax on the loop model (each stacked leaf split into its layers, as separate
leaves), over several steps with changing gradients.

A case is plain data (:class:`Case`): the layer axes, the leaves' shapes, the chain's parts
by name (:data:`PARTS`), a wrapper around the chain (:data:`WRAPPERS`) and the per-layer
controls. :func:`check` builds both optimizers from it, feeds both the same params and
gradients at every step (the loop's trajectory) and compares the updates, so a difference
is the wrapper's, not one carried over from an earlier step. The hypothesis strategy that
draws cases is in ``test_optax_oracle.py``; every counterexample it found is a named test
there.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

import stackwise.optax as so

# float32 rounding of the updates (the wrapped parts run per layer, vmapped, the loop's per
# leaf: sums reassociated; trust ratios and norms divide), relative to the largest update.
RTOL = 2e-5
# Below this, relative to the largest update of the leaf, an element is rounding noise.
ATOL_OF_LARGEST = 2e-5

LR = 0.05


def ndim_at_least_2(tree):
    """The usual "no weight decay on biases and norms" mask: it reads the leaves' shapes."""
    return jax.tree.map(lambda x: x.ndim >= 2, tree)


def by_ndim(tree):
    return jax.tree.map(lambda x: "matrix" if x.ndim == 2 else "other", tree)


def by_size(tree):
    return jax.tree.map(lambda x: "big" if x.size >= 4 else "small", tree)


def _schedule(count):
    return LR / (1.0 + 0.5 * count)


# Each part: a function of (layer mask on the loop, chosen layers) giving the pair
# (wrapped part, loop part); most are the same optax transformation on both sides.
def _same(make):
    return lambda case: (make(), make())


PARTS = {
    "adam": _same(lambda: optax.adam(LR)),
    "adamw_masked": _same(lambda: optax.adamw(LR, weight_decay=0.5, mask=ndim_at_least_2)),
    "sgd_schedule": _same(lambda: optax.sgd(optax.linear_schedule(LR, LR / 4, 3), 0.9)),
    "scale_by_schedule": _same(lambda: optax.scale_by_schedule(lambda c: -_schedule(c))),
    "clip_by_global_norm": _same(lambda: optax.clip_by_global_norm(0.3)),
    "clip": _same(lambda: optax.clip(0.2)),
    "adaptive_grad_clip": _same(lambda: optax.adaptive_grad_clip(0.05)),
    "clip_by_block_rms": _same(lambda: optax.clip_by_block_rms(0.2)),
    "scale_by_trust_ratio": _same(optax.scale_by_trust_ratio),
    "lamb_masked": _same(lambda: optax.lamb(LR, weight_decay=0.3, mask=ndim_at_least_2)),
    "masked_trust_ratio": _same(lambda: optax.masked(optax.scale_by_trust_ratio(),
                                                      ndim_at_least_2)),
    "multi_transform_by_ndim": _same(lambda: optax.multi_transform(
        {"matrix": optax.lamb(LR), "other": optax.adam(LR)}, by_ndim)),
    "partition_by_size": _same(lambda: optax.partition(
        {"big": optax.adafactor(LR, min_dim_size_to_factor=2), "small": optax.sgd(LR)},
        by_size)),
    "inject_hyperparams_adamw": _same(lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=_schedule, weight_decay=0.2, mask=ndim_at_least_2)),
    "lion": _same(lambda: optax.lion(LR)),
    "normalize_by_update_norm": _same(lambda: optax.normalize_by_update_norm(LR)),
    "muon": _same(lambda: optax.contrib.muon(LR, ns_steps=2)),
    "layer_mask_decay": lambda case: (
        so.layer_mask(optax.add_decayed_weights(0.5), case.chosen, case.stacked()),
        optax.masked(optax.add_decayed_weights(0.5), case.loop_mask)),
    "layer_mask_global_clip": lambda case: (
        so.layer_mask(optax.clip_by_global_norm(0.1), case.chosen, case.stacked()),
        optax.masked(optax.clip_by_global_norm(0.1), case.loop_mask)),
}

WRAPPERS = {
    "none": lambda tx: tx,
    "multi_steps": lambda tx: optax.MultiSteps(tx, every_k_schedule=2).gradient_transformation(),
    "apply_if_finite": lambda tx: optax.apply_if_finite(tx, 2),
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One tree and one optimizer.

    ``layers``: the layer axes of the blocks (one or two axes: a stack, or a stack of
    stacks); ``outside``: the wrapper goes around ``layerwise`` (else inside it, where a
    ``layer_mask`` part cannot be: a named error); ``w``: one layer's matrix shape;
    ``pattern``: the numbers of rows of a second stack given as a pattern's two positions
    (or None), ``marked``: given as ``stackwise.optax.pattern(n, 2)``, so that layer
    indices name the model's layers (else each position's rows); ``chosen``: the layers of
    ``layer_mask`` parts; ``freeze`` and ``lr_scale`` as for ``layerwise``; ``nan_at``: a
    step whose gradients hold a NaN (for ``apply_if_finite``)."""

    layers: tuple[int, ...]
    w: tuple[int, int]
    parts: tuple[str, ...]
    wrapper: str = "none"
    outside: bool = False
    marked: bool = False
    pattern: tuple[int, int] | None = None
    chosen: tuple[int, ...] = (0,)
    freeze: tuple[int, ...] | None = None
    lr_scale: tuple[float, ...] | None = None
    seed: int = 0
    steps: int = 3
    nan_at: int | None = None

    def params(self):
        # Drawn by NumPy, as float32: JAX would compile its sampler for each random shape.
        rng = np.random.default_rng(self.seed)
        normal = lambda shape: rng.standard_normal(shape, np.float32)  # noqa: E731
        a, b = self.w
        tree = {"blocks": {"w": normal(self.layers + (a, b)) / math.sqrt(a),
                           "b": 0.1 * normal(self.layers + (b,)),
                           "gate": normal(self.layers)},
                "embed": normal((3, a)), "head_b": normal((b,))}
        if self.pattern is not None:
            rows = self.pattern
            tree["pattern"] = ({"w": normal((rows[0], b, a))},
                               {"w": normal((rows[1], a, a)), "s": normal((rows[1], a))})
        return jax.tree.map(jnp.asarray, tree)

    def stacked(self):
        out = {"blocks": len(self.layers), "embed": False, "head_b": False}
        if self.pattern is not None:
            out["pattern"] = so.pattern(sum(self.pattern), 2) if self.marked else True
        return out

    def depths(self, tree):
        return [int(bool(f)) if isinstance(f, so_position) else int(f)
                for f in _flags(self.stacked(), tree)]

    def layer_of(self, tree):
        """Per flat leaf: the model's layer index of a row (a marked pattern's position p
        holds layers p, p + 2, ...)."""
        return [(lambda r, f=f: f.index + r * f.k) if isinstance(f, so_position)
                else (lambda r: r) for f in _flags(self.stacked(), tree)]

    def loop_mask(self, loop):
        """``optax.masked``'s mask on the loop tree: the chosen layers of stacked leaves."""
        like = jax.eval_shape(self.params)
        treedef = jax.tree.structure(like)
        return jax.tree.unflatten(treedef, [
            _map_layers(s, d, lambda i, _, at=at: at(i) in self.chosen) if d else False
            for s, d, at in zip(treedef.flatten_up_to(loop), self.depths(like),
                                self.layer_of(like))])


so_position = type(so.pattern(2, 2)[0])


def _flags(stacked, tree):
    """Each flat leaf's value of a ``stacked=`` tree prefix."""
    return jax.tree.leaves(jax.tree.map(lambda flag, sub: jax.tree.map(lambda _: flag, sub),
                                        stacked, tree))


def _count(sub, depth):
    return 1 if not depth else len(sub) * _count(sub[0], depth - 1)


def to_loop(tree, depths):
    def split(a, d):
        return a if not d else [split(a[i], d - 1) for i in range(a.shape[0])]

    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [split(a, d) for a, d in zip(leaves, depths)])


def from_loop(loop, like, depths):
    def join(sub, d):
        return sub if not d else jnp.stack([join(s, d - 1) for s in sub])

    treedef = jax.tree.structure(like)
    return jax.tree.unflatten(treedef, [join(s, d) for s, d in
                                        zip(treedef.flatten_up_to(loop), depths)])


def grads_at(case, params, t):
    """Gradients that change with the step and the params; at step ``case.nan_at``, layer 0
    of the blocks' ``w`` holds a NaN."""
    grads = jax.tree.map(lambda a: jnp.sin(3.0 * a + t) + 0.2 * jnp.cos(t * a) - 0.05 * t,
                         params)
    if case.nan_at is not None:
        w = grads["blocks"]["w"]
        grads["blocks"]["w"] = jnp.where(t == case.nan_at, w.at[(0,) * len(case.layers)].set(
            jnp.nan), w)
    return grads


def optimizers(case: Case):
    """The wrapped optimizer, and plain optax's on the loop model, ``freeze`` and
    ``lr_scale`` there written as transformations before and after the chain (inside the
    wrapper where ``layerwise`` is)."""
    pairs = [PARTS[name](case) for name in case.parts]
    wrap = WRAPPERS[case.wrapper]
    layerwise = lambda tx: so.layerwise(tx, case.stacked(), freeze=case.freeze,  # noqa: E731
                                        lr_scale=case.lr_scale)
    chain = optax.chain(*(w for w, _ in pairs))
    wrapped = wrap(layerwise(chain)) if case.outside else layerwise(wrap(chain))
    controls = _Controls(case, jax.eval_shape(case.params))
    before = optax.stateless(lambda u, _: controls.zero(u))
    after = optax.stateless(lambda u, _: controls.zero(controls.scale(u)))
    chain = optax.chain(*(r for _, r in pairs))
    plain = (wrap(optax.chain(before, chain, after)) if case.outside
             else optax.chain(before, wrap(chain), after))
    return wrapped, plain


def check(case: Case) -> None:
    """The wrapped updates equal the loop model's at every step (a named AssertionError)."""
    params = case.params()
    depths = case.depths(params)
    wrapped, plain = optimizers(case)

    @jax.jit
    def loop_step(loop, state, t):
        grads = to_loop(grads_at(case, from_loop(loop, params, depths), t), depths)
        return plain.update(grads, state, loop)

    wrapped_step = jax.jit(lambda p, s, t: wrapped.update(grads_at(case, p, t), s, p))
    loop = to_loop(params, depths)
    state, w_state = plain.init(loop), wrapped.init(params)
    for t in range(case.steps):
        stacked = from_loop(loop, params, depths)
        updates, state = loop_step(loop, state, t)
        got, w_state = wrapped_step(stacked, w_state, t)
        want = from_loop(updates, params, depths)
        for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
            largest = float(np.nanmax(np.abs(y), initial=0.0))
            np.testing.assert_allclose(
                x, y, rtol=RTOL, atol=ATOL_OF_LARGEST * max(largest, 1e-6),
                err_msg=f"{case}: step {t}, leaf {jax.tree_util.keystr(path)}")
        loop = optax.apply_updates(loop, updates)


class _Controls:
    """``freeze`` and ``lr_scale`` on the loop model: frozen layers' gradients and updates
    zero, layer i's updates times ``lr_scale[i]``."""

    def __init__(self, case, params):
        self.case, self.depths, self.layer_of = case, case.depths(params), case.layer_of(params)
        self.treedef = jax.tree.structure(params)

    def _map(self, tree, fn):
        subs = self.treedef.flatten_up_to(tree)
        out = []
        for s, d, at in zip(subs, self.depths, self.layer_of):
            out.append(s if not d else _map_layers(s, d, lambda i, a, at=at: fn(at(i), a)))
        return jax.tree.unflatten(self.treedef, out)

    def zero(self, tree):
        if self.case.freeze is None:
            return tree
        frozen = set(self.case.freeze)
        return self._map(tree, lambda i, a: jnp.zeros_like(a) if i in frozen else a)

    def scale(self, tree):
        if self.case.lr_scale is None:
            return tree
        s = self.case.lr_scale
        return self._map(tree, lambda i, a: (a * s[i]).astype(a.dtype))


def _map_layers(sub, depth, fn, start=0):
    if depth == 1:
        return [fn(start + i, a) for i, a in enumerate(sub)]
    inner = _count(sub[0], depth - 1)
    return [_map_layers(s, depth - 1, fn, start + i * inner) for i, s in enumerate(sub)]
