#!/usr/bin/env bash
# The measurements of issue 38 on a TPU host, in as few runs as the chip's time allows: each
# PART writes what it measured under OUT_DIR, within its own time limit, so that a part cut
# short loses only itself. Run from the checkout's root on the TPU host, after
# ../shared/tpu/prepare made .tpu/ here (and ship .tpu/ with the checkout):
#
#     benchmarks/on_tpu.sh OUT_DIR PART [PART...]
#
# PARTs: main (the README's main command, as a new user runs it), decode (benchmarks/
# tpu_decode_hlo.py --time: per-token time of the decode variants over sizes, with the compiled
# program's facts), decode48 (the same at n=48, one size), generate (benchmarks/tpu_generate.py
# --time: 32 tokens under one jit, the stacked layout's decodes and to_serving inside the jit
# against the loop, at three sizes; GENERATE_AUTO_CACHE=1: the cache in the compiler's layout), profile (a jax.profiler trace of the loop and the scanned decode at one
# size), bench-decode (stackwise-bench's decode block: the core and every adapter, n 24),
# bench-decode-sizes (the same block's loops, unrolled Stacks and serving layout at other sizes), tier
# (.ci/tpu), tier1 and tier2 (each half its test files, STACKWISE_TPU_TIER_SHARD), tier-backend
# (.ci/tpu on the tests that read a backend's facts), train (benchmarks/tpu_train.py at remat
# dots and full, at most 8 min), train-off (the same without remat, at batch 4, ~2 min),
# train-unroll-dots and train-unroll-off (the loop, the stack and the stack at unroll=2),
# train-unrolled (the loop, the stack and the stack at unroll=True, at dots),
# train-profile (the loop and the stack traced by jax.profiler, with their compiled programs),
# train-compile (each adapter and its tool at dots, 7 interleaved cold compiles each),
# train-dots-b4 (the loop and the stack at dots, batch 4, beside train-off's rows), preset
# (the example's --preset v5e), multi-lora (benchmarks/multi_lora_decode.py at D=1024),
# autostack (benchmarks/autostack_compile.py: compile time at n=48 of the loop, stackwise.stack
# and stackwise.autostack of the same loop, the transformer block then the MLP block). Copy
# what belongs in
# benchmarks/results/ from OUT_DIR by hand, with the date. At the end every log and the tier's
# folder are packed into OUT_DIR/logs.tar.gz (the device tool brings back 8 files at most; a
# second call with the same OUT_DIR packs into logs-2.tar.gz).
set -uo pipefail
out=${1:?"usage: benchmarks/on_tpu.sh OUT_DIR PART [PART...]"}
shift
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
source "$root/.tpu/install.sh"
(cd /tmp && python3 -P "$root/.ci/installed_matches.py" "$root") || exit 2  # (a stale wheel)
python3 -c 'import jax; print(jax.devices(), jax.__version__)' | tee "$out/device.txt"

part() {  # part NAME SECONDS COMMAND...: runs COMMAND from the checkout's root, logged and timed
    local name=$1 seconds=$2
    shift 2
    local begin=$SECONDS
    (cd "$root" && timeout -s INT -k 20 "$seconds" "$@") > "$out/$name.log" 2>&1
    echo "part $name: exit $? after $((SECONDS - begin)) s (limit $seconds s)" | tee -a "$out/parts.txt"
}

