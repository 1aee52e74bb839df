"""vllm-gsd: graph-structured speculative decoding for vLLM.

Importing this package is cheap: vLLM is only touched by `vllm_gsd.plugin.register()`, which vLLM
calls through the `vllm.general_plugins` entry point.
"""

__version__ = "0.1.0"
