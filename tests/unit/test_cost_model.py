"""scripts/cost_model.py: the roofline algebra on hand-computed cases, the fit, and --check on the
committed benchmark results."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from scripts import cost_model as cm

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "bench" / "qwen" / "results.json"


# 1e9 parameters in bf16 = 2e9 bytes; 1 TB/s and 100 TFLOP/s: weights read in 2 ms, 2e9 FLOPs
# per token take 20 us, so the ridge is at 100 tokens.
TOY = cm.ModelShape("toy", 1e9, layers=2, hidden=1000, kv_heads=2, head_dim=64)
TOY_DRAFT = cm.ModelShape("toy-draft", 1e8, layers=2, hidden=1000, kv_heads=2, head_dim=64)
HW = cm.Hardware("toy", bandwidth=1e12, flop_rate=1e14, link_bandwidth=1e9, allreduce_latency=1e-5, overhead=0.0)


def _forward(model, tokens, **kw):
    return cm.forward_time(model, HW, new_tokens=tokens, batch=1, context=0, dtype_bytes=2, tp=1, **kw)


def test_roofline_crossover_at_the_ridge():
    assert cm.ridge_tokens(TOY, HW, 2) == pytest.approx(100)
    assert _forward(TOY, 1) == pytest.approx(2e-3)  # memory bound
    assert _forward(TOY, 50) == pytest.approx(2e-3)
    assert _forward(TOY, 100) == pytest.approx(2e-3)  # both terms equal
    assert _forward(TOY, 200) == pytest.approx(4e-3)  # compute bound: 2e9 * 200 / 1e14
    assert _forward(TOY, 1, overhead=1e-3) == pytest.approx(3e-3)


def test_kv_reads_and_attention_flops():
    # 2 layers x 2 KV heads x 64 x (K and V) x 2 bytes = 1024 bytes per token; 1000 tokens of
    # context for 4 requests add 4.096 MB of reads = 4.096 us at 1 TB/s.
    assert TOY.kv_bytes_per_token(2, 1) == 1024
    assert TOY.kv_bytes_per_token(2, 8) == 512  # tp 8 > 2 KV heads: one head per rank, replicated
    with_kv = cm.forward_time(TOY, HW, new_tokens=4, batch=4, context=1000, dtype_bytes=2, tp=1)
    assert with_kv == pytest.approx(2e-3 + 4.096e-6)
    assert TOY.flops(1, 1000, 1) == pytest.approx(2e9 + 4 * 2 * 1000 * 1000)


def test_tensor_parallel_all_reduces():
    assert cm.comm_time(TOY, HW, 10, 2, tp=1) == 0.0
    # 10 tokens x 1000 x 2 bytes = 20 kB; ring at tp 2 moves 2 * 1/2 of it at 1 GB/s = 20 us,
    # plus 10 us latency, twice per layer, 2 layers.
    assert cm.comm_time(TOY, HW, 10, 2, tp=2) == pytest.approx(2 * 2 * (1e-5 + 2e-5))
    # tp divides weights and flops alike.
    tp4 = cm.forward_time(TOY, HW, new_tokens=1, batch=1, context=0, dtype_bytes=2, tp=4)
    assert tp4 == pytest.approx(0.5e-3 + cm.comm_time(TOY, HW, 1, 2, tp=4))


def test_no_acceptance_and_free_draft_gives_no_speedup():
    setup = cm.Setup(TOY, None, HW)
    nothing = cm.Speculation(acceptance_length=1.0, nodes_per_step=0, draft_forwards=0, draft_tokens_per_step=0)
    for batch in (1, 8, 64, 512):
        assert cm.speedup(setup, nothing, batch, context=512) == pytest.approx(1.0)
    # Verifying nodes that are never accepted can only cost.
    wasted = cm.Speculation(1.0, nodes_per_step=200, draft_forwards=0, draft_tokens_per_step=0)
    assert cm.speedup(setup, wasted, 1, context=0) == pytest.approx(2e-3 / 4.02e-3)  # 201 tokens: compute bound


def test_speedup_by_hand():
    setup = cm.Setup(TOY, TOY_DRAFT, HW)
    # L = 3, N = 5, 3 draft forwards of the 1e8 draft (0.2 ms each, memory bound), batch 1:
    # verification of 6 tokens is still memory bound (2 ms); step 2.6 ms for 3 tokens against
    # 2 ms for 1 token.
    spec = cm.Speculation(acceptance_length=3.0, nodes_per_step=5, draft_forwards=3, draft_tokens_per_step=7)
    assert cm.draft_time(setup, spec, 1, context=0) == pytest.approx(0.6e-3)
    assert cm.speedup(setup, spec, 1, context=0) == pytest.approx(3 / 2.6e-3 * 2e-3)
    # At batch 64 verification is 64 * 6 = 384 tokens: compute bound, 7.68 ms; the draft
    # forwards stay memory bound (catch-up 192 tokens: 0.384 ms; 2 x 128 tokens: 0.256 ms).
    assert cm.speedup(setup, spec, 64, context=0) == pytest.approx(
        3 / (7.68e-3 + 0.384e-3 + 2 * 0.256e-3) * 2e-3)
    # Overheads: 1 ms per target forward, 0.5 ms per draft forward, 0.1 ms per request per step.
    slow = cm.Setup(TOY, TOY_DRAFT, cm.Hardware("toy", 1e12, 1e14, overhead=1e-3, request_overhead=1e-4),
                    draft_overhead=0.5e-3)
    assert cm.speedup(slow, spec, 1, context=0) == pytest.approx(3 / (2.6e-3 + 1e-3 + 1.5e-3 + 1e-4) * 3.1e-3)


def test_speculation_shapes():
    chain = cm.Speculation.chain(acceptance_length=3.0, k=4)
    assert (chain.nodes_per_step, chain.draft_forwards, chain.draft_tokens_per_step) == (4, 4, 6)
    measured = cm.Speculation.gsd(4.0, 9.0, depth=4, draft_tokens_per_accepted=5.0)
    assert measured.draft_tokens_per_step == 20.0 and measured.draft_forwards == 4
    assert cm.Speculation.gsd(4.0, 9.0, depth=4).draft_tokens_per_step == 13.0  # L + N bound


def test_node_budget_by_batch():
    setup = cm.Setup(TOY, TOY_DRAFT, HW)  # ridge at 100 tokens per target forward
    assert [cm.max_useful_nodes(setup, b) for b in (1, 8, 32, 64, 128)] == [99, 11, 2, 0, 0]
    h100 = cm.Setup(cm.MODELS["llama-70b"], cm.MODELS["llama-1b"], cm.GPUS["H100"], tp=8)
    assert cm.ridge_tokens(h100.target, h100.hw, 2) == pytest.approx(989e12 / 3.35e12)
    assert cm.max_useful_nodes(h100, 1) == 128  # vLLM's cap


def test_presets_and_bench_metadata():
    assert cm.preset_for("qwen2.5-coder-1.5b-instruct-q4_k_m-bfloat16").name == "qwen-1.5b"
    assert cm.preset_for("qwen2.5-coder-0.5b-instruct-q4_k_m-bfloat16").name == "qwen-0.5b"
    assert cm.preset_for("Qwen2.5-72B-Instruct").name == "qwen-72b"
    assert cm.preset_for("Llama-3.1-70B-Instruct").name == "llama-70b"
    assert cm.preset_for("draft-perturbed-16edd02ea25e") is None
    assert cm.bench_depth({"argv": "--pair qwen --depth 6"}) == 6
    assert cm.bench_depth({"argv": "--depth=5"}) == 5
    assert cm.bench_depth({"argv": "--pair qwen"}) == 4
    assert [cm.method_of(c) for c in ("no_spec", "ngram_k4", "draft_model_k2", "gsd_graph", "eagle_k3")] == [
        "none", "ngram", "chain", "gsd", None]


def _synthetic_results(setup, context, depth):
    """A results.json whose rows follow the model exactly for `setup`."""
    rows = []
    for batch in (1, 8, 32):
        plain = cm.plain_step_time(setup, batch, context)
        rows.append({"config": "no_spec", "batch": batch, "tokens_per_s": batch / plain,
                     "mean_acceptance_length": None, "nodes_per_step": None, "draft_tokens_per_accepted": None})
        for config, spec, extra in (
                ("draft_model_k2", cm.Speculation.chain(2.5, 2), {}),
                ("draft_model_k4", cm.Speculation.chain(3.4, 4), {}),
                ("gsd_graph", cm.Speculation.gsd(4.0, 9.0, depth, 4.6), {"draft_tokens_per_accepted": 4.6})):
            rows.append({"config": config, "batch": batch,
                         "tokens_per_s": batch / plain * cm.speedup(setup, spec, batch, context),
                         "mean_acceptance_length": spec.acceptance_length, "nodes_per_step": spec.nodes_per_step,
                         "draft_tokens_per_accepted": None, **extra})
    return {"meta": {"argv": f"--depth {depth}"}, "pair": {}, "rows": rows}


def test_fit_recovers_a_machine_and_predicts_held_out_rows():
    target, draft = cm.MODELS["qwen-1.5b"], cm.MODELS["qwen-0.5b"]
    truth = cm.Setup(target, draft, cm.Hardware("cpu", 30e9, 0.5e12, overhead=0.05, request_overhead=2e-3),
                     draft_overhead=0.01)
    results = _synthetic_results(truth, context=256, depth=4)
    fitted = cm.fit_setup(results, target=target, draft=draft, context=256, dtype_bytes=2, depth=4)
    assert fitted.hw.bandwidth == pytest.approx(30e9, rel=0.02)
    assert fitted.hw.overhead == pytest.approx(0.05, rel=0.02)
    assert fitted.draft_overhead == pytest.approx(0.01, rel=0.05)
    rows = cm.check(results, fitted, context=256, depth=4)
    assert len(rows) == 9
    assert max(abs(r.error) for r in rows) < 0.01  # the gsd rows were not fitted


def test_check_runs_on_the_committed_results(capsys):
    results = json.loads(RESULTS.read_text())
    assert cm.main(["--check", str(RESULTS)]) == 0
    out = capsys.readouterr().out
    speculative = [r for r in cm.modeled_rows(results) if cm.method_of(r["config"]) != "none"]
    printed = [line for line in out.splitlines()
               if line.split()[:1] and line.split()[0] in {r["config"] for r in speculative}]
    assert len(printed) == len(speculative) > 0
    for line in printed:
        measured, predicted, error = line.split()[2:5]
        assert math.isfinite(float(predicted)) and float(predicted) > 0
        assert error.endswith("%")
    assert "gsd: mean |error|" in out


def test_predict_cli(capsys):
    assert cm.main(["--gpu", "H100", "--tp", "8", "--target", "llama-70b", "--draft", "llama-1b",
                    "--batch", "1,64", "--acceptance-length", "4", "--nodes-per-step", "24", "--depth", "6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "ridge 295 tokens" in lines[1]
    batch1, batch64 = (line.split() for line in lines[-2:])
    assert batch1[0] == "1" and float(batch1[4].rstrip("x")) > 1.0  # memory bound: speculation pays
    assert batch64[0] == "64" and float(batch64[4].rstrip("x")) < 1.0  # 64 x 25 tokens: compute bound


def test_unknown_preset_is_named():
    with pytest.raises(SystemExit, match="unknown model preset 'llama-400b'"):
        cm.main(["--gpu", "H100", "--target", "llama-400b"])


def test_host_costs_add_to_the_speculative_step_only():
    """Host costs by hand: the step's own, one per level after the first forward, the reads, the
    tree launches of every target layer and, for an eager draft, every draft layer's launches."""
    setup = cm.Setup(TOY, TOY_DRAFT, HW)
    spec = cm.Speculation.gsd(3.0, 8, depth=3)
    host = cm.HostCosts(step=1e-3, per_level=2e-4, syncs_per_step=5, sync=2e-5, tree_launches_per_layer=4,
                        launch=5e-6, eager_draft=True, draft_launches_per_layer=10)
    by_hand = 1e-3 + 2 * 2e-4 + 5 * 2e-5 + 4 * 5e-6 * TOY.layers + 3 * TOY_DRAFT.layers * 10 * 5e-6
    assert host.speculative_step(setup, spec) == pytest.approx(by_hand)
    with_host = cm.Setup(TOY, TOY_DRAFT, HW, host=host)
    assert (cm.speculative_step_time(with_host, spec, 1, 0) - cm.speculative_step_time(setup, spec, 1, 0)
            == pytest.approx(by_hand))
    assert cm.plain_step_time(with_host, 1, 0) == cm.plain_step_time(setup, 1, 0)
    in_graphs = cm.HostCosts(step=1e-3, per_level=2e-4, syncs_per_step=5, sync=2e-5, tree_launches_per_layer=4,
                             launch=5e-6)
    assert in_graphs.speculative_step(setup, spec) == pytest.approx(by_hand - 3 * TOY_DRAFT.layers * 10 * 5e-6)


def test_predict_cli_with_host_costs(capsys):
    """Given host costs, the table shows the speedup with them and without (the roofline's)."""
    args = ["--gpu", "H100", "--tp", "8", "--target", "llama-70b", "--draft", "llama-1b", "--batch", "1",
            "--acceptance-length", "4", "--nodes-per-step", "24", "--depth", "6"]
    assert cm.main(args) == 0
    roofline = float(capsys.readouterr().out.splitlines()[-1].split()[4].rstrip("x"))
    assert cm.main(args + ["--syncs-per-step", "10", "--eager-draft"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "10 device reads" in out[2] and "eager draft" in out[2]
    batch1 = out[-1].split()
    host_ms, with_host, without = float(batch1[4]), float(batch1[5].rstrip("x")), float(batch1[6].rstrip("x"))
    assert host_ms == pytest.approx(10 * 0.02 + 6 * 16 * 12 * 0.005, abs=0.01)
    assert without == roofline and with_host < without
