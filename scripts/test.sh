#!/usr/bin/env bash
# Run the whole test suite (unit, kernels in the Triton interpreter, real-engine, served) on CPU.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not engine"` for the fast part only.
set -euo pipefail
cd "$(dirname "$0")/.."
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export VLLM_HOST_IP="${VLLM_HOST_IP:-127.0.0.1}"
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
export TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest "$@"
