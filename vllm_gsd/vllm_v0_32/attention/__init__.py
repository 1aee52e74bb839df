"""vLLM's attention backends with the graph mask for tree rows: graph_backend.py (the shared
design), cpu_backend.py (CPU_ATTN; the plan and attention it runs are engine/cpu_attention.py's)
and triton_backend.py (TRITON_ATTN, CUDA)."""
