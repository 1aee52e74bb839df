"""vLLM general-plugin entry point (`vllm.general_plugins` -> `gsd`).

vLLM calls `register()` once per process: in the API server / offline process, in the engine
core and in every worker (multiprocessing or Ray). Calling it again is a no-op. Nothing heavy is
imported at module level.

In the pinned vLLM it applies the config-scope patches of the vLLM 0.32 adapter
(vllm_v0_32/patches.py); worker-scope patches are applied when a gsd worker is constructed. A
newer vLLM would be served by a sibling adapter package, chosen here by version (docs/porting.md).

In any other vLLM it never raises: vLLM loads every installed plugin in every process, so a
plugin that raises there stops every engine of the environment, those that never asked for gsd
included. It logs one warning, patches nothing of vLLM's internals, and installs one guard so
that an engine asking for gsd fails at start with the supported versions named, instead of with
pydantic's list of the methods that vLLM knows.
"""

from __future__ import annotations

import functools
import logging

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm_gsd.vllm_v0_32 import registry

    found = registry.installed_vllm_version()
    if found != registry.PINNED_VLLM_VERSION:
        from vllm_gsd.engine import LOGGER_NAME

        logging.getLogger(LOGGER_NAME).warning(
            "%s Engines without it run as without vllm-gsd.", registry.version_mismatch(found))
        _refuse_gsd_engines(found)
    else:
        from vllm_gsd.vllm_v0_32 import patches

        patches.declare_all()
        registry.apply("config")
    _registered = True


def _refuse_gsd_engines(found: str) -> None:
    """Make `EngineArgs.create_engine_config` refuse a speculative config asking for gsd.

    Every way of starting an engine builds its config there: `LLM(...)` and `LLMEngine` /
    `AsyncLLM.from_engine_args` (hence `vllm serve`, whose `AsyncEngineArgs` inherits it), the
    gRPC server, preloading. It has carried that name since vLLM's first engines, and it runs
    before the speculative config is validated, so the user reads which vLLM gsd needs rather
    than an "Input should be 'ngram', ..." from pydantic. The wrapper reads only the engine
    arguments' `speculative_config` (a dict, or an object with `method`) and `spec_method`
    (`--spec-method`), with `getattr`, and otherwise calls vLLM's method unchanged. Where the
    entry point is gone nothing is installed: the warning has said that gsd is unavailable.
    """
    from vllm_gsd.vllm_v0_32 import registry

    try:
        from vllm.engine.arg_utils import EngineArgs

        original = EngineArgs.create_engine_config
    except (ImportError, AttributeError):
        return

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        if _asks_for_gsd(self):
            raise registry.VllmVersionMismatch(registry.version_mismatch(found))
        return original(self, *args, **kwargs)

    EngineArgs.create_engine_config = create_engine_config


def _asks_for_gsd(engine_args) -> bool:
    spec = getattr(engine_args, "speculative_config", None)
    method = spec.get("method") if isinstance(spec, dict) else getattr(spec, "method", None)
    return "gsd" in (method, getattr(engine_args, "spec_method", None))
