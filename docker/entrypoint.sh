#!/usr/bin/env bash
# Entrypoint of Dockerfile.nvidia: make sure the engines in $ENGINES_DIR are current for this
# checkpoint, GPU and TensorRT version, then dispatch to `trt-cosy build|say|serve`.
#
#   serve [ARGS]   build what is missing or stale, then `trt-cosy serve` (the default)
#   say [ARGS]     the same, then `trt-cosy say`
#   build          only build
#   anything else  runs as a command (e.g. bash)
set -euo pipefail

MODEL_DIR=${MODEL_DIR:-/models/CosyVoice2-0.5B}
ENGINES_DIR=${ENGINES_DIR:-/engines/cosyvoice2/tensorrt-fp16}
PRECISION=${PRECISION:-fp16}

log() { echo "[trt-cosy-entrypoint] $*" >&2; }

ensure_engines() {
    if [ -f "$MODEL_DIR/cosyvoice2.yaml" ]; then
        # ONNX export + fp16 graphs + profiles; skipped in seconds when the manifest matches the checkpoint.
        log "checking engines in $ENGINES_DIR against $MODEL_DIR"
        trt-cosy build --model-dir "$MODEL_DIR" --out "$ENGINES_DIR" --backend tensorrt --precision "$PRECISION" --onnx-only
    elif [ ! -f "$ENGINES_DIR/tensorrt.json" ]; then
        log "no engines in $ENGINES_DIR and no release at $MODEL_DIR."
        log "mount the official CosyVoice2 release at $MODEL_DIR (or set MODEL_DIR), or put engines made with"
        log "\`trt-cosy build --backend tensorrt --onnx-only\` in the engines volume."
        exit 2
    fi
    # TensorRT plans are per GPU and TensorRT version: build the missing or stale ones, keep the rest.
    # A first start builds every plan (each one tunes its kernels: minutes per plan at full size, the
    # LLM plans the longest); each plan prints "[k/N] ... building" and "built in S s" as it goes.
    log "building the TensorRT plans that are missing or stale (first start: every plan; see progress below)"
    python3 -m trt_cosy.builder.trt.plans "$ENGINES_DIR"
}

command=${1:-serve}
case "$command" in
    build)
        ensure_engines
        ;;
    serve | say)
        shift || true
        ensure_engines
        exec trt-cosy "$command" --engines "$ENGINES_DIR" --backend tensorrt "$@"
        ;;
    *)
        exec "$@"
        ;;
esac
