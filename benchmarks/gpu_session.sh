#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md in one go, for a GPU lent for a few minutes:
#
#   bash benchmarks/gpu_session.sh STAGE [STAGE ...]     # stages: setup attention mfu mfu16k_profile mfu_dense mfu_flex mfu_compile mfu15 mfu15_compile mfu15_flex decode decode_large decode_profile loop loop15 fleet episodes tests tests_together tests_packing tests_flex
#
# Every stage runs under its own time limit (a hung stage loses only itself) and writes its log
# to $OUT/<stage>.log (OUT defaults to /tmp/gpu-out); the last lines of each log are printed at
# the end. Runs with the machine's python3 (torch, transformers, accelerate, peft preinstalled) and
# the pure-Python dependencies it lacks carried as wheels in .whl/ (docs/gpu.md, "Checking a GPU
# machine"): `setup` installs them into /tmp/site; grail itself runs from this checkout.
# DEADLINE (seconds, default 570) bounds the whole session: a stage gets at most the time left
# before it, and is skipped when under 30 s are left, so the command ends inside a device call's
# limit with the logs of what ran; put the stages in order of value.
# DRY_RUN=1 prints each stage's command instead of running it (no GPU needed): the test suite
# checks that every command still parses (tests/test_benchmarks.py).
# Not yet measured (issue 45), in the order to take them, one call of ~560 s:
#   DEADLINE=560 bash benchmarks/gpu_session.sh setup tests_together loop15 fleet episodes decode_profile mfu15
set -u
DEADLINE=${DEADLINE:-570}
DRY_RUN=${DRY_RUN:-0}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="/tmp/site:$PWD:$PWD/benchmarks" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
RUNS=/tmp/gpu-runs
PY=${PY:-python3}

stage() {  # stage NAME SECONDS COMMAND...: run COMMAND under a time limit, log to $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    if [ "$DRY_RUN" = 1 ]; then
        local cmd
        printf -v cmd ' %q' "$@"  # quoted as a shell reads it back
        echo "=== $name (dry run):$cmd" | tee -a "$OUT/$name.log"
        return
    fi
    local left=$((DEADLINE - SECONDS - 10))
    if [ "$left" -lt 30 ]; then
        echo "=== $name skipped: ${left}s left before the deadline" | tee -a "$OUT/$name.log"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name (limit ${limit}s): $*" | tee -a "$OUT/$name.log"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" >>"$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name rc=$rc in $((SECONDS - t0))s" | tee -a "$OUT/$name.log"
}

mfu() {  # one train_step_gpu.py measurement, appended to $OUT/mfu.jsonl
    local name=$1 limit=$2
    shift 2
    stage "$name" "$limit" $PY benchmarks/train_step_gpu.py "$@"
    grep -h '^{' "$OUT/$name.log" | tail -1 >>"$OUT/mfu.jsonl" || true
}

