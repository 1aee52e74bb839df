"""Helpers of the benchmark, soak, demo and GPU-check scripts, also used by the tests that check
them and by the served tests (not in the wheel; import the submodules explicitly):

  real_models      -- Qwen2.5-Coder 1.5B/0.5B and SmolLM2-135M prepared as HF directories.
  prompt_sets      -- HumanEval / MT-Bench prompts read out of downloaded wheels; chat templates.
  server           -- the real `vllm serve` started and stopped on 127.0.0.1; /metrics scraping.
  load             -- concurrent request mixes against a server, and their checks.
  memory           -- RSS of a server's process tree over time (the soak's leak check).
  kernel_testutils -- random kernel inputs and loop oracles (tests/kernels and scripts/gpu_check).

The engine tests' own test bed (tiny models, engine factories, worker probes) stays in
vllm_gsd.testing: vLLM's worker processes import the probes by name, Ray workers included.
"""
