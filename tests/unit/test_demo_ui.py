"""scripts/demo.py's report, on made-up figures (no engine, no model)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "scripts" / "demo.py"


@pytest.fixture(scope="module")
def demo():
    spec = importlib.util.spec_from_file_location("gsd_demo_script", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only: nothing runs, no environment is set
    return module


def _rows(no_spec: float, chain: float, gsd: float) -> list[dict]:
    return [{"method": "no speculation", "tokens_per_s": no_spec, "mean_acceptance_length": None},
            {"method": "vLLM draft_model (K=4)", "tokens_per_s": chain, "mean_acceptance_length": 3.1},
            {"method": "GSD (N=24, adaptive)", "tokens_per_s": gsd, "mean_acceptance_length": 3.8}]


def _gsd(plain_ms: float, spec_ms: float, spec_tokens: float, trees: int = 10,
         speculated: int = 10, not_speculated: int = 5, vetoed: int = 0) -> dict:
    plain_steps = 20
    return {"trees_verified": trees, "steps_speculated": speculated, "steps_not_speculated": not_speculated,
            "steps_vetoed": vetoed,
            "speculative_step_us": int(spec_ms * 1e3 * trees), "speculative_step_tokens": round(spec_tokens * trees),
            "plain_step_us": int(plain_ms * 1e3 * plain_steps), "plain_step_tokens": plain_steps}


def test_cannot_pay_when_a_speculative_token_costs_more_than_a_plain_one(demo):
    # 250 ms for 3.8 tokens = 66 ms a token, against 64 ms a plain step: just below break-even.
    notes = " ".join(demo.speculation_notes(_rows(15.0, 9.0, 14.0), _gsd(64, 250, 3.8)))
    assert "cannot pay" in notes
    assert "a plain step took 64 ms for 1 token" in notes
    assert "250 ms for 3.8 tokens" in notes
    assert "more than 3.9 tokens" in notes
    assert "vLLM draft_model (K=4) is slower than no speculation here (0.60x)" in notes
    assert "GSD (N=24, adaptive) is slower than no speculation here (0.93x)" in notes


def test_no_cannot_pay_when_speculation_is_faster_per_token(demo):
    notes = " ".join(demo.speculation_notes(_rows(15.0, 20.0, 30.0), _gsd(64, 100, 3.8)))
    assert "cannot pay" not in notes
    assert "Speculation pays here" in notes
    assert "slower than no speculation" not in notes
    assert "close to no speculation" not in notes


def test_mostly_plain_steps_are_reported_as_close_to_no_speculation(demo):
    gsd = _gsd(64, 300, 2.0, trees=3, speculated=3, not_speculated=97, vetoed=90)
    notes = " ".join(demo.speculation_notes(_rows(15.0, 9.0, 15.2), gsd))
    assert "cannot pay" in notes
    assert "decoded 97% of the steps without drafting (90 of them vetoed" in notes
    assert "close to no speculation" in notes
    assert "GSD (N=24, adaptive) is about as fast as no speculation here (1.01x)" in notes


def test_missing_measurements_say_what_was_measured(demo):
    only_plain = _gsd(64, 0, 0, trees=0, speculated=0, not_speculated=50, vetoed=50)
    notes = " ".join(demo.speculation_notes(_rows(15.0, 9.0, 15.0), only_plain))
    assert "verified no tree" in notes and "cannot pay" not in notes
    assert demo.speculation_notes(_rows(15.0, 15.0, 15.0), None) == [
        "vLLM draft_model (K=4) is about as fast as no speculation here (1.00x).",
        "GSD (N=24, adaptive) is about as fast as no speculation here (1.00x).",
    ]


def test_results_table(demo):
    lines = demo.results_table(_rows(10.0, 5.0, 20.0))
    assert lines[0].split()[:2] == ["method", "tokens/s"]
    assert lines[1].split()[-2:] == ["10.00", "1.00"]  # no acceptance length without speculation
    assert lines[3].split()[-3:] == ["20.00", "2.00", "3.80"]
