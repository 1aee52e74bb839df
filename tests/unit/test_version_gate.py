"""A vLLM other than the pinned one (faked in a fresh interpreter, where vLLM itself loads the
plugin through its entry point): the plugin logs one warning and patches nothing; LLM(...) with
method "gsd" fails at once naming the supported version, and no engine process starts; an engine
without gsd starts and generates as without the plugin."""

from __future__ import annotations

import subprocess
import sys

import pytest

FAKE_VERSION = r"""
import multiprocessing, sys
import vllm
vllm.__version__ = "0.33.0"
"""

REPORT = r"""
from vllm.config.speculative import SpeculativeConfig
from vllm_gsd.vllm_v0_32 import registry
print("APPLIED", sorted(registry._APPLIED))
print("GSD_FIELD", "gsd" in SpeculativeConfig.__dataclass_fields__)
"""

GSD_ENGINE = FAKE_VERSION + r"""
from vllm import LLM
try:
    LLM(model=sys.argv[1], skip_tokenizer_init=True,
        speculative_config={"method": "gsd", "model": sys.argv[1], "num_speculative_tokens": 8})
except Exception as exc:
    print("RAISED", type(exc).__name__, exc)
print("CHILDREN", len(multiprocessing.active_children()))
""" + REPORT

PLAIN_ENGINE = FAKE_VERSION + r"""
from vllm import SamplingParams
from vllm_gsd.testing.engines import make_llm
llm = make_llm(sys.argv[1])
out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(temperature=0.0, max_tokens=8),
                   use_tqdm=False)
print("GENERATED", len(out[0].outputs[0].token_ids))
llm.llm_engine.engine_core.shutdown()
""" + REPORT

WARNING = "vllm-gsd supports vLLM 0.32.0 only, but vLLM 0.33.0 is installed"


def _run(code: str, model: str) -> tuple[dict[str, str], str]:
    out = subprocess.run([sys.executable, "-c", code, model], capture_output=True, text=True, timeout=600)
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in out.stdout.splitlines()
             if line.split(" ", 1)[0] in ("RAISED", "APPLIED", "GSD_FIELD", "CHILDREN", "GENERATED")}
    return lines, out.stdout + out.stderr


def _warnings(output: str) -> int:
    return sum(WARNING in line and not line.startswith("RAISED") for line in output.splitlines())


def test_a_gsd_engine_fails_naming_the_supported_version(tmp_path):
    from vllm_gsd.vllm_v0_32.registry import PINNED_VLLM_VERSION
    from vllm_gsd.testing.tiny_models import config_only_model

    lines, output = _run(GSD_ENGINE, config_only_model(tmp_path / "model", 512))
    assert lines.get("RAISED", "").startswith("VllmVersionMismatch"), output[-3000:]
    assert f"supports vLLM {PINNED_VLLM_VERSION} only, but vLLM 0.33.0 is installed" in lines["RAISED"]
    assert "no patch was applied" in lines["RAISED"] and "'gsd' is unavailable" in lines["RAISED"]
    assert (lines["APPLIED"], lines["GSD_FIELD"], lines["CHILDREN"]) == ("[]", "False", "0")
    assert _warnings(output) == 1, output[-3000:]


@pytest.mark.engine
def test_an_engine_without_gsd_starts_and_generates():
    from vllm_gsd.testing.tiny_models import tiny_target

    lines, output = _run(PLAIN_ENGINE, str(tiny_target()))
    assert lines.get("GENERATED") == "8", output[-3000:]
    assert (lines["APPLIED"], lines["GSD_FIELD"]) == ("[]", "False")
    assert _warnings(output) == 1, output[-3000:]
