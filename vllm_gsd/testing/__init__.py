"""Test bed of the engine tests: tiny offline models, their prompts, engine factories, probes.

Submodules (import them explicitly; none is imported here, so importing the package is cheap):
  tiny_models    -- tiny Llama target + derived drafts, trained offline on local text, cached.
  tiny_tokenizer -- their corpus (this machine's stdlib sources) and byte-level BPE tokenizer.
  prompts        -- fixed code prompts for the tiny models.
  engines        -- the tests' engine configurations and factories, acceptance figures.
  worker_probes  -- a worker extension the engine loads by name in its worker processes (Ray
                    workers included, which see only installed packages): why it ships here.
  cache          -- the shared cache directory and the atomic, lock-protected build helper.

Benchmark, soak, demo and GPU-check tooling (real model pairs, HumanEval / MT-Bench prompts, the
served-engine helpers, the load client, the RSS sampler) is in scripts/tools, not in the wheel.
"""
