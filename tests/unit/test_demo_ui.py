"""scripts/demo.py's report, on made-up figures (no engine, no model)."""

from __future__ import annotations

import importlib

import pytest


@pytest.fixture(scope="module")
def demo():
    return importlib.import_module("scripts.demo")  # defines functions only: nothing runs, no environment is set


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


def _gsd_verdicts(notes: list[str]) -> list[str]:
    return [n for n in notes if n.startswith("GSD (N=24, adaptive)")]


def test_step_costs_are_stated_and_the_verdict_comes_from_the_end_to_end_ratio(demo):
    # 250 ms for 3.8 tokens = 66 ms a token, against 64 ms a plain step: the step line gives the
    # figures, the run's measured ratio gives the verdict.
    notes = demo.speculation_notes(_rows(15.0, 9.0, 14.0), _gsd(64, 250, 3.8))
    text = " ".join(notes)
    assert "a plain step took 64 ms for 1 token" in text
    assert "250 ms for 3.8 tokens, the time of 3.9 plain steps (66 ms a token)" in text
    assert "pay" not in notes[0]  # no verdict from the few drafted steps
    assert "vLLM draft_model (K=4) is slower than no speculation here (0.60x)." in notes
    assert _gsd_verdicts(notes) == ["GSD (N=24, adaptive) is slower than no speculation here (0.93x)."]


def test_a_faster_run_is_the_verdict_when_speculation_is_faster(demo):
    notes = demo.speculation_notes(_rows(15.0, 20.0, 30.0), _gsd(64, 100, 3.8))
    assert "vLLM draft_model (K=4) is faster than no speculation here (1.33x)." in notes
    assert _gsd_verdicts(notes) == ["GSD (N=24, adaptive) is faster than no speculation here (2.00x)."]
    assert "slower" not in " ".join(notes) and "plain decoding" not in " ".join(notes)


def test_mostly_plain_steps_give_one_verdict_from_the_measured_ratio(demo):
    # A CPU without AMX tiles: the few drafted steps looked cheap (1.7 plain steps for 1.9 tokens),
    # yet the budget decoded 96% of the steps plainly and the run measured 0.98x. One verdict.
    gsd = _gsd(100, 170, 1.9, trees=4, speculated=4, not_speculated=96, vetoed=90)
    notes = demo.speculation_notes(_rows(10.0, 9.0, 9.8), gsd)
    assert "the time of 1.7 plain steps" in notes[0]
    assert not any("pays" in n or "cannot pay" in n for n in notes)
    assert _gsd_verdicts(notes) == [
        "GSD (N=24, adaptive) is about as fast as no speculation here (0.98x): its adaptive budget kept "
        "plain decoding on 96% of the steps because trees did not pay on this machine (90 of them "
        "decided on measured step times, the rest by its cost model)."]


def test_mostly_plain_steps_in_a_faster_run_are_not_called_a_gain_of_trees(demo):
    gsd = _gsd(100, 170, 1.9, trees=4, speculated=4, not_speculated=96, vetoed=0)
    (verdict,) = _gsd_verdicts(demo.speculation_notes(_rows(10.0, 9.0, 11.0), gsd))
    assert verdict.startswith("GSD (N=24, adaptive) is faster than no speculation here (1.10x), though")
    assert "plain decoding on 96% of the steps (decided by its cost model)" in verdict
    assert "run-to-run spread" in verdict


def test_missing_measurements_say_what_was_measured(demo):
    only_plain = _gsd(64, 0, 0, trees=0, speculated=0, not_speculated=50, vetoed=50)
    notes = " ".join(demo.speculation_notes(_rows(15.0, 9.0, 15.0), only_plain))
    assert "verified no tree" in notes
    assert "about as fast as no speculation here (1.00x): its adaptive budget kept plain decoding on 100%" in notes
    assert demo.speculation_notes(_rows(15.0, 15.0, 15.0), None) == [
        "vLLM draft_model (K=4) is about as fast as no speculation here (1.00x).",
        "GSD (N=24, adaptive) is about as fast as no speculation here (1.00x).",
    ]


def test_results_table(demo):
    lines = demo.results_table(_rows(10.0, 5.0, 20.0))
    assert lines[0].split()[:2] == ["method", "tokens/s"]
    assert lines[1].split()[-2:] == ["10.00", "1.00"]  # no acceptance length without speculation
    assert lines[3].split()[-3:] == ["20.00", "2.00", "3.80"]


def test_the_int8_draft_is_the_default_only_where_amx_runs_it(demo, monkeypatch):
    """The int8 (W8A8) draft pays only through AMX int8 tiles; elsewhere the demo drafts with the
    bf16 checkpoint. Either can be asked for; the smollm pair's self-draft stays as prepared."""
    for amx, want in ((True, True), (False, False)):
        monkeypatch.setattr(demo, "cpu_has_amx", lambda amx=amx: amx)
        assert demo.uses_int8_draft(demo.parse_args([])) is want
        assert demo.uses_int8_draft(demo.parse_args(["--int8-draft"])) is True
        assert demo.uses_int8_draft(demo.parse_args(["--bf16-draft"])) is False
        assert demo.uses_int8_draft(demo.parse_args(["--pair", "smollm", "--int8-draft"])) is False
