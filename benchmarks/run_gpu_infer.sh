#!/usr/bin/env bash
# Inference benchmark on one GPU, paper presets, batch sizes 1,64,512,4096,8192,65536:
# Inductor bf16, loka and loka_calibrated_ro (loka with a plan from loka_compile.calibrate:
# static activation scales), in reduce-overhead mode (CUDA graphs). Other configs of
# benchmarks/infer.py (loka_all_fp8_ro, loka_ro_no_cached_weights, torchao float8
# post-training quantization, Float8DynamicActivationFloat8WeightConfig PerRow / PerTensor)
# by --configs, at fewer sizes (Budget, below). See the docstring of
# benchmarks/infer.py for what is measured.
#
# Quality (issue 11: held-out NE and AUC within 0.05% relative of bf16 after training in
# bf16): --train-steps 200 trains each model first, eagerly in bf16 as benchmarks.train's
# eager_bf16 row does, at batch 8192 (2026-11-22 H100 eager_bf16 steps: 12-78 ms, so
# 2.5-16 s per model plus data); every config then starts from those weights, and
# --eval-batches 8 scores each config on 8 held-out batches of the largest batch size it
# ran up to 8192 (64k rows): NE, AUC, dNE%, dAUC% and q_ok in the table, the calibrated
# rows' per-site calibration errors under it. --train-steps 0 gives the old random-weight run.
#
# Run from the repository root on the GPU machine:
#     bash benchmarks/run_gpu_infer.sh wukong                # one model (see Budget)
#     bash benchmarks/run_gpu_infer.sh masknet,dlrm_dcnv2    # two small ones
#     bash benchmarks/run_gpu_infer.sh dlrm_dcnv2 --configs inductor_bf16_ro,loka_ro,torchao_rowwise_ro --batches 8192
#
# Budget: each batch size of each config compiles its own static graph (and records its
# own CUDA graph). Measured on the H100 (2026-11-24, one model per call, 6 batch sizes):
# first calls of 2-18 s for Inductor bf16, 7-30 s for loka (its probe window compiles
# twice), 8-21 s plus the calibration for loka_calibrated, and 27-258 s for each torchao
# row (its first call at 8192 and 65536). So: bf16, loka and loka_calibrated at every size
# in one call per model (Wukong took 512 s with training, MaskNet + DLRM 330 s together,
# HSTU 190 s); torchao rows in calls of their own at one or two sizes. The harness starts
# no config and no batch size after --total-seconds (default here 480 s from its start)
# and no further batch size of a config after --max-seconds (300 s); what did not run
# becomes rows (or batch sizes missing from a row) with an error, and the JSON is
# rewritten after every row, so a cut-off run still reports.
#
# torchao is installed from .whl/ (downloaded on the dev machine; the GPU machine is
# offline). Results: benchmarks/results/ and, when $OUT is set, copied under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."

MODELS="${1:-wukong}"
[ $# -gt 0 ] && shift
OUT_DIR="${OUT:-/tmp/loka_bench}"
mkdir -p "$OUT_DIR" benchmarks/results

SCRIPT=run_gpu_infer.sh source benchmarks/gpu_setup.sh

LOG="$OUT_DIR/infer_${MODELS//,/_}.log"
PYTHONUNBUFFERED=1 python3 -m benchmarks.infer \
    --preset paper --device cuda:0 --models "$MODELS" \
    --batches 1,64,512,4096,8192,65536 --warmup 5 --iters 50 \
    --configs inductor_bf16_ro,loka_ro,loka_calibrated_ro \
    --train-steps 200 --eval-batches 8 \
    --max-seconds 300 --total-seconds 480 \
    --out benchmarks/results --plot "$@" 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}

cp benchmarks/results/*_infer*.json "$OUT_DIR"/ 2>/dev/null || true
cp benchmarks/results/*_infer*.png "$OUT_DIR"/ 2>/dev/null || true
echo "run_gpu_infer.sh: harness exit status $status; results in benchmarks/results and $OUT_DIR"
exit "$status"
