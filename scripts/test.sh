#!/usr/bin/env bash
# Installs everything the tests need on a fresh Debian/Ubuntu machine, then runs them.
# Real components: vLLM on CPU, Ray, and (as root) a real Slurm cluster in network namespaces, whose
# Debian packages the sandbox installs itself on first use.
#   bash scripts/test.sh            everything (what CI runs)
#   bash scripts/test.sh --fast     only what needs no engine and no sandbox, for the edit-test loop
#   bash scripts/test.sh ARGS       pytest arguments, e.g. -x -k router
# One process by default (what CI runs); HPCSERVE_TEST_WORKERS=2 runs two workers side by side
# (pytest-xdist; tests/conftest.py says what runs where; docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
if [ "${1:-}" = "--fast" ]; then
  shift
  # Two workers: these tests share nothing but the machine (about 65 s here instead of 150 s in one).
  exec .venv/bin/python -m pytest -p no:cacheprovider -q -n 2 -m "not slow and not sandbox" "$@"
fi
# The dashboard test drives Debian's Chromium (never a browser download).
if [ "$(id -u)" = 0 ] && [ ! -x /usr/bin/chromium ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
exec .venv/bin/python -m pytest -p no:cacheprovider -rs -n "${HPCSERVE_TEST_WORKERS:-0}" "$@"
