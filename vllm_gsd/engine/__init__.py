"""GSD's step, version-independent where it can be: the tree batch, the scoring walk, the drafter
and its jobs, the draft head, the draft KV ledger, the metrics, the config block.

Every patch of vLLM, and the hooks and subclasses the patches install, are in the adapter of the
vLLM version (vllm_gsd/vllm_v0_32/), which imports this package; this package never imports the
adapter. What still reads vLLM here (GsdProposer's base DraftModelProposer, vLLM's n-gram matcher
in lookup.py, its top-k/top-p and penalty ops in sampling.py and node_processing.py, the
forward context and attention inputs of the draft's forwards) is declared as a use in the
adapter's patches.py, so a vLLM that moved it fails at start by name."""

# GSD's log lines go to a child of vLLM's "vllm" logger, so they share vLLM's handler, format and
# VLLM_LOGGING_LEVEL in every process (a logger outside that tree has no handler and drops INFO).
LOGGER_NAME = "vllm.gsd"
