"""The repository's tooling, an importable package that is not part of the wheel.

Run a script as a module from the repository root, e.g. `.venv/bin/python -m scripts.demo`
(`python -m` puts the root first on sys.path, so `scripts.*` and `vllm_gsd` import without any
path edits); the tests import it the same way (pytest's `pythonpath = ["."]`). The helpers the
scripts and the tests share live in `scripts.tools`. Setup, test, cost model and quantize_draft
also run as plain files (`bash scripts/setup.sh`, `python scripts/cost_model.py ...`).
"""
