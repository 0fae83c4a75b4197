#!/usr/bin/env bash
# One run on a machine with an NVIDIA GPU and TensorRT: build TensorRT plans for a tiny and a
# full-size random-weight test model, check them against the golden tiny set, and time them
# against ONNX Runtime. Prints a short table at the end.
#
#   bash scripts/gpu_check.sh                 # tiny and full
#   SIZES=tiny bash scripts/gpu_check.sh      # tiny only (a few minutes)
#   WORK=/data/gpu-check bash scripts/gpu_check.sh   # keep the artefacts somewhere known
#
# Needs: pip install -e '.[gpu,cpu,build]' (torch for the export; '.[gpu-cu12,cpu,build]' on a CUDA 12
# driver, R525-R575), an NVIDIA driver, ~15 GB disk for full.
# Exit status 3: the CUDA checks ran but TensorRT is not installed (the plan checks were not run).
set -euo pipefail
cd "$(dirname "$0")/.."

SIZES=${SIZES:-"tiny full"}
WORK=${WORK:-$(mktemp -d -t trt-cosy-gpu-check.XXXXXX)}
SECONDS_OF_AUDIO=${SECONDS_OF_AUDIO:-10}
GOLDEN_DIR=tests/data/cosyvoice2-tiny
LOGS="$WORK/logs"
mkdir -p "$LOGS"
RESULTS=()
DECODE_FAILED=0
INCREMENTAL_FAILED=0

step() {  # step NAME COMMAND...: run, log to $LOGS/NAME.log, say how long it took; show the log tail on failure
    local name=$1
    shift
    local start=$SECONDS
    printf '%-44s ' "$name"
    if "$@" >"$LOGS/$name.log" 2>&1; then
        echo "ok ($((SECONDS - start)) s)"
    else
        local status=$?
        echo "FAILED (exit $status, $((SECONDS - start)) s); last lines of $LOGS/$name.log:"
        tail -n 25 "$LOGS/$name.log" | sed 's/^/    /'
        return "$status"
    fi
}

echo "== trt-cosy GPU check: work dir $WORK"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

# 0. CUDA plumbing (needs cuda-python and a device, not TensorRT): TrtRunner's buffers, streams,
#    events and stage hand-off on real device memory, and the runtime's launch overhead.
step cuda-tests python -m pytest -q -rs -p no:cacheprovider tests/test_cuda_gpu.py
step cuda-plumbing python bench/gpu_plumbing.py --json "$WORK/plumbing.json"
sed 's/^/    /' "$LOGS/cuda-plumbing.log"

python - <<'PY' || exit 3
from trt_cosy.runtime.backends.tensorrt.cuda import gpu_unavailable_reason, device_info
reason = gpu_unavailable_reason()
if reason:
    raise SystemExit(f"CUDA checks passed; the TensorRT checks cannot run: {reason}")
import tensorrt
print(f"GPU {device_info()}  TensorRT {tensorrt.__version__}")
PY

# 1. TensorRT runtime on a toy plan: parity with ONNX Runtime, then two threads on a plan built for two
#    slots (its profiles twice: concurrent contexts must not share a profile), lengths across both
#    profiles, every output checked; prints the device memory per execution context.
step trt-toy-and-two-threads python -m pytest -q -rs -s -p no:cacheprovider tests/test_trt_runtime.py -k on_gpu
grep -h "device memory per context" "$LOGS/trt-toy-and-two-threads.log" | sed 's/^/    /' || true
# Informational: would the shared form (two contexts on ONE copy of the profiles) have worked here?
step trt-shared-profile-experiment python tools/experiments/tensorrt/trt_shared_profile.py || true
grep -h "shared profile" "$LOGS/trt-shared-profile-experiment.log" | sed 's/^/    /' || true

# 2. Golden parity: the golden tiny checkpoint on TensorRT, every stage against the official outputs.
step golden-build-trt trt-cosy build --model-dir "$GOLDEN_DIR" --out "$WORK/golden/trt" --backend tensorrt --precision fp16
step golden-verify-trt trt-cosy verify --backend tensorrt --model-dir "$GOLDEN_DIR" \
    --golden "$GOLDEN_DIR/reference.npz" --engines "$WORK/golden/trt"
sed 's/^/    /' "$LOGS/golden-verify-trt.log"
# 2b. Batched decode across requests (llm_decode plan, built above with the batch B 1..8 in its profiles):
#     per-step latency against B, and every batched row's greedy tokens equal to batch 1 (exit 1 if not).
#     Not fatal here (the later steps still run); the script exits 1 at the end if it failed.
step golden-llm-decode-batch python bench/trt_llm_decode.py "$WORK/golden/trt" --json "$WORK/golden/llm_decode.json" \
    || DECODE_FAILED=1
