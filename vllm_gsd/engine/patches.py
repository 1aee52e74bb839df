"""Every change vllm-gsd makes to vLLM 0.32.0, declared in one list.

Read this file to know the whole surface we touch. The mechanism (version gate, target
resolution, idempotence) is in engine/registry.py; the behaviour each patch installs lives in the
module named beside it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal, get_args

from vllm_gsd.engine import registry
from vllm_gsd.engine.config import GSD_METHOD, GsdConfig, finalize_gsd_speculative_config, is_gsd
from vllm_gsd.engine.registry import Patch

# ---------------------------------------------------------------------------------------------
# Config layer (every process)
# ---------------------------------------------------------------------------------------------


def _add_gsd_to_speculative_schema(spec_cls: type) -> None:
    """Widen `method` with "gsd" and add the `gsd: GsdConfig | None` field, then rebuild.

    vLLM's config classes are pydantic dataclasses with extra="forbid"; their schema is compiled
    at class creation, so the dataclass fields themselves are changed and the schema rebuilt.
    """
    from pydantic.dataclasses import rebuild_dataclass

    fields = spec_cls.__dataclass_fields__
    method_field = fields["method"]
    if GSD_METHOD not in _literal_values(method_field.type):
        method_field.type = method_field.type | Literal["gsd"]  # type: ignore[operator]
        spec_cls.__annotations__["method"] = method_field.type
    if "gsd" not in fields:
        gsd_field = dataclasses.field(default=None)
        gsd_field.name, gsd_field.type = "gsd", GsdConfig | None
        gsd_field._field_type = dataclasses._FIELD  # type: ignore[attr-defined]
        fields["gsd"] = gsd_field
        spec_cls.__annotations__["gsd"] = GsdConfig | None
        spec_cls.gsd = None
    rebuild_dataclass(spec_cls, force=True)


def _literal_values(annotation: Any) -> set[Any]:
    values: set[Any] = set()
    for arg in get_args(annotation):
        values |= _literal_values(arg) if get_args(arg) else {arg}
    return values


def _wrap_speculative_post_init(original):
    """Run vLLM's draft-model setup for "gsd", then validate what is specific to GSD.

    vLLM raises NotImplementedError for a model-based method it does not know, so the original
    runs with method "draft_model" (building draft_model_config, draft_parallel_config, the draft
    TP check and the max_model_len clamp) and "gsd" is restored after it.
    """

    @functools.wraps(original)
    def __post_init__(self):
        if self.method != GSD_METHOD:
            if getattr(self, "gsd", None) is not None:
                raise ValueError(
                    "speculative_config.gsd is only valid with method 'gsd', "
                    f"got method {self.method!r}"
                )
            return original(self)
        if self.model is None:
            raise ValueError(
                "speculative_config.model (the draft model) is required for method 'gsd'"
            )
        self.method = "draft_model"
        try:
            original(self)
        finally:
            self.method = GSD_METHOD
        finalize_gsd_speculative_config(self)

    return __post_init__


def _wrap_v2_unsupported(original):
    @functools.wraps(original)
    def _get_v2_model_runner_unsupported_features(self):
        unsupported = original(self)
        if is_gsd(self.speculative_config):
            unsupported.append("speculative method 'gsd'")
        return unsupported

    return _get_v2_model_runner_unsupported_features


def _wrap_vllm_config_post_init(original):
    """Refuse, by name, the settings the GSD path cannot run under."""

    @functools.wraps(original)
    def __post_init__(self):
        if is_gsd(self.speculative_config):
            from vllm import envs

            if self.scheduler_config.async_scheduling:
                raise ValueError(
                    "async_scheduling=True is not supported with speculative method 'gsd' "
                    "(the verification tree is built on the host between steps); "
                    "leave async_scheduling unset or pass --no-async-scheduling"
                )
            if envs.VLLM_USE_V2_MODEL_RUNNER:
                raise ValueError(
                    "VLLM_USE_V2_MODEL_RUNNER=1 is not supported with speculative method 'gsd': "
                    "GSD runs on the V1 model runner; unset VLLM_USE_V2_MODEL_RUNNER"
                )
            if self.parallel_config.pipeline_parallel_size > 1:
                raise ValueError(
                    "pipeline_parallel_size > 1 is not supported with speculative method 'gsd'"
                )
        return original(self)

    return __post_init__


def _wrap_worker_init(original):
    """Apply the worker-scope patches in the worker process, before its model runner exists."""

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        registry.apply("worker")
        return original(self, *args, **kwargs)

    return __init__


CONFIG_PATCHES = [
    Patch(
        target="vllm.config.speculative:SpeculativeConfig",
        why='accept "method": "gsd" and the "gsd" block of graph knobs',
        scope="config",
        mutate=_add_gsd_to_speculative_schema,
    ),
    Patch(
        target="vllm.config.speculative:SpeculativeConfig.__post_init__",
        why="build the draft model config for gsd; validate budget, vocabulary, draft TP",
        scope="config",
        wrap=_wrap_speculative_post_init,
    ),
    Patch(
        target="vllm.config.vllm:VllmConfig._get_v2_model_runner_unsupported_features",
        why="gsd runs on the V1 model runner",
        scope="config",
        wrap=_wrap_v2_unsupported,
    ),
    Patch(
        target="vllm.config.vllm:VllmConfig.__post_init__",
        why="refuse async scheduling, MRV2 and pipeline parallelism with gsd, by name",
        scope="config",
        wrap=_wrap_vllm_config_post_init,
    ),
    Patch(
        target="vllm.v1.worker.worker_base:WorkerBase.__init__",
        why="apply worker-scope patches lazily, inside worker processes",
        scope="config",
        wrap=_wrap_worker_init,
    ),
]

# ---------------------------------------------------------------------------------------------
# Worker layer (inside vLLM workers, before the model runner is built)
# ---------------------------------------------------------------------------------------------

WORKER_PATCHES: list[Patch] = []


def declare_all() -> None:
    """Put every patch above into the registry (once)."""
    if not registry.registered():
        for patch in CONFIG_PATCHES + WORKER_PATCHES:
            registry.register(patch)
