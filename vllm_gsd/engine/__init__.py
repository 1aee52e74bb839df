"""Everything of vllm-gsd that touches vLLM internals (behind engine/registry.py's version gate)."""

# GSD's log lines go to a child of vLLM's "vllm" logger, so they share vLLM's handler, format and
# VLLM_LOGGING_LEVEL in every process (a logger outside that tree has no handler and drops INFO).
LOGGER_NAME = "vllm.gsd"