for what in "$@"; do
    case $what in
    main)
        part main 170 python3 examples/transformer_lm.py ;;
    decode)  # the loop and stackwise's three decodes (scanned, unroll=True, serving layout)
        part decode ${DECODE_SECONDS:-240} python3 benchmarks/tpu_decode_hlo.py --time 5 --variants loop,stackwise \
            --shapes ${DECODE_SHAPES:-256:512:8,512:1024:8,1024:2048:8,512:2048:32,1024:4096:4,2048:8192:1} \
            --markdown "$out/tpu_decode.md" ;;
    decode48)
        part decode48 100 python3 benchmarks/tpu_decode_hlo.py --time 5 --n 48 \
            --variants loop,stackwise --shapes 512:1024:8,256:4096:16 \
            --markdown "$out/tpu_decode48.md" ;;
    generate)  # ~4 min: 24 programs (3 sizes, 2 dtypes, 4 variants), each compiled then timed
        part generate ${GENERATE_SECONDS:-330} python3 benchmarks/tpu_generate.py --n 32 --tokens ${GENERATE_TOKENS:-32} \
            --time 5 --shapes ${GENERATE_SHAPES:-1536:1536:2,2048:512:1,768:2048:8} \
            ${GENERATE_AUTO_CACHE:+--auto-cache} --markdown "$out/tpu_generate.md" ;;
    profile)
        part profile 150 python3 benchmarks/tpu_decode_hlo.py --time 1 --shapes 512:1024:8 \
            --dtypes float32 --variants loop,stackwise --profile /tmp/decode-profile
        find /tmp/decode-profile -name '*.xplane.pb' -exec sh -c 'gzip -c "$1" > "$2"' _ {} "$out/decode.xplane.pb.gz" \; ;;
    bench-decode)
        # (stopped by its limit, the bench still writes the depths it measured: exit 130;
        # BENCH_DECODE_N sets the depths, default 24)
        part bench-decode ${BENCH_DECODE_SECONDS:-240} python3 -P -m stackwise.bench --blocks decode --decode-n ${BENCH_DECODE_N:-24} \
            --rounds 5 --csv '' --plot '' --no-progress --markdown "$out/bench_decode.md" ;;
    bench-decode-sizes)
        # the bench's decode block beyond its default size: each entry N:D:T:B:H of
        # BENCH_DECODE_SIZES (depth, width, cache positions, batch, heads) a part of its own,
        # BENCH_DECODE_SECONDS each, the rows BENCH_DECODE_VARIANTS (default: the loops, the
        # unrolled Stacks and the serving layout), in BENCH_DECODE_DTYPE (default float32;
        # bfloat16: params, cache and tokens cast to it). The bench holds every selected variant's
        # params and cache at once (11 rows here): each default size keeps that under 9 GB
        # (at 24:1024:2048:8 eleven 3.6-GB states did not fit a v5e's 15.7 GiB). A size took
        # 227-281 s on a v5e (7-11 rows, tpu_decode.md's sixth run): one or two sizes a call.
        # BENCH_DECODE_ALONE=1 measures one variant at a time (--one-at-a-time): sizes whose
        # states do not fit together, e.g. 24:2048:8192:1:16 (7 rows: 204-214 s, seventh run)
        # or 24:512:2048:32:8, a 6.4-GB cache (7 rows: 114-166 s a size, eighth run)
        for size in ${BENCH_DECODE_SIZES:-24:1024:1024:2:8 48:512:1024:2:8 24:256:8192:1:4}; do
            IFS=: read -r n d t b h <<< "$size"
            part "bench-decode-$n-$d-$t-$b" ${BENCH_DECODE_SECONDS:-330} python3 -P -m stackwise.bench \
                --blocks decode --decode-n "$n" --decode-shape "$d:$t:$b" --decode-heads "$h" \
                --decode-dtype "${BENCH_DECODE_DTYPE:-float32}" ${BENCH_DECODE_ALONE:+--one-at-a-time} \
                --variants "${BENCH_DECODE_VARIANTS:-loop,unroll,serving}" --rounds 5 --csv '' \
                --plot '' --no-progress --markdown "$out/bench_decode_$n-$d-$t-$b.md"
        done ;;
    tier)
        (cd /tmp && PYTEST_ADDOPTS="--durations=120" \
            STACKWISE_TPU_TIER_SECONDS=${STACKWISE_TPU_TIER_SECONDS:-450} \
            "$root/.ci/tpu" "$out/tier") > "$out/tier.log" 2>&1
        echo "part tier: exit $?" | tee -a "$out/parts.txt" ;;
    tier1|tier2)  # half the tier's test files each, for calls shorter than the tier
        (cd /tmp && PYTEST_ADDOPTS="--durations=60" STACKWISE_TPU_TIER_SHARD=${what#tier}/2 \
            STACKWISE_TPU_TIER_SECONDS=${STACKWISE_TPU_TIER_SECONDS:-270} \
            "$root/.ci/tpu" "$out/$what") > "$out/$what.log" 2>&1
        echo "part $what: exit $?" | tee -a "$out/parts.txt"
        cp "$out/$what/tpu_tier.md" "$out/${what}_record.md" 2>/dev/null ;;
    tier-backend)  # the tests that asserted XLA:CPU's facts, and their neighbours
        (cd /tmp && STACKWISE_TPU_TIER_SECONDS=150 "$root/.ci/tpu" "$out/tier" -m "not slow" \
            -k "memory or place or copy or alias or install_hint" "$root/tests/core" \
            "$root/tests/adapters") > "$out/tier.log" 2>&1
        echo "part tier-backend: exit $?" | tee -a "$out/parts.txt" ;;
    train)  # at most 8 min: the 6 rows at dots (not unroll=2: train-unroll-dots), 3 compiles
        # each (the loop's 1), ~3.5 min;
        # at full the 5 without the loop (its row: benchmarks/results/tpu_train.md), ~2.5 min
        part train-dots 280 python3 benchmarks/tpu_train.py --remat dots \
            --variants "loop,stackwise,nn.scan,hk.layer_stack,.Stack" \
            --markdown "$out/tpu_train_dots.md"
        part train-full 200 python3 benchmarks/tpu_train.py --remat full \
            --variants "stackwise,.Stack,nn.scan,hk.layer_stack" \
            --markdown "$out/tpu_train_full.md" ;;
    train-compile)  # ~4 min: each adapter and its framework's tool at dots, 7 cold compiles
        # each, interleaved (their medians: compile against the tool beyond three compiles' noise)
        part train-compile 280 python3 benchmarks/tpu_train.py --remat dots --compiles 7 \
            --rounds 3 --variants "nn.scan,stackwise.flax.Stack,hk.layer_stack,stackwise.haiku.Stack" \
            --markdown "$out/tpu_train_compile_dots.md" ;;
    train-off)  # ~2 min, not in train: without remat at batch 4 (at 8 the scans do not fit)
        part train-off 150 python3 benchmarks/tpu_train.py --remat off --batch 4 --compiles 1 \
            --variants "stackwise,.Stack,nn.scan,hk.layer_stack" \
            --markdown "$out/tpu_train_off_b4.md" ;;
    train-dots-b4)  # ~1.5 min: the loop and the stack with the matmuls saved at batch 4, beside
        # train-off's rows (the same batch, no remat)
        part train-dots-b4 130 python3 benchmarks/tpu_train.py --remat dots --batch 4 --compiles 1 \
            --variants "loop,stackwise" --markdown "$out/tpu_train_dots_b4.md" ;;
    train-unroll-dots)  # <3 min: the loop, the stack and the stack at unroll=2, one compile each
        part train-unroll-dots 170 python3 benchmarks/tpu_train.py --remat dots --compiles 1 \
            --variants "loop,stackwise,stackwise unroll=2" --markdown "$out/tpu_train_unroll_dots.md" ;;
    train-unroll-off)  # the same without remat, at batch 4 (at 8 the scans do not fit)
        part train-unroll-off 150 python3 benchmarks/tpu_train.py --remat off --batch 4 \
            --compiles 1 --variants "loop,stackwise,stackwise unroll=2" \
            --markdown "$out/tpu_train_unroll_off_b4.md" ;;
    train-unrolled)  # ~2 min: the loop, the stack and the stack at unroll=True (compiled once,
        # as the loop is: 38-45 s each on the v5e's host, tpu_train.md's eighth run)
        part train-unrolled 300 python3 benchmarks/tpu_train.py --remat dots --compiles 1 \
            --variants "loop,stackwise,stackwise unroll=True" --markdown "$out/tpu_train_unrolled_dots.md" ;;
    train-profile)  # ~3 min: the loop and the stack, traced (jax.profiler) and their compiled
        # programs' text, with the matmuls saved (batch 8) and without remat (batch 4): the
        # traces (~1-14 MB each), programs and tables in one file, OUT/train_profile.tar.gz
        part train-profile-dots 150 python3 benchmarks/tpu_train.py --remat dots --compiles 1 \
            --rounds 3 --variants "loop,stackwise" --profile /tmp/train-profile \
            --markdown /tmp/train-profile/tpu_train_profile_dots.md
        part train-profile-off 130 python3 benchmarks/tpu_train.py --remat off --batch 4 \
            --compiles 1 --rounds 3 --variants "loop,stackwise" --profile /tmp/train-profile \
            --markdown /tmp/train-profile/tpu_train_profile_off_b4.md
        tar -C /tmp -czf "$out/train_profile.tar.gz" train-profile ;;
    preset)  # the example at the size of one v5e (--preset v5e), as a TPU user runs it
        part preset 300 python3 examples/transformer_lm.py --preset v5e --checkpoint /tmp/lm-v5e \
            --save-every 300 ;;
    multi-lora)  # a multi-LoRA batch against the base alone, per token, at a chip's sizes
        part multi-lora 200 python3 benchmarks/multi_lora_decode.py --n 24 --d 1024 --batch 8 \
            --cache 2048 --rounds 9 --markdown "$out/multi_lora_decode.md" ;;
    autostack)  # ~3 min: each block's loop in a child given 60 s (stopped past that, its row
        # says so), then 5 interleaved pairs of cold compiles of the stack and the autostacked
        # loop after a warm-up each; each block's table written as it ends
        part autostack ${AUTOSTACK_SECONDS:-240} python3 benchmarks/autostack_compile.py \
            --pairs ${AUTOSTACK_PAIRS:-5} --loop-seconds ${AUTOSTACK_LOOP_SECONDS:-60} \
            --markdown "$out/autostack_tpu.md" ;;
    *)
        echo "unknown part $what (main, decode, decode48, generate, profile, bench-decode, bench-decode-sizes, tier, tier1, tier2, tier-backend, train, train-off, train-unroll-dots, train-unroll-off, train-unrolled, train-profile, train-compile, train-dots-b4, preset, multi-lora, autostack)" >&2
        exit 2 ;;
    esac
done
# (a second call with the same OUT_DIR packs into logs-2.tar.gz, and so on: none is overwritten)
logs=logs.tar.gz
for ((i = 2; ; i++)); do [ -e "$out/$logs" ] || break; logs=logs-$i.tar.gz; done
(cd "$out" && find . -maxdepth 1 \( -name '*.log' -o -name 'tier*' -type d \) | sed 's#^\./##' \
    | tar -czf "$logs" -T - --remove-files)
ls "$out"
