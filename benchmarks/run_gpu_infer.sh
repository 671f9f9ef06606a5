#!/usr/bin/env bash
# Inference benchmark on one GPU, paper presets, batch sizes 1,64,512,4096,8192, every
# default config: Inductor bf16, loka, loka_all_fp8_ro ({"speed_check": False}: every
# eligible site FP8), loka_ro_no_cached_weights (that, with the cached_weights Mod off: the
# weights cast to FP8 on every call) and torchao float8 post-training quantization
# (Float8DynamicActivationFloat8WeightConfig, PerRow / PerTensor), all in reduce-overhead
# mode (CUDA graphs). See the docstring of benchmarks/infer.py for what is measured.
#
# Run from the repository root on the GPU machine:
#     bash benchmarks/run_gpu_infer.sh                       # wukong,dlrm_dcnv2 (see Budget)
#     bash benchmarks/run_gpu_infer.sh masknet,hstu          # a subset (comma list)
#     bash benchmarks/run_gpu_infer.sh hstu --configs inductor_bf16_ro,loka_ro --batches 512,8192
#
# Budget: each batch size of each config compiles its own static graph (and records its
# own CUDA graph): 6 configs x 5 sizes = 30 compiles per model. The harness starts no config
# and no batch size after --total-seconds (default here 420 s from its start) and no further
# batch size of a config after --max-seconds (120 s); what did not run becomes rows (or
# batch sizes missing from a row) with an error, and the JSON is rewritten after every row,
# so a cut-off run still reports. The overrun past 420 s is one batch size of one config
# plus the error measurement, so with the installs one call should stay under 9 minutes:
# call at most two models at a time ("wukong,dlrm_dcnv2", then "masknet,hstu"); all calls
# of a day merge into the same <date>_<GPU>_infer.json. Not yet timed on a GPU (written
# 2026-11-23; CPU-checked only): if the first call cuts configs off, lower --batches or
# call one model at a time.
#
# torchao is installed from .whl/ (downloaded on the dev machine; the GPU machine is
# offline). Results: benchmarks/results/ and, when $OUT is set, copied under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."

MODELS="${1:-wukong,dlrm_dcnv2}"
[ $# -gt 0 ] && shift
OUT_DIR="${OUT:-/tmp/loka_bench}"
mkdir -p "$OUT_DIR" benchmarks/results

SCRIPT=run_gpu_infer.sh source benchmarks/gpu_setup.sh

LOG="$OUT_DIR/infer_${MODELS//,/_}.log"
PYTHONUNBUFFERED=1 python3 -m benchmarks.infer \
    --preset paper --device cuda:0 --models "$MODELS" \
    --batches 1,64,512,4096,8192 --warmup 5 --iters 50 \
    --max-seconds 120 --total-seconds 420 \
    --out benchmarks/results --plot "$@" 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}

cp benchmarks/results/*_infer*.json "$OUT_DIR"/ 2>/dev/null || true
cp benchmarks/results/*_infer*.png "$OUT_DIR"/ 2>/dev/null || true
echo "run_gpu_infer.sh: harness exit status $status; results in benchmarks/results and $OUT_DIR"
exit "$status"
