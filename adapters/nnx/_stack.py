"""``stackwise.nnx.Stack``: an ``nnx.Module`` built n times, held as one stacked block.

The adapter only turns a block into a pure ``(init, apply)`` pair with
``nnx.split`` / ``nnx.merge`` and hands it to :func:`stackwise.stack`; the
scan, remat, unroll and reverse all live in the core.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from flax import errors as flax_errors
from flax import nnx

import stackwise
from stackwise import _kit
from stackwise.nnx import _axis, _compare, _inside, _serving, _view

__all__ = ["Stack", "layer_index"]


def layer_index() -> jax.Array:
    """The index of the layer being run, from inside a block's ``__call__``.

    A traced int32 (the layers run inside one scan), so use it in jnp
    arithmetic, not in Python control flow. Inside nested stacks it is the
    index within the innermost one.

    >>> import jax.numpy as jnp, stackwise.nnx
    >>> from flax import nnx
    >>> class AddIndex(nnx.Module):
    ...     def __init__(self, rngs):
    ...         pass
    ...     def __call__(self, x):
    ...         return x * 10 + stackwise.nnx.layer_index()
    >>> blocks = stackwise.nnx.Stack(AddIndex, n=3, rngs=nnx.Rngs(0))
    >>> blocks(jnp.int32(0))  # ((0 * 10 + 0) * 10 + 1) * 10 + 2
    Array(12, dtype=int32)

    Returns:
      The layer's index, ``0`` for the first layer (also with ``reverse=True``,
      where the last layer, index ``n - 1``, runs first, and across a pattern).

    Raises:
      RuntimeError: called outside a block run by :class:`Stack`.
    """
    return _kit.current_layer_index("nnx")


def _unused(*args: Any) -> None:
    """The apply of the stack that only builds the layers (``Stack._build``)."""
    del args


# --------------------------------------------------------------------------
# The module.


class Stack(nnx.Module):
    """``n`` copies of an ``nnx.Module`` with stacked variables, run as one scanned layer.

    The loop it replaces, with n separately built blocks:

    >>> import jax, jax.numpy as jnp, stackwise.nnx
    >>> from flax import nnx
    >>> class Block(nnx.Module):
    ...     def __init__(self, d, rngs):
    ...         self.linear = nnx.Linear(d, d, rngs=rngs)
    ...         self.norm = nnx.BatchNorm(d, rngs=rngs)
    ...     def __call__(self, x):
    ...         return x + jax.nn.gelu(self.norm(self.linear(x)))
    >>> blocks = [Block(8, nnx.Rngs(i)) for i in range(4)]
    >>> x = jnp.ones((2, 8))
    >>> y_loop = x
    >>> for block in blocks:
    ...     y_loop = block(y_loop)

    The same as one module: variables gain a leading layer axis, the block is
    traced once whatever ``n``, and BatchNorm statistics (any non-``Param``
    variable) are updated in place, as in the loop:

    >>> stack = stackwise.nnx.Stack.from_layers(
    ...     [Block(8, nnx.Rngs(i)) for i in range(4)])
    >>> stack.layers.linear.kernel.shape
    (4, 8, 8)
    >>> y = stack(x)
    >>> bool(jnp.allclose(y, y_loop, atol=1e-5))
    True
    >>> bool(jnp.allclose(stack.layers.norm.mean[3], blocks[3].norm.mean[...]))
    True

    Usually it is built in a model's ``__init__`` from a function of ``rngs``:

    >>> class Model(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.blocks = stackwise.nnx.Stack(
    ...             lambda rngs: Block(8, rngs), n=24, rngs=rngs, remat=True)
    ...     def __call__(self, x):
    ...         return self.blocks(x)
    >>> model = Model(nnx.Rngs(0))
    >>> nnx.jit(lambda m, x: m(x))(model, x).shape
    (2, 8)

    Per-layer inputs and outputs: an argument wrapped in
    :func:`stackwise.per_layer` gives layer i its slice i; values a block
    ``sow`` s under ``nnx.capture`` come back stacked; :func:`stackwise.nnx.layer_index` is the
    running layer's index; with ``has_aux=True`` a block returns ``(x, aux)``:

    >>> class Scale(nnx.Module):
    ...     def __init__(self, rngs):
    ...         pass
    ...     def __call__(self, x, s):
    ...         self.sow(nnx.Intermediate, "seen", x)
    ...         return x * s
    >>> scales = stackwise.nnx.Stack(Scale, n=3, rngs=nnx.Rngs(0))
    >>> forward = nnx.capture(scales, nnx.Intermediate)
    >>> y, sown = forward(jnp.float32(1.0), stackwise.per_layer(jnp.array([2.0, 3.0, 4.0])))
    >>> y
    Array(24., dtype=float32)
    >>> sown["layers"]["seen"][0]  # the x each layer received
    Array([1., 2., 6.], dtype=float32)

    Args:
      make_block: ``block = make_block(rngs)``, returning an ``nnx.Module``
        (a class taking ``rngs`` works). It is called once, under
        :func:`jax.vmap`, with an ``nnx.Rngs`` whose every stream holds layer
        i's key: the stack equals ``[make_block(r) for r in rngs.split(n)]``
        (what ``nnx.split_rngs`` + ``nnx.vmap`` build).
      n: the number of layers, a positive int.
      rngs: the ``nnx.Rngs`` to build the layers from: each stream gives one
        key, split into n.
      remat: rematerialise each layer in the backward pass (``True`` or a
        :mod:`jax.checkpoint_policies` policy); see :func:`stackwise.stack`.
        The default, ``stackwise.DEFAULT_REMAT``, saves matmul outputs only.
      nested: also checkpoint groups of layers (sqrt(n) remat), as in
        :func:`stackwise.stack`.
      unroll: passed to the scan; ``True`` runs a Python loop.
      reverse: run the last layer first.
      has_aux: the block returns ``(x, aux)``; the stack then returns ``(x,
        aux)``, aux stacked along a leading ``n`` axis.
      layer_axis_name: the mesh axis name put first in the ``out_sharding``
        metadata (from ``nnx.with_partitioning``) of every stacked variable:
        ``None`` replicates across layers, a mesh axis name splits them.

    Calling the stack, ``stack(x, *args, **kwargs)``, runs
    ``x = block_i(x, *args, **kwargs)`` for every layer. ``nnx.Param`` s are
    read only inside; every other variable (batch statistics, RNG counters,
    caches) is updated and written back stacked. An
    ``nnx.Rngs`` argument is split per layer, so every layer draws
    independent randomness (and the stream's count advances once).
    For decoding, :func:`stackwise.nnx.to_serving` gives a new Stack (or model)
    with per-layer buffers (each Variable a ``stackwise.Serving``), which it
    runs as a loop of the layers, each cache written in its own buffer.

    LoRA and quantized weights (``docs/finetune.md``): the ``nnx.Param`` s may
    hold ``stackwise.lora.attach(..., per_leaf=True)`` and
    ``stackwise.quant.quantize`` leaves. A batch of g adapters
    (``stackwise.lora.stack_adapters``) runs group j of ``x``'s leading axis
    with adapter j; every group draws the same keys, and a variable a group
    updates from its rows (batch statistics in training) is refused.

    Raises:
      TypeError: ``make_block`` not callable or not returning an
        ``nnx.Module``, ``n`` not an int, or a block that changes the shape
        or dtype of ``x``.
      ValueError: ``n < 1``, or stacked variables whose leading axis is not
        ``n`` (the variables are named).
    """

    def __init__(
        self,
        make_block: Callable[[nnx.Rngs], nnx.Module] | Sequence[Callable[[nnx.Rngs], nnx.Module]],
        n: int,
        *,
        rngs: nnx.Rngs | None,
        remat: bool | Callable[..., Any] = stackwise.DEFAULT_REMAT,
        nested: bool | int = False,
        unroll: int | bool = 1,
        reverse: bool = False,
        has_aux: bool = False,
        fsdp: str | tuple[str, ...] | None = None,
        layer_axis_name: str | None = None,
    ):
        who = _kit.stack_name("nnx", make_block, n)
        _kit.hold_options(self, who, n, locals())
        self.layer_axis_name = _kit.check_layer_axis_name(layer_axis_name, who)
        if isinstance(make_block, _kit.Prebuilt):
            self.pattern = isinstance(make_block.layers, (list, tuple))
            self.layers = nnx.List(make_block.layers) if self.pattern else make_block.layers
            return
        self.pattern = isinstance(make_block, (list, tuple))
        makers = list(make_block) if self.pattern else [make_block]
        if not makers:
            raise ValueError(f"{who}: a pattern needs at least one `make_block`; got [].")
        for make in makers:
            if isinstance(make, nnx.Module):
                raise TypeError(
                    f"{who}: `make_block` must be a function of `rngs` that builds a "
                    f"block, got a built {type(make).__name__} module. Build each layer "
                    f"from its own keys: `Stack(lambda rngs: {type(make).__name__}(..., "
                    "rngs=rngs), n, rngs=rngs)`, or stack built blocks with "
                    "`Stack.from_layers([block_0, ..., block_{n-1}])`."
                )
            if not callable(make):
                raise TypeError(
                    f"{who}: `make_block` must be a function of `rngs` that returns an "
                    f"nnx.Module, got {type(make).__name__} {make!r}. E.g. "
                    "`Stack(lambda rngs: Block(512, rngs=rngs), n=24, rngs=rngs)`."
                )
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(
                f"{who}: `rngs` must be an nnx.Rngs (the layers are built from its keys), "
                f"got {type(rngs).__name__} {rngs!r}."
            )
        built = self._build(makers, rngs, who)
        self.layers = nnx.List(built) if self.pattern else built[0]

    def _blocks(self) -> list[nnx.Module]:
        """The stacked block of each pattern position (one without a pattern)."""
        return list(self.layers) if self.pattern else [self.layers]

    def __len__(self) -> int:
        """The number of layers, ``n``."""
        return self.n

    def layer(self, i: int) -> nnx.Module:
        """Layer ``i`` as a block of its own: a copy of that one layer's variables.

        The block's properties computed from its variables' shapes and its methods
        (e.g. an ``init_cache``) then see one layer, not the stacked one; ``stack[i]``
        is the same. See :func:`stackwise.nnx._view.layer`.
        """
        return _view.layer(self, i)

    def __getitem__(self, i: int) -> nnx.Module:
        return _view.layer(self, i)

    def __iter__(self) -> Iterator[nnx.Module]:
        """Layers ``0 .. n-1``, each a copy of one layer (as :meth:`layer`)."""
        return _view.iter_layers(self)

    def _build(self, makers: list, rngs: nnx.Rngs, who: str) -> list[nnx.Module]:
        keys = _inside.stream_keys(rngs)
        names = list(keys)
        graphdefs: list = [None] * len(makers)

        def init(p):
            make = makers[p]

            def one(key, other_keys):
                layer_rngs = nnx.Rngs(**({names[0]: key} if names else {}), **other_keys)
                try:
                    block = make(layer_rngs)
                except TypeError as e:
                    raise TypeError(
                        f"{who}: `make_block(rngs)` failed: {e}. The Stack calls "
                        f"`make_block(rngs)` once per layer; give the block's other "
                        "arguments in a function, e.g. `lambda rngs: "
                        "nnx.Linear(512, 512, rngs=rngs)`."
                    ) from None
                except flax_errors.TraceContextError as e:
                    raise TypeError(
                        f"{who}: `make_block` used an `nnx.Rngs` other than the one it is "
                        f"given ({e}). Build each layer from its argument: `lambda rngs: "
                        "Block(..., rngs=rngs)`, not from the `rngs` of the enclosing "
                        "model."
                    ) from None
                if not isinstance(block, nnx.Module):
                    raise TypeError(
                        f"{who}: `make_block` must return an nnx.Module, but it returned "
                        f"{type(block).__name__}. Pass a function that builds one block "
                        "from `rngs`, e.g. `lambda rngs: Block(512, rngs=rngs)`."
                    )
                graphdef, params, rest = nnx.split(block, nnx.Param, ...)
                graphdefs[p] = graphdef
                _axis.add((params, rest), self.layer_axis_name)
                return params, rest

            return one

        first = keys[names[0]] if names else jax.random.key(0)
        others = {k: stackwise.per_layer_keys(keys[k]) for k in names[1:]}
        inits = [init(p) for p in range(len(makers))]
        layers = stackwise.stack(
            inits if self.pattern else inits[0],
            [_unused] * len(makers) if self.pattern else _unused,
            self.n,
            with_state=True,
        )
        params, rest = layers.init(first, others)
        if not self.pattern:
            params, rest = (params,), (rest,)
        return [
            nnx.merge(graphdefs[p], _axis.shard_eagerly(params[p]), _axis.shard_eagerly(rest[p]))
            for p in range(len(makers))
        ]

    def _who(self) -> str:
        blocks = self._blocks()
        return _kit.stack_name("nnx", blocks if self.pattern else blocks[0], self.n)

    def _check_layers(self, outside: list | None = None) -> None:
        """Every variable of the stacked block(s) has the layer axis of its pattern
        position first (ValueError naming those that do not). ``outside[p]``: paths of
        position p's RNG streams set from outside, which have none (see ``_inside``).
        In the serving layout: every variable served, with its position's layers."""
        blocks, who = self._blocks(), self._who()
        if _serving.served(self):
            _serving.check(self, who)
            return
        for p, block in enumerate(blocks):
            skip = _inside.outside_filter(outside[p] if outside else [])
            _, _, params, rest = nnx.split(block, skip, nnx.Param, ...)
            from_qwix = any(_kit.holds_qwix(node) for _, node in nnx.iter_graph(block))
            self._check_depth(params, len(range(p, self.n, len(blocks))), who, from_qwix)
            self._check_depth(rest, len(range(p, self.n, len(blocks))), who, from_qwix)

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        blocks = self._blocks()
        who, k = self._who(), len(blocks)
        # RNG streams set on a block from outside (qwix's `qwix_rngs`): split per layer.
        outside = [_inside.outside_streams(block) for block in blocks]
        self._check_layers(outside)
        serving = _serving.served(self)
        filters = [_inside.outside_filter(paths) for paths in outside]
        split = [nnx.split(b, nnx.Param, f, ...) for b, f in zip(blocks, filters)]
        grown: list = [None] * k  # a position's new graphdef, if it grew
        applies = [self._layer_apply(split[p], filters[p], outside[p], p, grown) for p in range(k)]
        layers = stackwise.stack(
            None,
            applies if self.pattern else applies[0],
            self.n,
            with_state=True,
            name=who,  # the core names the block in its errors (carry, returns)
            **{name: getattr(self, name) for name in _kit.OPTION_NAMES},
        )
        args, kwargs = _inside.split_rngs_args(args, kwargs)
        params = [params for _, params, _, _ in split]
        rest = [rest for _, _, _, rest in split]
        if serving:  # per-layer buffers: the core's Python loop of the layers
            params = _serving.gather(params, self, who, "params")
            rest = _serving.gather(rest, self, who, "variables")
        else:
            params, rest = (tuple(params), tuple(rest)) if self.pattern else (params[0], rest[0])
            _kit.warn_unrematted(params, self.remat, who, graph=blocks)  # qwix: in the graph
        extras = {
            "index": stackwise.layer_index(),
            "streams": [_inside.draw(b, paths) for b, paths in zip(blocks, outside)],
        }
        out, new_rest = layers.apply(params, rest, x, extras, _kit.CallArgs(args, kwargs))
        if serving:
            new_rest = _kit.serving.scatter(new_rest, k)
        for pos, new in enumerate(new_rest if self.pattern or serving else [new_rest]):
            if grown[pos] is None:
                nnx.update(blocks[pos], new)
                continue
            streams = nnx.state(blocks[pos], filters[pos])  # their counts advanced
            rebuilt = nnx.merge(grown[pos], *new, streams)
            if self.pattern:
                self.layers[pos] = rebuilt
            else:
                self.layers = rebuilt
        return out

    def _layer_apply(self, split: tuple, keep: Any, outside: list, pos: int, grown: list):
        """Position ``pos``'s layer for the core: ``apply(params, state, x, extras, call)``
        merges one layer's block, runs it and returns its new state (its graph grown:
        ``(params, state)``, and ``grown[pos]`` its new graphdef)."""
        graphdef, _, streams, _ = split
        who = self._who()

        def apply(p, s, x, extras, call):
            _axis.remove((p, s))
            # LoRA / quantized: float weights; a batch of adapters: one group per adapter.
            return _kit.run_layer(run, p, x, s, extras, call, who=who)

        def run(p, x, s, extras, call):
            # This trace's own variables (under a batch's vmap, one level inside the
            # scan's), so that the block may update them.
            fresh, s = jax.tree.map(lambda a: a, (streams, s))
            block = nnx.merge(graphdef, p, fresh, s)
            _inside.rekey(block, outside, extras["streams"][pos])
            before = nnx.graphdef(block)
            args, kwargs = _inside.join_rngs_args(call.args, call.kwargs)
            with _kit.at_layer(extras["index"]):
                out = block(x, *args, **kwargs)
            new_graphdef = _inside.grown(before, block)
            _, new_params, _, new_rest = nnx.split(block, nnx.Param, keep, ...)
            _axis.add(new_rest, self.layer_axis_name)
            if new_graphdef is None:
                return out, new_rest
            # The layer added or replaced variables (qwix's LoRA params, quantized
            # kernels): every variable leaves it, to be stacked as a new block.
            grown[pos] = new_graphdef
            _axis.add(new_params, self.layer_axis_name)
            return out, (new_params, new_rest)

        return apply

    def _check_depth(self, state: Any, n: int, who: str, from_qwix: bool = False) -> None:
        is_var = lambda v: isinstance(v, nnx.Variable)  # noqa: E731
        leaves = [
            (f"{_compare.path_name(path)} ({type(v).__name__})", a)
            for path, v in jax.tree_util.tree_leaves_with_path(state, is_leaf=is_var)
            for _, a in jax.tree_util.tree_leaves_with_path(v)
        ]
        _kit.check_depth(
            leaves,
            n,
            who,
            "variables",
            "Stacked variables come from building the Stack, or from "
            "`Stack.from_layers([block_0, ..., block_{n-1}])`. An `nnx.Rngs` set on the "
            "block from outside (as qwix's `qwix_rngs`) is split per layer when the Stack "
            "runs; to take the layers apart, set it to None first "
            "(`model.set_attributes(qwix_rngs=None)`)."
            + (_kit.qwix_fix("stackwise.nnx.quantize_params") if from_qwix else ""),
        )

    # ----------------------------------------------------------------------
    # Conversion to and from a list of per-layer blocks.

    def to_layers(self) -> list[nnx.Module]:
        """The n per-layer blocks, each a separate module holding layer i's variables.

        Exact: ``Stack.from_layers(stack.to_layers())`` gives back the same
        variables, bit for bit (and sharding metadata loses the layer axis).
        For a pattern, the blocks come in layer order (layer i is of the kind
        of position ``i % k``).

        >>> import jax.numpy as jnp, stackwise.nnx
        >>> from flax import nnx
        >>> stack = stackwise.nnx.Stack(
        ...     lambda rngs: nnx.Linear(2, 2, rngs=rngs), n=3, rngs=nnx.Rngs(0))
        >>> blocks = stack.to_layers()
        >>> bool(jnp.array_equal(blocks[2].kernel[...], stack.layers.kernel[2]))
        True

        Returns:
          A list of ``n`` blocks.
        """
        self._check_layers()
        stacked = self._blocks()
        k = len(stacked)
        blocks: list = [None] * self.n
        for p, block in enumerate(stacked):
            graphdef, state = nnx.split(block)
            for j, i in enumerate(range(p, self.n, k)):
                layer = _serving.take(state, j)  # stacked or served
                _axis.remove(layer)
                blocks[i] = nnx.merge(graphdef, layer)
        return blocks

    @classmethod
    def from_layers(
        cls,
        blocks: Sequence[nnx.Module],
        *,
        pattern: int = 1,
        layer_axis_name: str | None = None,
        **options: Any,
    ) -> Stack:
        """A :class:`Stack` holding the variables of separately built blocks.

        Layer i is ``blocks[i]``; the blocks must be of one type and
        configuration with variables of equal shapes and dtypes (with
        ``pattern=k``: the blocks of each position ``i % k``). The inverse of
        :meth:`to_layers`, exact.

        >>> import stackwise.nnx
        >>> from flax import nnx
        >>> blocks = [nnx.Linear(2, 3, rngs=nnx.Rngs(i)) for i in range(5)]
        >>> stackwise.nnx.Stack.from_layers(blocks).layers.kernel.shape
        (5, 2, 3)

        Args:
          blocks: the per-layer modules, in order.
          pattern: k, the length of the repeating pattern of block kinds.
          layer_axis_name: as for :class:`Stack`.
          **options: ``remat``, ``nested``, ``unroll``, ``reverse``, ``has_aux``,
            ``fsdp``, as for :class:`Stack`.

        Returns:
          The stack; the blocks themselves are left unchanged.

        Raises:
          TypeError: a block is not an ``nnx.Module`` or differs in structure,
            shapes or dtypes from the first block of its position.
          ValueError: no blocks, or fewer blocks than the pattern's length.
        """
        who = "stackwise.nnx.Stack.from_layers"
        _kit.check_built_options(options, _kit.OPTION_NAMES, who)
        _kit.check_layer_axis_name(layer_axis_name, who)
        blocks = _kit.check_built(blocks, pattern, nnx.Module, "an nnx.Module", who)
        stacked = [
            _compare.stack_blocks(blocks, range(p, len(blocks), pattern), layer_axis_name, who)
            for p in range(pattern)
        ]
        return cls(
            _kit.Prebuilt(stacked if pattern > 1 else stacked[0], "from_layers"),
            len(blocks),
            rngs=None,
            layer_axis_name=layer_axis_name,
            **options,
        )

    # ----------------------------------------------------------------------
    # The serving layout: per-layer buffers, converted once (see `_serving`).

    def to_serving(self) -> None:
        """Refused: the serving layout is made by :func:`stackwise.nnx.to_serving`.

        This method converted the Stack in place, and with it every module sharing its
        Variables; ``stackwise.nnx.to_serving(stack)`` (or ``(model, path)``) returns a new
        model and changes nothing.

        Raises:
          TypeError: always, naming the call that replaced it.
        """
        raise _kit.serving.moved(f"{self._who()}.to_serving()", "stackwise.nnx.to_serving(stack)")

    def from_serving(self) -> None:
        """Refused: :func:`stackwise.nnx.from_serving` converts back, to a new model.

        Raises:
          TypeError: always, naming the call that replaced it.
        """
        raise _kit.serving.moved(
            f"{self._who()}.from_serving()", "stackwise.nnx.from_serving(stack)"
        )
