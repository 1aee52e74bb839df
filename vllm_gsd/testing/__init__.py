"""Test bed for vllm-gsd: tiny offline models, real model pairs from the package registry, prompts.

Submodules (import them explicitly; none is imported here, so importing the package is cheap):
  tiny_models  -- tiny Llama target + derived drafts, trained offline on local text, cached.
  real_models  -- Qwen2.5-Coder 1.5B/0.5B and SmolLM2-135M prepared as HF directories.
  prompts      -- HumanEval / MT-Bench prompts read out of downloaded wheels, local code prompts.
  cache        -- the shared cache directory and the atomic, lock-protected build helper.
"""
