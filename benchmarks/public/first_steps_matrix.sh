#!/usr/bin/env bash
# First steps of each model against Inductor, each run a fresh process with empty Inductor and
# Triton caches (benchmarks.public.first_steps, cProfile phases and the whole profile kept):
#   inductor_bf16_ro; loka_ro with an empty performance DB (cold; saves its plan); loka_ro with
#   the DB that run left (warm); loka_ro with that plan.
# Runs start while less than BUDGET_S seconds have passed (default 440) and are cut at that
# mark plus 30 s; everything goes into one tarball.
#
#   bash benchmarks/public/first_steps_matrix.sh $OUT deepctr_torch.DeepFM torch_rechub.DCNv2
#
# Environment: PRESET (production), MODE (train), BUDGET_S (440), PROFILE (1; 0: no cProfile, whose
# overhead on Python-heavy compiles is large, and no phase table or profiles).
set -u
out=$1; shift
work=$(mktemp -d)
res=$work/first_steps
mkdir -p $res
budget=${BUDGET_S:-440}
preset=${PRESET:-production}

one() {  # name, perf DB dir, first_steps arguments...
    local name=$1 db=$2; shift 2
    local left=$((budget - SECONDS))
    if [ $left -le 0 ]; then echo "skipped $name: over the ${budget}s budget"; return; fi
    local profile="--pstats $res/$name.prof"
    [ "${PROFILE:-1}" = 0 ] && profile=--no-profile
    env PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) LOKA_CACHE_DIR=$db \
        timeout $((left + 30)) python -m benchmarks.public.first_steps --preset $preset --mode ${MODE:-train} \
        --out $res --name $name $profile "$@" > $res/$name.log 2>&1
    echo "rc=$? $(grep '^# First' $res/$name.log)"
    [ -f $res/$name.prof ] && gzip -f $res/$name.prof
}

for model in "$@"; do
    m=${model//./_}
    db=$(mktemp -d)
    one ${m}_inductor $(mktemp -d) --model $model --config inductor_bf16_ro
    one ${m}_loka_cold $db --model $model --config loka_ro --save-plan $res/${m}_plan.json
    one ${m}_loka_warm_db $db --model $model --config loka_ro
    [ -f $res/${m}_plan.json ] && one ${m}_loka_plan $db --model $model --config loka_ro \
        --loka-options "{\"plan\": \"$res/${m}_plan.json\"}"
done

python - "$res" <<'EOF' | tee $res/summary.md
import json, pathlib, sys
order = ("_inductor", "_loka_cold", "_loka_warm_db", "_loka_plan")
rows = {}
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(path.read_text())
    if "first_steps_s" not in r:  # a saved plan
        continue
    rank = next(i for i, suffix in enumerate(order) if path.stem.endswith(suffix))
    rows.setdefault(r["model"], []).append((rank, path.stem, r))
print("| run | first steps, wall s | CPU s | x Inductor (wall) | per step (wall s) |")
print("|---|---|---|---|---|")
for model, runs in rows.items():
    runs.sort(key=lambda run: run[0])
    base = runs[0][2]["first_steps_s"] if runs[0][0] == 0 else None
    for _, name, r in runs:
        ratio = f"{r['first_steps_s'] / base:.2f}" if base else "-"
        print(f"| {name} | {r['first_steps_s']:.1f} | {r['first_steps_cpu_s']:.1f} | {ratio} | {r['per_step_s']} |")
EOF
tar -czf $out/first_steps.tar.gz -C $work first_steps
ls -la $out/first_steps.tar.gz