sed 's/^/    /' "$LOGS/golden-llm-decode-batch.log"
# 2c. Incremental streaming flow (issue 15 item 6): plans of the encoder, both estimators and the incremental
#     estimator (fp16, from the golden build above); the official schedule's chunks through FlowStage with the
#     incremental plan against recomputation through the stream plan and against ONNX Runtime (fp16 budget).
#     verify above already ran its stream_*/streampad_* rows through the incremental plan.
step golden-incremental-flow env TRT_COSY_TRT_ENGINES="$WORK/golden/trt" \
    python -m pytest -q -rs -s -p no:cacheprovider tests/test_trt_flow_incremental.py -m gpu || INCREMENTAL_FAILED=1
grep -h "worst chunk\|ms per chunk\|device memory per context" "$LOGS/golden-incremental-flow.log" | sed 's/^/    /' || true

# 3. Per size: random-weight release, ORT and TensorRT engines, graph-level timing.
for size in $SIZES; do
    release="$WORK/$size/release"
    step "$size-make-test-model" trt-cosy make-test-model --size "$size" --out "$release" --overwrite
    step "$size-build-onnxruntime" trt-cosy build --model-dir "$release" --out "$WORK/$size/ort" --backend onnxruntime
    step "$size-build-tensorrt" trt-cosy build --model-dir "$release" --out "$WORK/$size/trt" --backend tensorrt --precision fp16
    grep -h "max error vs fp32" "$LOGS/$size-build-tensorrt.log" | sed 's/^/    /' || true
    step "$size-bench" python bench/gpu_check.py --ort "$WORK/$size/ort" --trt "$WORK/$size/trt" \
        --seconds "$SECONDS_OF_AUDIO" --label "$size" --json "$WORK/$size/bench.json"
    grep -h -A12 "^model" "$LOGS/$size-bench.log" | sed 's/^/    /' || true
    step "$size-llm-decode-batch" python bench/trt_llm_decode.py "$WORK/$size/trt" --json "$WORK/$size/llm_decode.json" \
        || DECODE_FAILED=1
    sed 's/^/    /' "$LOGS/$size-llm-decode-batch.log"
    # The incremental streaming flow at this size: mel against recomputation, ms per chunk of both.
    step "$size-incremental-flow" env TRT_COSY_TRT_ENGINES="$WORK/$size/trt" \
        python -m pytest -q -rs -s -p no:cacheprovider tests/test_trt_flow_incremental.py -m gpu || INCREMENTAL_FAILED=1
    grep -h "worst chunk\|ms per chunk\|device memory per context" "$LOGS/$size-incremental-flow.log" | sed 's/^/    /' || true
    RESULTS+=("$size")
done

# 4. The table (ctx MB: device memory per execution context, one slot of every graph).
echo
echo "== ${SECONDS_OF_AUDIO} s utterance, graph-level timing (warm; TTFA = first 25-token chunk through every stage)"
python - "$WORK" "${RESULTS[@]}" <<'PY'
import json, sys
from pathlib import Path
work, sizes = Path(sys.argv[1]), sys.argv[2:]
print(f"{'model':<6} {'backend':<12} {'TTFA s':>8} {'RTF':>7} {'LLM tok/s':>10} {'dev MB':>8} {'ctx MB':>8}")
for size in sizes:
    for row in json.loads((work / size / "bench.json").read_text()):
        mem = "-" if row["device_mb"] is None else row["device_mb"]
        ctx = "-" if row.get("context_mb") is None else row["context_mb"]
        print(f"{size:<6} {row['backend']:<12} {row['ttfa_s']:>8.3f} {row['rtf']:>7.3f} {row['llm_tok_s']:>10.1f} {mem:>8} {ctx:>8}")
PY
echo
echo "== batched LLM decode on TensorRT (llm_decode): ms per step and decode tokens/s against batch size"
python - "$WORK" golden "${RESULTS[@]}" <<'PY'
import json, sys
from pathlib import Path
work, sizes = Path(sys.argv[1]), sys.argv[2:]
print(f"{'model':<7} {'B':>3} {'ms/step':>9} {'p90 ms':>8} {'tokens/s':>9} {'= batch 1':>10}")
for size in sizes:
    path = work / size / "llm_decode.json"
    for row in json.loads(path.read_text()) if path.is_file() else []:
        print(f"{size:<7} {row['batch']:>3} {row['step_ms']:>9.2f} {row['step_p90_ms']:>8.2f} "
              f"{row['tokens_per_s']:>9.0f} {row['rows_equal_to_batch_1']:>7}/{row['batch']}")
PY
echo "== done; logs in $LOGS"
if [ "$INCREMENTAL_FAILED" != 0 ]; then
    echo "incremental streaming flow check failed (see the *-incremental-flow logs)"
fi
if [ "$DECODE_FAILED" != 0 ]; then
    echo "batched decode check failed (see the *-llm-decode-batch logs)"
fi
if [ "$DECODE_FAILED" != 0 ] || [ "$INCREMENTAL_FAILED" != 0 ]; then
    exit 1
fi
