"""vLLM general-plugin entry point (`vllm.general_plugins` -> `gsd`).

vLLM calls `register()` once per process: in the API server / offline process, in the engine
core and in every worker (multiprocessing or Ray). It checks the vLLM version and applies the
config-scope patches; worker-scope patches are applied when a worker is constructed. Calling it
again is a no-op. Nothing heavy is imported at module level.
"""

from __future__ import annotations

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm_gsd.engine import patches, registry

    registry.check_vllm_version()
    patches.declare_all()
    registry.apply("config")
    _registered = True
