#!/usr/bin/env bash
# What a few tests need beyond .venv, each skipped by its tests (saying why) when it cannot be had:
# - headless Chromium, which renders the HTML report (tests/test_report.py takes screenshots with it);
#   Debian/Ubuntu, as root (or with sudo);
# - real tokenizer vocabularies for the model zoo (tests/zoo.py): the vocabulary-only GGUFs
#   (vendor/llama.cpp/models/ggml-vocab-*.gguf, with their .inp/.out test vectors) of the
#   llama-cpp-python sdist that `setup.sh --with-llamacpp` builds, fetched once with pip and
#   extracted into EVALKIT_TEST_VOCAB (default ~/.cache/evalkit-test/vocab); nothing else is kept.
# .ci/run calls it; a clone can too: sudo bash scripts/test-deps.sh. It never fails: offline, the
# tests that need what it could not fetch skip.
# The report's fonts need nothing here: evalkit ships its own (docs/report.md, "Fonts").
set -uo pipefail
cd "$(dirname "$0")/.."

chromium() {
  if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    echo "test-deps.sh: chromium is installed"
    return 0
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "test-deps.sh: no apt-get here: install Chromium by hand, or the browser tests skip" >&2
    return 0
  fi
  echo "test-deps.sh: installing chromium with apt-get (about 1-2 minutes)"
  if (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null); then
    echo "test-deps.sh: chromium installed"
  else
    echo "test-deps.sh: chromium not installed; the browser tests in tests/test_report.py will skip" >&2
  fi
}

vocab() {
  local dest="${EVALKIT_TEST_VOCAB:-$HOME/.cache/evalkit-test/vocab}"
  # the llama.cpp engine's pin (pyproject.toml's extra `llamacpp`): one source for the version
  local version
  version=$(sed -n 's/.*"llama-cpp-python\[server\]==\([0-9][0-9.]*\)".*/\1/p' pyproject.toml | head -1)
  if [ -z "$version" ]; then
    echo "test-deps.sh: no llama-cpp-python pin in pyproject.toml; the model-zoo tests will skip" >&2
    return 0
  fi
  local marker="$dest/.llama-cpp-python-$version"
  if [ -f "$marker" ]; then
    echo "test-deps.sh: tokenizer vocabularies of llama-cpp-python $version in $dest ($(ls "$dest"/*.gguf | wc -l) GGUFs)"
    return 0
  fi
  local python=python3
  [ -x .venv/bin/python ] && python=.venv/bin/python
  local tmp
  tmp=$(mktemp -d) || return 0
  # pip's own cache serves the sdist when setup.sh --with-llamacpp already downloaded it
  if ! "$python" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$tmp" >"$tmp/pip.log" 2>&1; then
    echo "test-deps.sh: could not download the llama-cpp-python $version sdist ($(tail -1 "$tmp/pip.log")); the model-zoo tests will skip" >&2
    rm -rf "$tmp"
    return 0
  fi
  mkdir -p "$dest" && rm -f "$dest"/ggml-vocab-*
  if tar -xzf "$tmp"/llama_cpp_python-"$version".tar.gz -C "$dest" --strip-components=4 --wildcards \
       "llama_cpp_python-$version/vendor/llama.cpp/models/ggml-vocab-*" \
     && ls "$dest"/ggml-vocab-*.gguf >/dev/null 2>&1; then
    touch "$marker"
    echo "test-deps.sh: tokenizer vocabularies of llama-cpp-python $version extracted into $dest ($(ls "$dest"/*.gguf | wc -l) GGUFs)"
  else
    echo "test-deps.sh: the llama-cpp-python $version sdist holds no ggml-vocab-*.gguf; the model-zoo tests will skip" >&2
  fi
  rm -rf "$tmp"
}

chromium
vocab
exit 0
