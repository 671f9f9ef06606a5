#!/usr/bin/env bash
# Inference benchmark on one GPU, paper presets, batch sizes 1,64,512,4096,8192, every
# default config: Inductor bf16, loka, loka_calibrated_ro (loka with a plan from
# loka_compile.calibrate: static activation scales), loka_all_fp8_ro ({"speed_check":
# False}: every eligible site FP8), loka_ro_no_cached_weights (that, with the
# cached_weights Mod off: the weights cast to FP8 on every call) and torchao float8
# post-training quantization (Float8DynamicActivationFloat8WeightConfig, PerRow /
# PerTensor), all in reduce-overhead mode (CUDA graphs). See the docstring of
# benchmarks/infer.py for what is measured.
#
# Quality (issue 11: held-out NE and AUC within 0.05% relative of bf16 after training in
# bf16): --train-steps 200 trains each model first, eagerly in bf16 as benchmarks.train's
# eager_bf16 row does, at batch 8192 (2026-11-22 H100 eager_bf16 steps: 12-78 ms, so
# 2.5-16 s per model plus data); every config then starts from those weights, and
# --eval-batches 8 scores each config on 8 held-out batches of the largest batch size it
# ran (64k rows at 8192): NE, AUC, dNE%, dAUC% and q_ok in the table, the calibrated
# rows' per-site calibration errors under it. --train-steps 0 gives the old random-weight run.
#
# Run from the repository root on the GPU machine:
#     bash benchmarks/run_gpu_infer.sh                       # wukong,dlrm_dcnv2 (see Budget)
#     bash benchmarks/run_gpu_infer.sh masknet,hstu          # a subset (comma list)
#     bash benchmarks/run_gpu_infer.sh hstu --configs inductor_bf16_ro,loka_ro --batches 512,8192
#
# Budget: each batch size of each config compiles its own static graph (and records its
# own CUDA graph): 7 configs x 5 sizes = 35 compiles per model, plus one calibration
# (4 batches of 8192) and the training above. The harness starts no config
# and no batch size after --total-seconds (default here 420 s from its start) and no further
# batch size of a config after --max-seconds (120 s); what did not run becomes rows (or
# batch sizes missing from a row) with an error, and the JSON is rewritten after every row,
# so a cut-off run still reports. The overrun past 420 s is one batch size of one config
# plus the error measurement, so with the installs one call should stay under 9 minutes:
# call at most two models at a time ("wukong,dlrm_dcnv2", then "masknet,hstu"); all calls
# of a day merge into the same <date>_<GPU>_infer.json. Not yet timed on a GPU (written
# 2026-11-23; CPU-checked only): if the first call cuts configs off, lower --batches or
# call one model at a time (with training and the calibrated row, one model per call is
# the safer choice for the quality table: skipped rows have no quality either).
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
    --train-steps 200 --eval-batches 8 \
    --max-seconds 120 --total-seconds 420 \
    --out benchmarks/results --plot "$@" 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}

cp benchmarks/results/*_infer*.json "$OUT_DIR"/ 2>/dev/null || true
cp benchmarks/results/*_infer*.png "$OUT_DIR"/ 2>/dev/null || true
echo "run_gpu_infer.sh: harness exit status $status; results in benchmarks/results and $OUT_DIR"
exit "$status"
