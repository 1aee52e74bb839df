"""The vLLM 0.32 adapter: every vLLM touchpoint of vllm-gsd, behind registry.py's version gate.

What lives here (and nowhere else): the patch registry and the declarations of every patch and
use (registry.py, patches.py), the config-scope patches (config_patches.py), the V1 model
runner's hooks (runner/), the scheduler's grammar hooks (scheduler_hooks.py), the attention
backend subclasses (attention/), the rejection-sampler and sampler subclasses (scorer.py),
vLLM's spec-decode metadata carrying the trees (spec_decode.py) and the Ray variables
(ray_env.py). The version-independent step (tree batch, scoring walk, drafter, draft head, draft
KV ledger, metrics) is in vllm_gsd/engine/; dependencies point one way: vllm_v0_32 -> engine ->
policy, graph, kernels. A newer vLLM is a sibling adapter package (docs/porting.md).

Importing this package is cheap: vllm_gsd/plugin.py imports registry.py in every process, in any
vLLM.
"""
