#!/usr/bin/env bash
# Installs everything the tests need on a fresh Debian/Ubuntu machine, then runs them.
# Real components: vLLM on CPU, Ray, and (as root) a real Slurm cluster in network namespaces, whose
# Debian packages the sandbox installs itself on first use.
#   bash scripts/test.sh            everything (what CI runs): ruff and mypy over src/, then pytest on two workers
#                                   (pytest-xdist; tests/conftest.py says what runs where), with the 20 slowest listed
#   bash scripts/test.sh --fast     only what needs no engine and no sandbox, for the edit-test loop
#   bash scripts/test.sh ARGS       one pytest run with these arguments, e.g. -x -k router (in one process;
#                                   HPCSERVE_TEST_WORKERS=2 runs them on two workers)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# The whole run (CI) lints and type-checks first: seconds, and set -e fails the run on either. Settings in
# pyproject.toml ([tool.ruff], [tool.mypy]).
if [ $# -eq 0 ]; then
  .venv/bin/ruff check src
  .venv/bin/mypy
fi
PYTEST=(.venv/bin/python -m pytest -p no:cacheprovider)
FAST=(-m "not slow and not sandbox")
if [ "${1:-}" = "--fast" ]; then
  shift
  # Two workers: these tests share nothing but the machine (about 65 s here instead of 165 s in one).
  exec "${PYTEST[@]}" -q -n 2 "${FAST[@]}" "$@"
fi
# As root, the Debian packages the tests need are installed here, once, before the workers start (two
# workers' apt-get at once fail on apt's lock): Chromium for the dashboard test (never a browser download),
# Slurm and munge for the sandbox, PostgreSQL for tenancy's store (tests/tenancy).
if [ "$(id -u)" = 0 ]; then
  if [ ! -x /usr/bin/chromium ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
  fi
  .venv/bin/hpcserve sandbox install >/dev/null
  .venv/bin/python -c 'from hpcserve.testing.postgres import ensure_installed; ensure_installed()'
fi
if [ $# -gt 0 ]; then
  exec "${PYTEST[@]}" -rs -n "${HPCSERVE_TEST_WORKERS:-0}" "$@"
fi
# The whole suite in one run on two workers: their waits overlap (a handover waiting for its jobs' end beside
# a TP start), each worker has a sandbox cluster of its own, and the fast tests fill the gaps (docs/testing.md).
exec "${PYTEST[@]}" -rs -n "${HPCSERVE_TEST_WORKERS:-2}" --durations=20
