"""Compile-only for a v5e (libtpu, no chip): trace+lower and XLA compile times (wall and process CPU) and program counts of tpu_train.py rows, interleaved; plus a hand-written lax.scan+jax.checkpoint of the same block. Run with PYTHONPATH=<libtpu dir> TPU_ACCELERATOR_TYPE=v5litepod-1 TPU_WORKER_HOSTNAMES=localhost JAX_PLATFORMS=cpu."""
import sys, time, re, statistics, json, os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax, jax.numpy as jnp
from jax.experimental import topologies
import tpu_train
from stackwise.bench.config import BenchConfig
from stackwise.bench.workloads import common, core
import stackwise

dev = topologies.get_topology_desc(platform="tpu", topology_name="v5e:1x1",
                                   chips_per_host_bounds=[1,1,1]).devices[0]
shard = jax.sharding.SingleDeviceSharding(dev)

import argparse
p = argparse.ArgumentParser()
p.add_argument("--d", type=int, default=256); p.add_argument("--heads", type=int, default=4)
p.add_argument("--hidden", type=int, default=1024); p.add_argument("--n", type=int, default=16)
p.add_argument("--seq", type=int, default=256); p.add_argument("--batch", type=int, default=2)
p.add_argument("--rows", default="stackwise, remat dots;nn.scan, remat dots")
p.add_argument("--reps", type=int, default=1)
p.add_argument("--dump", default="")
a = p.parse_args()
args = tpu_train.parse_args(["--d", str(a.d), "--heads", str(a.heads), "--hidden", str(a.hidden),
                             "--n", str(a.n), "--seq", str(a.seq), "--batch", str(a.batch)])
notes = []
found = tpu_train.builds(args, notes)
cfg = BenchConfig(tf_d=a.d, tf_hidden=a.hidden, tf_heads=a.heads, tf_seq=a.seq, tf_batch=a.batch)
layer_init, layer, inputs = core.transformer_block(cfg)
def hand(policy, prevent_cse=False):
    def build(n):
        stacked, x = inputs(n)
        body = lambda h, p: (layer(p, h), None)
        body = jax.checkpoint(body, prevent_cse=prevent_cse, policy=policy)
        return stacked, x, lambda ps, h: common.mean_square(jax.lax.scan(body, h, ps)[0])
    return build
found["hand scan, remat dots"] = hand(stackwise.DEFAULT_REMAT)
found["hand scan cse, remat dots"] = hand(stackwise.DEFAULT_REMAT, True)
found["hand scan, remat full"] = hand(None)
def sw(**o):
    def build(n):
        stacked, x = inputs(n)
        layers = stackwise.stack(layer_init, layer, n, **o)
        return stacked, x, lambda ps, h: common.mean_square(layers.apply(ps, h))
    return build
found["sw, remat dots"] = sw()
import stackwise.bench.workloads.flax as fw
for c in fw.transformer(cfg, []):
    found["flax:" + c.name] = c.build

def sds(t):
    return jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shard), t)

rows = a.rows.split(";")
builds = {}
for r in rows:
    params, x, loss = found[r](a.n)
    builds[r] = (sds(params), sds(x), loss)
times = {r: [] for r in rows}
for rep in range(a.reps):
    for r in rows:
        ps, xx, loss = builds[r]
        jax.clear_caches()
        c0 = time.process_time(); t0 = time.perf_counter()
        traced = tpu_train.sgd_step(tpu_train.in_bfloat16(loss)).trace(ps, xx)
        lowered = traced.lower()
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter(); c2 = time.process_time()
        times[r].append((t1 - t0, t2 - t1, c2 - c0))
        if rep == 0:
            txt = lowered.as_text(); hlo = compiled.as_text()
            st = {k: len(re.findall(pat, txt)) for k, pat in
                  [("while", r"stablehlo\.while"), ("opt_barrier", r"optimization_barrier"),
                   ("custom_call", r"custom_call"), ("dot_general", r"dot_general"),
                   ("convert", r"convert"), ("dyn_slice", r"dynamic_slice"), ("func", r"func\.func")]}
            st["stablehlo_chars"] = len(txt)
            hst = {k: len(re.findall(pat, hlo)) for k, pat in
                   [("while", r" while\("), ("fusion", r" fusion\("), ("convolution", r"convolution\("),
                    ("copy", r" copy\("), ("custom-call", r"custom-call\("), ("opt-barrier", r"opt-barrier")]}
            hst["hlo_chars"] = len(hlo)
            mem = compiled.memory_analysis()
            print(r, "| stablehlo", st, "| hlo", hst, "| temp MiB", mem.temp_size_in_bytes / 2**20, flush=True)
            if a.dump:
                tag = re.sub(r"[^a-z0-9]+", "_", r.lower())
                open(f"{a.dump}/{tag}.mlir", "w").write(txt); open(f"{a.dump}/{tag}.hlo", "w").write(hlo)
        print(r, "lower %.2f compile %.2f cpu %.2f" % times[r][-1], flush=True)
print("MEDIANS")
for r in rows:
    print(f"{r:40s} lower {statistics.median(t[0] for t in times[r]):.2f} compile {statistics.median(t[1] for t in times[r]):.2f} cpu {statistics.median(t[2] for t in times[r]):.2f}")
