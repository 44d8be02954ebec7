#!/usr/bin/env bash
# What a few tests need beyond .venv: headless Chromium, which renders the HTML report
# (tests/test_report.py takes screenshots with it; without it those tests skip, saying so).
# Debian/Ubuntu, as root (or with sudo). .ci/run calls it; a clone can too: sudo bash scripts/test-deps.sh
# The report's fonts need nothing here: evalkit ships its own (docs/report.md, "Fonts").
set -euo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
  echo "test-deps.sh: chromium is installed"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "test-deps.sh: no apt-get here: install Chromium by hand, or the browser tests skip" >&2
  exit 0
fi
echo "test-deps.sh: installing chromium with apt-get (about 1-2 minutes)"
if (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null); then
  echo "test-deps.sh: chromium installed"
else
  echo "test-deps.sh: chromium not installed; the browser tests in tests/test_report.py will skip" >&2
fi
