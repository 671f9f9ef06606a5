#!/usr/bin/env bash
# Training benchmark on one GPU, paper presets at batch 8192, every default config:
# eager bf16, Inductor bf16 (default, reduce-overhead), torchao float8 tensorwise/rowwise,
# loka (default, reduce-overhead) and loka_all_fp8_ro (loka with {"speed_check": False}:
# every eligible site FP8 whether it pays or not, in CUDA graphs).
#
# Run from the repository root on the GPU machine:
#     bash benchmarks/run_gpu.sh                       # all four models (see Budget)
#     bash benchmarks/run_gpu.sh wukong,dlrm_dcnv2     # a subset (comma list)
#     bash benchmarks/run_gpu.sh hstu --configs inductor_bf16,loka   # extra harness flags
#     bash benchmarks/run_gpu.sh wukong,dlrm_dcnv2 --configs inductor_bf16_ro,loka_ro,loka_all_fp8_ro \
#         --ablate-mods --name "$(date +%F)_train_ablation"   # per-Mod ablation, own file
#
# Also reported (JSON and a second printed table): the FP8 ceiling of each model, from one
# profiled forward+backward of the inductor_bf16 row (`ceiling`: GEMM share of device
# kernel time, 1 / ((1 - g) + g / s) at s = 1.6 and 2, largest non-GEMM kernel, top-10
# kernels with their GEMM verdict); a few seconds per model (not yet timed on a GPU). --ablate-mods adds
# loka_ro_no_<mod> rows (one per Mod of loka_compile.passes.MODS, loka option
# disabled_mods) after loka_ro; a loka without that option makes them error rows.
# The dlrm_dcnv2 paper preset trains its tables with sparse gradients (SparseAdam), so its
# step is not comparable with runs before 2026-11-23 (dense tables + Adam over all rows);
# --sparse-embeddings off restores those.
#
# Budget: the harness stops starting configs after --total-seconds (default here 360 s) and
# stops training a config after --max-seconds (100 s); what did not run becomes rows with
# an error, and the JSON is rewritten after every row, so a cut-off run still reports.
# Compiles dominate: a config took 3-100 s of wall time on an H100 (2026-11-22, 200
# quality steps; torchao rowwise the slowest), about 340 s for wukong,dlrm_dcnv2 with the
# 8 default configs and about 210-225 s each for masknet and hstu. So call at most
# "wukong,dlrm_dcnv2", then "masknet", then "hstu" (each within the 9-minute command
# limit); all calls merge into the same <date>_<GPU>_train.json. Ablation calls: 3 extra
# loka_ro compiles per model (5-25 s each), two models per call.
#
# Quality: the bf16 rows compute the same function, so their logloss spread (printed under
# the table, `bf16_logloss_spread` in the JSON) is the noise floor; at 40 steps it was up to
# 2.8% (MaskNet), and Wukong had not started learning (NE ~1.0; without lr warmup its first
# Adam steps blow the loss up, now --lr-warmup 20 by default): use >= 200 steps.
#
# torchao is installed from .whl/ (downloaded on the dev machine; the GPU machine is
# offline). Results: benchmarks/results/ and, when $OUT is set, copied under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."

MODELS="${1:-wukong,dlrm_dcnv2,masknet,hstu}"
[ $# -gt 0 ] && shift
OUT_DIR="${OUT:-/tmp/loka_bench}"
mkdir -p "$OUT_DIR" benchmarks/results

SCRIPT=run_gpu.sh source benchmarks/gpu_setup.sh

LOG="$OUT_DIR/train_${MODELS//,/_}.log"
PYTHONUNBUFFERED=1 python3 -m benchmarks.train \
    --preset paper --batch 8192 --device cuda:0 --models "$MODELS" \
    --steps 20 --warmup 5 --quality-steps 200 --eval-batches 8 \
    --max-seconds 100 --total-seconds 360 \
    --out benchmarks/results --plot "$@" 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}

cp benchmarks/results/*_train*.json "$OUT_DIR"/ 2>/dev/null || true
cp benchmarks/results/*_train*.png "$OUT_DIR"/ 2>/dev/null || true
echo "run_gpu.sh: harness exit status $status; results in benchmarks/results and $OUT_DIR"
exit "$status"
