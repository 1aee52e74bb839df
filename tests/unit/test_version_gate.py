"""A vLLM other than the pinned one: LLM(...) with method "gsd" fails at once with the registry's
message, nothing is patched and no engine process starts (a fresh interpreter, where the plugin
is loaded by vLLM itself through its entry point)."""

from __future__ import annotations

import subprocess
import sys

CHILD = r"""
import multiprocessing, sys
import vllm
vllm.__version__ = "0.33.0"
from vllm import LLM
from vllm.config.speculative import SpeculativeConfig
try:
    LLM(model=sys.argv[1], skip_tokenizer_init=True,
        speculative_config={"method": "gsd", "model": sys.argv[1], "num_speculative_tokens": 8})
except Exception as exc:
    print("RAISED", type(exc).__name__, exc)
from vllm_gsd.engine import registry
print("APPLIED", sorted(registry._APPLIED))
print("GSD_FIELD", "gsd" in SpeculativeConfig.__dataclass_fields__)
print("CHILDREN", len(multiprocessing.active_children()))
"""


def test_version_mismatch_refuses_to_patch_at_engine_start(tmp_path):
    from vllm_gsd.engine.registry import PINNED_VLLM_VERSION
    from vllm_gsd.testing.tiny_models import config_only_model

    model = config_only_model(tmp_path / "model", 512)
    out = subprocess.run([sys.executable, "-c", CHILD, model], capture_output=True, text=True, timeout=300)
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in out.stdout.splitlines()
             if line.split(" ", 1)[0] in ("RAISED", "APPLIED", "GSD_FIELD", "CHILDREN")}
    assert lines.get("RAISED", "").startswith("VllmVersionMismatch"), out.stdout + out.stderr[-3000:]
    assert f"supports vLLM {PINNED_VLLM_VERSION} only, but vLLM 0.33.0 is installed" in lines["RAISED"]
    assert "no patch was applied" in lines["RAISED"]
    assert (lines["APPLIED"], lines["GSD_FIELD"], lines["CHILDREN"]) == ("[]", "False", "0")