for s in "$@"; do
    case $s in
    setup)
        if [ "$DRY_RUN" = 1 ]; then echo "=== setup (dry run): installs .whl/*.whl, prints the GPU"; continue; fi
        if ls .whl/*.whl >/dev/null 2>&1; then
            $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target /tmp/site .whl/*.whl >"$OUT/setup.log" 2>&1 || echo "pip install failed"
        fi
        { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
          $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
          nproc; } 2>&1 | tee -a "$OUT/setup.log"
        ;;
    attention)  # one packed row's attention: dense mask vs per sample vs varlen (seconds)
        stage attention 60 $PY benchmarks/attention_gpu.py
        ;;
    mfu)  # the update on the Qwen2.5-0.5B shape, 151,936-token vocab, completions uniform mean 512
        A="--json --warmup 2 --steps 4"
        mfu mfu_default 120 $A --profile                   # grail-train's defaults (packed sdpa, 4096)
        mfu mfu_16k 100 $A --micro-batch-tokens 16384 --batch-size 64
        ;;
    mfu16k_profile)  # 16,384-token pieces, micro-batch 64, eager, with the profile of one update
        mfu mfu_16k_profile 110 --json --warmup 2 --steps 4 --micro-batch-tokens 16384 --batch-size 64 --profile
        ;;
    mfu_dense)  # before packed sdpa: the dense block-diagonal mask, 3.6% on an H200 (2026-11-26)
        mfu mfu_dense_mask 100 --json --warmup 2 --steps 4 --attn-implementation sdpa
        ;;
    mfu_flex)  # flex_attention: its compilation took > 120 s here (2026-11-26)
        mfu mfu_flex_compile 240 --json --warmup 3 --steps 4 --micro-batch-tokens 16384 --batch-size 64 --attn-implementation flex_attention --compile
        ;;
    mfu_compile)  # the same with the body compiled (train.compile)
        A="--json --warmup 3 --steps 4 --micro-batch-tokens 16384 --batch-size 64 --compile"
        mfu mfu_sdpa_compile 150 $A
        ;;
    mfu15)  # the Qwen2.5-1.5B shape, packed sdpa
        mfu mfu15 150 --json --warmup 2 --steps 3 --shape qwen2.5-1.5b --micro-batch-tokens 16384 --batch-size 64
        ;;
    mfu15_compile)  # the Qwen2.5-1.5B shape, packed sdpa, the body compiled
        mfu mfu15_compile 150 --json --warmup 3 --steps 3 --shape qwen2.5-1.5b --micro-batch-tokens 16384 --batch-size 64 --compile
        ;;
    mfu15_flex)  # the Qwen2.5-1.5B shape, flex_attention compiled
        mfu mfu15_flex_compile 200 --json --warmup 3 --steps 3 --shape qwen2.5-1.5b --micro-batch-tokens 16384 --batch-size 64 --attn-implementation flex_attention --compile
        ;;
    decode)  # the built-in engine, ~0.47B preset in bf16: eager vs static KV + CUDA graphs
        # eager only at the small shape: at 64x16x512 it takes minutes (8.2k tok/s measured before)
        stage decode 100 $PY benchmarks/engine_decode.py --preset mid --device cuda --shapes 8x8x256 --out "$OUT/decode_small.json"
        stage decode 100 $PY benchmarks/engine_decode.py --preset mid --device cuda --modes graph --shapes 64x16x512 --out "$OUT/decode_large.json"
        ;;
    tests_together)  # the three files that run on one GPU, side by side (a log each): the
        # correctness checks in the least device time; speed assertions in them get a shared GPU.
        # A test stuck past --timeout fails with its stack instead of being killed with the stage
        # (2026-11-27: the lookup episode run was still going when the stage's 260 s ran out).
        stage tests_together 260 bash -c "T='-m pytest -p no:cacheprovider -v --tb=short -rfEs --durations=8 --timeout=200 -o addopts='
            $PY \$T tests/gpu/test_gpu_builtin.py >'$OUT/tests_builtin.log' 2>&1 &
            $PY \$T tests/gpu/test_gpu_packing.py -k 'not flex' >'$OUT/tests_packing.log' 2>&1 &
            $PY \$T tests/gpu/test_gpu_weight_transfer.py tests/gpu/test_gpu_backends.py tests/gpu/test_gpu_distributed.py >'$OUT/tests_weights.log' 2>&1 &
            wait"
        ;;
    tests)  # one pytest per file, each under its own limit, so a slow file cannot hide the others' failures
        T="-m pytest -p no:cacheprovider -v --tb=short -rfEs --durations=5 --timeout=200 -o addopts="
        stage tests_weights 90 $PY $T tests/gpu/test_gpu_weight_transfer.py
        stage tests_packing 90 $PY $T tests/gpu/test_gpu_packing.py -k "not flex"
        stage tests_builtin 150 $PY $T tests/gpu/test_gpu_builtin.py
        stage tests_backends 60 $PY $T tests/gpu/test_gpu_backends.py tests/gpu/test_gpu_distributed.py
        ;;
    tests_packing)  # only the packed-attention tests
        stage tests_packing 90 $PY -m pytest -p no:cacheprovider -v --tb=short -rfEs -o addopts= tests/gpu/test_gpu_packing.py -k "not flex"
        ;;
    tests_flex)  # flex_attention compiles its kernels on first use: minutes
        stage tests_flex 200 $PY -m pytest -p no:cacheprovider -v --tb=short -o addopts= tests/gpu/test_gpu_packing.py -k flex
        ;;
    loop)  # grail-train end to end on the GPU: the default job, and the ~0.47B preset
        [ "$DRY_RUN" = 1 ] || rm -rf "$RUNS"
        stage loop_default 150 $PY -m grail.train.cli train.iterations=10 "hydra.run.dir=$RUNS/default"
        stage loop_mid_model 60 $PY -c "from grail.models.tiny import build_random_qwen2, MID_PRESET; build_random_qwen2('$RUNS/mid-model', seed=0, **MID_PRESET)"
        stage loop_mid 200 $PY -m grail.train.cli train.iterations=6 "model.train_id=$RUNS/mid-model" train.lr=1e-5 "hydra.run.dir=$RUNS/mid"
        stage loop_split 30 $PY benchmarks/iteration_times.py "$RUNS/default" "$RUNS/mid"
        ;;
    decode_large)  # the graph decoder at 64x16x512 only
        stage decode_large 90 $PY benchmarks/engine_decode.py --preset mid --device cuda --modes graph --shapes 64x16x512 --out "$OUT/decode_large.json"
        ;;
    decode_profile)  # one more 64x16x512 graph run under torch.profiler: where a 5.5 ms step goes
        stage decode_profile 120 $PY benchmarks/engine_decode.py --preset mid --device cuda --modes graph --shapes 64x16x512 --profile --out "$OUT/decode_profile.json"
        ;;
    loop15)  # weight sync of the Qwen2.5-1.5B shape (its 512-token test vocabulary) in the loop
        stage loop15_model 60 $PY -c "from train_step_gpu import SHAPES; from grail.models.tiny import build_random_qwen2; build_random_qwen2('$RUNS/m15', seed=0, **SHAPES['qwen2.5-1.5b'])"
        stage loop15 200 $PY -m grail.train.cli train.iterations=4 "model.train_id=$RUNS/m15" train.lr=1e-5 data.problems_per_iteration=16 eval.interval=100 "hydra.run.dir=$RUNS/r15"
        stage loop15_split 30 $PY benchmarks/iteration_times.py "$RUNS/r15"
        ;;
    fleet)  # one GPU: one built-in server beside the trainer, then two; the ~0.47B preset
        # generating up to 128 tokens per rollout (a random model rarely samples its stop)
        [ -d "$RUNS/mid-model" ] || stage loop_mid_model 60 $PY -c "from grail.models.tiny import build_random_qwen2, MID_PRESET; build_random_qwen2('$RUNS/mid-model', seed=0, **MID_PRESET)"
        F="train.iterations=4 model.train_id=$RUNS/mid-model train.lr=1e-5 generation.max_new_tokens=128 eval.interval=100"
        stage fleet_1 150 $PY -m grail.train.cli $F "hydra.run.dir=$RUNS/fleet1"
        stage fleet_2 150 $PY -m grail.train.cli $F generation.servers=2 "hydra.run.dir=$RUNS/fleet2"
        stage fleet_split 30 $PY benchmarks/iteration_times.py "$RUNS/fleet1" "$RUNS/fleet2"
        ;;
    episodes)  # multi-turn episodes against single-turn groups on the graph decoder (tiny model)
        stage episodes 120 $PY benchmarks/episodes.py --device cuda --turn-tokens 32 --out "$OUT/episodes.json"
        ;;
    *) echo "unknown stage $s (see the top of this file)" ;;
    esac
done

echo "######## summary"
for f in "$OUT"/*.log; do echo "--- $(basename "$f")"; tail -n 14 "$f"; done
if [ -f "$OUT/mfu.jsonl" ]; then
    $PY - "$OUT/mfu.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"{r['shape']:<13} {r['attn_implementation']:<15} mbt={r['micro_batch_tokens']:<6} bs={r['batch_size']:<3} "
          f"compile={r['compile']!s:<5} update={r['update_s_median']:.3f}s tok/s={r['tokens_per_s']:,.0f} "
          f"MFU={100 * (r['mfu'] or 0):.1f}% peak={r['peak_memory_gib']:.1f}GiB")
EOF
fi
