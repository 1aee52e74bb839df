"""vllm_v0_32/runner/profile_peak.py: a tree step's peak logits and noise are allocated in vLLM's
profile run, on CUDA, at their largest."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm_gsd.engine.scorer import rows_per_chunk
from vllm_gsd.vllm_v0_32.runner.profile_peak import allocate_step_peak, verification_rows


def test_verification_rows_are_every_root_and_node_within_the_token_budget():
    assert verification_rows(max_num_tokens=8192, max_num_reqs=256, num_nodes=24) == 6400
    assert verification_rows(max_num_tokens=8192, max_num_reqs=512, num_nodes=24) == 8192


def test_the_peak_holds_the_logits_a_float32_chunk_and_its_noise_together():
    """The LM head runs over every verified row, and a chunk's noise is drawn while the logits
    live (peak = their sum): with a vocabulary whose chunk is smaller than the rows, the chunk
    is the scorer's own."""
    vocab, hidden_size, rows = 300_000, 16, 600
    head = torch.nn.Linear(hidden_size, vocab, bias=False, dtype=torch.bfloat16)
    seen = []

    def compute_logits(hidden):
        seen.append(hidden.shape)
        return head(hidden)

    got_rows, chunk = allocate_step_peak(compute_logits, hidden_size, torch.bfloat16, torch.device("cpu"),
                                         rows, top_k=4)
    assert seen == [torch.Size([rows, hidden_size])]
    assert (got_rows, chunk) == (rows, rows_per_chunk(vocab)) and chunk < rows


def test_the_profile_run_allocates_the_peak_on_cuda_only(monkeypatch):
    """The runner's dummy-run wrapper calls it in profile runs of a CUDA runner, with the step's
    verification rows and the graph's top_k; not in other dummy runs, not on a CPU runner (whose
    KV cache is sized by the user)."""
    from vllm_gsd.vllm_v0_32.runner import profile_peak, setup_hooks

    calls = []
    monkeypatch.setattr(profile_peak, "allocate_step_peak", lambda *args: calls.append(args))
    monkeypatch.setattr("vllm_gsd.vllm_v0_32.kernel_warmup.warm_up_runner", lambda runner: None)

    def runner_on(device):
        return SimpleNamespace(
            speculative_config=SimpleNamespace(method="gsd", num_speculative_tokens=24, enforce_eager=False),
            device=torch.device(device), max_num_tokens=8192, max_num_reqs=512, dtype=torch.bfloat16,
            model=SimpleNamespace(compute_logits=None), model_config=SimpleNamespace(get_hidden_size=lambda: 64),
            drafter=SimpleNamespace(dummy_run=lambda *a, **k: None, graph_params=SimpleNamespace(top_k=4)))

    dummy_run = setup_hooks.wrap_dummy_run(lambda self, num_tokens, *args, **kwargs: None)
    monkeypatch.setattr(setup_hooks, "is_gsd_runner", lambda runner: True)
    dummy_run(runner_on("cuda"), 8192, is_profile=True)
    assert [(c[4], c[5]) for c in calls] == [(8192, 4)]  # rows, top_k
    dummy_run(runner_on("cuda"), 8192)
    dummy_run(runner_on("cpu"), 8192, is_profile=True)
    assert len(calls) == 1
