#!/usr/bin/env bash
# The GPU check: one command on a CUDA machine, offline, within 10 minutes. It prints
#   1. CPU-vs-device agreement, fp32 and bf16, under the KV-cache policies full, window:32 and
#      sinkwindow:4:32, and under --attention: top-k (flip rate, |Δ logprob|, JS), ft_hit_prob,
#      opener_mass, prior_drift, sink_rate, needle_attn, each against a stated tolerance
#      (bench/device_check.py);
#   2. the whole first-token suite's time on the device (--suite-limit N for fewer prompts);
#   3. the first-token bench ratio on the device (bench/first_token_vs_sampling.py);
#   4. where the device's time goes: bf16 / fp32, --attention / plain, and the time under each set
#      of SDPA kernels (bench/device_speed.py).
# Needs the installed evalkit (scripts/setup.sh) and the default model present; reads nothing from
# the network (HF_HUB_OFFLINE=1; hub kernels stay off). Runs with `--device cpu` too (CPU against CPU:
# a check of the script itself, every difference 0).
#
#   scripts/gpu_check.sh [--device cuda] [--limit 10] [--suite-limit all] [--per-lang 5] [--budget 590]
#                        [--model-args pretrained=DIR]   (another model than the default, e.g. for a smoke test)
#
# Environment: PYTHON (default: .venv/bin/python when present, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."

DEVICE=cuda LIMIT=10 SUITE_LIMIT=all PER_LANG=5 BUDGET=590 MODEL_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --limit) LIMIT=$2; shift 2 ;;
    --suite-limit) SUITE_LIMIT=$2; shift 2 ;;
    --per-lang) PER_LANG=$2; shift 2 ;;
    --budget) BUDGET=$2; shift 2 ;;
    --model-args) MODEL_ARGS=(--model-args "$2"); shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
for n in "$LIMIT" "$PER_LANG" "$BUDGET"; do
  case "$n" in ''|*[!0-9]*) echo "gpu_check.sh: expected a whole number, got '$n'" >&2; exit 2 ;; esac
done
case "$SUITE_LIMIT" in all) SUITE_ARGS=() ;; ''|*[!0-9]*) echo "gpu_check.sh: --suite-limit takes a whole number or all" >&2; exit 2 ;; *) SUITE_ARGS=(--limit "$SUITE_LIMIT") ;; esac

if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONWARNINGS=ignore
unset EVALKIT_HUB_KERNELS
WORK=$(mktemp -d "${TMPDIR:-/tmp}/evalkit-gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
START=$(date +%s)

left() { echo $((BUDGET - ($(date +%s) - START))); }
step() {  # step SECONDS-AT-MOST LABEL COMMAND...: run COMMAND within what is left of the budget
  local most=$(( $1 * BUDGET / 590 )) label=$2; shift 2  # each step's share grows with --budget
  local t=$(left)
  [ "$t" -gt "$most" ] && t=$most
  if [ "$t" -le 5 ]; then echo "[$label] skipped: the ${BUDGET}s budget is spent"; return 1; fi
  local s=$(date +%s)
  local rc=0
  timeout "$t" "$@" >"$WORK/out" 2>"$WORK/err" || rc=$?
  if [ $rc = 0 ]; then echo "[$label] $(( $(date +%s) - s ))s"; return 0; fi
  echo "[$label] failed (exit $rc after $(( $(date +%s) - s ))s; 124: over its ${t}s):"
  tail -n 5 "$WORK/err" | sed 's/^/    /'
  return 1
}

"$PYTHON" - "$DEVICE" <<'EOF'
import platform, sys, torch, transformers
dev = sys.argv[1]
name = torch.cuda.get_device_name(torch.device(dev)) if dev.startswith("cuda") and torch.cuda.is_available() else platform.processor() or "cpu"
print(f"evalkit GPU check on {dev} ({name}); torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformers {transformers.__version__}; {torch.get_num_threads()} CPU threads")
EOF

echo
echo "== 1. agreement: the same runs on cpu and on $DEVICE (--limit $LIMIT per task) =="
RUN=("$PYTHON" -m evalkit run "${MODEL_ARGS[@]}" --tasks firsttoken --limit "$LIMIT")
ATTN=("$PYTHON" -m evalkit run "${MODEL_ARGS[@]}" --tasks firsttoken,needle_en --limit "$LIMIT" --needle-lengths 256
      --needle-depths 0,0.5,1 --attention)
ok=1
for side in cpu dev; do
  dev=$( [ $side = cpu ] && echo cpu || echo "$DEVICE" )
  db="$WORK/$side.duckdb"
  step 150 "$dev: fp32,bf16 x full,window:32,sinkwindow:4:32" \
    "${RUN[@]}" --quant fp32,bf16 --kv-cache full,window:32,sinkwindow:4:32 --device "$dev" --db "$db" || ok=0
  for q in fp32 bf16; do
    step 90 "$dev: --attention --quant $q" "${ATTN[@]}" --quant "$q" --device "$dev" --db "$db" || ok=0
  done
done
if [ -f "$WORK/cpu.duckdb" ] && [ -f "$WORK/dev.duckdb" ]; then
  "$PYTHON" bench/device_check.py "$WORK/cpu.duckdb" "$WORK/dev.duckdb" --device "$DEVICE" || ok=0
else
  echo "agreement: not computed (a side has no runs)"; ok=0
fi

echo
echo "== 2. the whole first-token suite on $DEVICE (${SUITE_LIMIT} prompts per task) =="
if step 150 "suite" "$PYTHON" -m evalkit run "${MODEL_ARGS[@]}" --tasks firsttoken "${SUITE_ARGS[@]}" --device "$DEVICE" \
    --db "$WORK/suite.duckdb"; then
  grep -E "^run .* done" "$WORK/out" | sed 's/^/    /'
else
  ok=0
fi

echo
echo "== 3. the first-token bench on $DEVICE (${PER_LANG} en + ${PER_LANG} zh prompts, 20 samples each) =="
if step 120 "bench" "$PYTHON" bench/first_token_vs_sampling.py "${MODEL_ARGS[@]}" --device "$DEVICE" --per-lang "$PER_LANG"; then
  grep -E "^model |^\((a|b|c|b')\) |^\(a\)/|^\(b'\) vs" "$WORK/out" | sed 's/^/    /'
else
  ok=0
fi

echo
echo "== 4. where the time goes on $DEVICE: fp32 / bf16, --attention / plain, SDPA kernels =="
if step 150 "speed" "$PYTHON" bench/device_speed.py "${MODEL_ARGS[@]}" --device "$DEVICE" --per-lang "$PER_LANG" \
    $( [ "$DEVICE" = cpu ] && echo --rounds 1 --needle-length 256 ); then
  sed 's/^/    /' "$WORK/out"
else
  ok=0
fi

echo
echo "total $(( $(date +%s) - START ))s of a ${BUDGET}s budget; $( [ $ok = 1 ] && echo 'every step ran' || echo 'SOME STEPS FAILED or were out of tolerance')"
[ $ok = 1 ]
