"""Training: the optimizer (per layer of the stack), the training loop with its validations,
saves and Ctrl-C, and the time a run has left."""

from __future__ import annotations

if __name__ == "__main__":  # run by mistake: not a command
    raise SystemExit(f"{__file__} is a module of the example's package, not a command; the "
                     "command is: python examples/transformer_lm.py (--help lists its flags)")

import argparse
import math
import signal
import time
from typing import Any

import jax
import optax
from tqdm.auto import tqdm

import stackwise.optax
from lm.cli import RUN_DEFAULTS, UsageError
from lm.data import describe_loss, sample_batch
from lm.model import loss_fn

OPTIMIZERS = {
    "adamw": lambda lr: optax.adamw(lr, 0.9, 0.99),
    "lamb": lambda lr: optax.lamb(lr, 0.9, 0.99),
    "adafactor": lambda lr: optax.adafactor(lr),
    "muon": lambda lr: optax.contrib.muon(lr),
}


def make_optimizer(args: argparse.Namespace, *, layerwise: bool = True):
    """The optimizer, through ``stackwise.optax.layerwise``: the blocks' leaves are stacked
    (every framework's params name them "blocks"), so LAMB's trust ratio, Adafactor's factored
    moments and Muon's orthogonalisation run per layer, as in the loop model, and the global
    norm stays global. ``layerwise=False``: the plain optimizer (for the loop model's params)."""
    warmup = min(100, max(1, args.steps // 10))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup, max(args.steps, 2), args.lr / 10
    )
    tx = optax.chain(optax.clip_by_global_norm(1.0), OPTIMIZERS[args.optimizer](schedule))
    if not layerwise:
        return tx
    return stackwise.optax.layerwise(tx, stacked=lambda path: "blocks" in path)


def in_compute_dtype(params, dtype: str):
    """``params`` with their floating leaves cast to ``dtype`` (``--compute-dtype``): the
    model then computes in it, and the gradients come back float32 through the cast."""
    if dtype == "float32":
        return params
    return jax.tree.map(
        lambda a: a.astype(dtype) if jax.numpy.issubdtype(a.dtype, jax.numpy.floating) else a,
        params)


class StopOnCtrlC:
    """While active, the first Ctrl-C asks the training loop to stop after the current step
    (it then saves); a second one interrupts at once (KeyboardInterrupt)."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True  # (no printing here: the loop reports it)

    def __enter__(self):
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread: Ctrl-C keeps its usual meaning
            self._previous = None
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def scanned(args: argparse.Namespace) -> str:
    """How the blocks run: ``4 blocks, one scan``; with a pattern of k kinds, one scan over
    the whole repeats of the pattern and the last ``layers % k`` blocks after it."""
    k = len(args.pattern.split(","))
    if k == 1:
        return f"{args.layers} blocks, one scan"
    repeats, tail = divmod(args.layers, k)
    rest = f", then {tail} block{'s' * (tail > 1)}" if tail else ""
    return f"{args.layers} blocks: one scan of {repeats} x {args.pattern}{rest}"


def train(lm, state, start: int, train_data, val, args, save, log=print) -> tuple[Any, dict]:
    """Trains ``state = {"params", "opt_state", "rng"}`` from step ``start`` to ``args.steps``.

    ``save(state, step, val_loss)`` is called every ``--save-every`` steps (validating there:
    by default the validations, every ``--steps``/8), at the last step and when Ctrl-C stops the
    run early. Returns the state and a record of the run (``record["stopped_at"]`` if stopped).
    """
    optimizer = make_optimizer(args)

    def step(params, opt_state, key):
        inputs, targets = sample_batch(key, train_data, args.batch, args.seq_len)
        loss, grads = jax.value_and_grad(
            lambda p: loss_fn(lm, in_compute_dtype(p, args.compute_dtype), inputs, targets)
        )(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    evaluate = jax.jit(lambda params: loss_fn(lm, params, *val))
    params, opt_state, key = state["params"], state["opt_state"], state["rng"]
    log_every = max(1, args.steps // 8)
    save_every = args.save_every or log_every
    tokens_per_step = args.batch * args.seq_len
    write = tqdm.write if not args.quiet else log
    with StopOnCtrlC() as ctrl_c:
        # Compiling is its own phase, before the progress bar: the bar's estimate then comes
        # from the steps' times alone.
        write(f"compiling the train step ({scanned(args)}); once, before step {start + 1}...")
        t0 = time.perf_counter()
        step = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, key).compile()
        val_loss = float(evaluate(params))  # (compiles the validation too)
        compile_s = time.perf_counter() - t0
        write(f"compiled in {compile_s:.1f} s")
        record = {"compile_s": compile_s, "val_loss": [(start, val_loss)], "losses": []}
        write(f"step {start:5d}  val {describe_loss(val_loss)}")
        bar = tqdm(range(start + 1, args.steps + 1), initial=start, total=args.steps,
                   disable=args.quiet, unit="step", dynamic_ncols=True)
        write = bar.write if not args.quiet else log
        estimate = Estimate(start, args.steps)
        t0 = time.perf_counter()
        i = start
        for i in bar:
            key, k = jax.random.split(key)
            params, opt_state, loss = step(params, opt_state, k)
            if (line := estimate.after(i, loss)) is not None:
                write(line)
            if i % 10 == 0 or i == args.steps:
                record["losses"].append((i, float(loss)))
                tok_s = (i - start) * tokens_per_step / (time.perf_counter() - t0)
                bar.set_postfix(loss=f"{record['losses'][-1][1]:.3f}", tok_s=f"{tok_s:,.0f}")
            if i % log_every == 0 or i % save_every == 0 or i == args.steps or ctrl_c.requested:
                val_loss = float(evaluate(params))
                check_finite(val_loss, i, args)  # (before saving: the last save stays finite)
                record["val_loss"].append((i, val_loss))
                save({"params": params, "opt_state": opt_state, "rng": key}, i, val_loss)
                write(f"step {i:5d}  train {float(loss):.3f}  val {describe_loss(val_loss)}")
            if ctrl_c.requested:
                record["stopped_at"] = i
                break
    bar.close()
    train_s = time.perf_counter() - t0
    record.update(train_s=train_s, tokens_per_s=(i - start) * tokens_per_step / max(train_s, 1e-9))
    log(
        f"trained steps {start + 1}-{i} in {train_s:.1f} s ({record['tokens_per_s']:,.0f} tokens/s)"
    )
    return {"params": params, "opt_state": opt_state, "rng": key}, record


class Estimate:
    """The time a run has left, from the times of its steps alone (not the compile): one line
    after the first ``WINDOW`` steps timed, which start after the first step."""

    WINDOW = 10

    def __init__(self, start: int, steps: int):
        self.steps, self.first, self.t0 = steps, start + 1, None

    def after(self, i: int, loss) -> str | None:
        """Called after step ``i`` with its (asynchronous) loss: the line to print, or None."""
        if i == self.first and self.steps - i > 2 * self.WINDOW:
            jax.block_until_ready(loss)
            self.t0 = time.perf_counter()
        elif self.t0 is not None and i == self.first + self.WINDOW:
            jax.block_until_ready(loss)
            per_step = (time.perf_counter() - self.t0) / self.WINDOW
            left = per_step * (self.steps - i)
            return (f"{per_step * 1e3:.0f} ms a step: about {duration(left)} for the "
                    f"{self.steps - i} steps left, plus validations and saves")
        return None


def duration(seconds: float) -> str:
    """``45 s``, ``12 min``, ``3.5 h``."""
    if seconds < 100:
        return f"{seconds:.0f} s"
    if seconds < 6000:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def check_finite(val_loss: float, step: int, args: argparse.Namespace) -> None:
    """Stops a run whose loss is no longer a number: sampling from it would be noise."""
    if not math.isfinite(val_loss):
        raise UsageError(
            f"training diverged: the validation loss is {val_loss} at step {step}; pass a "
            f"smaller --lr than {args.lr} (the default is {RUN_DEFAULTS['lr']}) and --overwrite."
        )

