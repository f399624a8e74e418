#!/usr/bin/env bash
# Installs everything the tests need on a fresh Debian/Ubuntu machine, then runs them.
# Real components: vLLM on CPU, Ray, and (as root) a real Slurm cluster in network namespaces, whose
# Debian packages the sandbox installs itself on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/python -m pytest -p no:cacheprovider -rs "$@"
