"""The GPU check's one-call command, rehearsed on CPU: `python -m scripts.gpu_check --cpu-smoke`
runs every section (probe, correctness, benchmark) at tiny sizes in the Triton interpreter.

It runs in a subprocess as the GPU machine would run it: without vLLM imported and with numba
unimportable (that machine may lack it; ``sys.modules["numba"] = None`` makes ``import numba``
raise ImportError). A second test checks the probe's restatement of vLLM's cache layout against
vLLM itself (the probe cannot import vLLM).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ["buckets", "deploy", "offsets", "host", "walk", "gumbel"]

# Runs gpu_check as `python -m` would, after making numba unimportable; then checks that
# nothing imported numba or vLLM behind its back.
_RUNNER = """
import runpy, sys
sys.modules["numba"] = None
sys.argv = ["gpu_check", "--cpu-smoke", "--out", sys.argv[1]]
try:
    runpy.run_module("scripts.gpu_check", run_name="__main__", alter_sys=True)
finally:
    assert sys.modules.get("numba") is None, "the smoke run imported numba"
    assert "vllm" not in sys.modules, "the smoke run imported vLLM"
"""


def test_cpu_smoke_run_writes_the_report(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, "-c", _RUNNER, str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert "all checks passed" in proc.stdout, log[-6000:]
    # The short summary table is printed last: one row per probe section.
    tail = proc.stdout[proc.stdout.index("| probe section | result |"):]
    for name in SECTIONS:
        assert f"| {name} |" in tail, tail

    md = (tmp_path / "gpu_check.md").read_text()
    for name in SECTIONS:
        assert f"## probe: {name}" in md
    assert "## Correctness" in md and "## Graph attention timing" in md and "failures: 0" in md

    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["finished"] and data["smoke"] and data["failures"] == []
    assert list(data["probe"]) == SECTIONS
    for name, section in data["probe"].items():
        rows = section["rows"]
        assert rows, f"probe section {name} produced no rows"
        assert all(r["status"] in ("ok", "skipped") for r in rows), rows
    deploy = data["probe"]["deploy"]["rows"]
    assert {r["case"].split()[-2] for r in deploy} == {"LBNHC", "LBHNC"}
    assert all(r["nan_out"] == 0 and r["pad_written"] == 0 for r in deploy)
    assert all(r["past_threshold"] for r in data["probe"]["offsets"]["rows"])
    walk = {r["case"].split(" B=")[0]: r for r in data["probe"]["walk"]["rows"]}
    # Both walks run on the device without reading it: the torch walk takes a fixed number of
    # gathers (graph/acceptance.py), no early-exit read per depth.
    assert walk["triton_walk_tree"]["host_reads"] == 0
    assert walk["walk_tree (torch)"]["host_reads"] == 0


def test_probe_layout_orders_match_vllm():
    """gpu_probe.VLLM_LAYOUT_ORDERS restates vLLM's KVCacheLayout, and TRITON_ATTN, declaring no
    layout of its own, gets the default preference's first: LBNHC. Checked in a subprocess
    (importing vLLM's Triton backend here could disturb the interpreter the kernel tests use)."""
    code = """
import json
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
from vllm.v1.kv_cache_layout import KVCacheLayout
print(json.dumps({"orders": {m.name: list(m.value) for m in KVCacheLayout},
                  "triton": [m.name for m in get_supported_kv_cache_layouts([TritonAttentionBackend])]}))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    vllm = json.loads(proc.stdout.strip().splitlines()[-1])
    from scripts.gpu_probe import VLLM_LAYOUT_ORDERS  # noqa: PLC0415

    for name, order in VLLM_LAYOUT_ORDERS.items():
        assert vllm["orders"][name] == list(order), name
    assert vllm["triton"][0] == "LBNHC"
    assert "LBHNC" in vllm["triton"]
