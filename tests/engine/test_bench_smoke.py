"""`python -m scripts.bench --quick` runs end to end and writes its table (CI smoke test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]


def test_quick_benchmark_writes_results(tmp_path):
    out = subprocess.run([sys.executable, "-m", "scripts.bench", "--quick", "--out", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    configs = {r["config"] for r in rows}
    assert {"no_spec", "draft_model_k4", "gsd", "gsd_graph_fixed"} <= configs
    # Every configuration ran every workload (plain, a repetition penalty, JSON under a schema).
    assert {(r["workload"], r["config"]) for r in rows} == {(w, c) for w in ("plain", "penalty", "json") for c in configs}
    gsd = [r for r in rows if r["config"].startswith("gsd")]
    assert all(r["identical_to_no_spec"] for r in gsd)  # float32 tiny pair: exact
    # The fixed budget always drafts; the adaptive one decides by the costs it measured on this
    # machine (the tiny draft costs about what the tiny target does), and reports how it decided.
    assert all(r["mean_acceptance_length"] > 1.0 for r in gsd if r["config"] == "gsd_graph_fixed")
    assert all(0.0 <= r["plain_step_share"] <= 1.0 and r["step_ms"]["target_forward"] > 0 for r in gsd)
    # TPOT (decode time per token after the first) comes from vLLM's request stats, every row.
    assert all(r["tpot_ms"] > 0 and r["tpot_ratio"] > 0 for r in rows)
    assert all(r["tpot_ratio"] == 1.0 for r in rows if r["config"] == "no_spec")
    assert "| gsd |" in (tmp_path / "results.md").read_text()
