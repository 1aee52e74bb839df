"""vLLM platform plugin (test only): the CPU platform with a Ray device key, behind an env var.

vLLM resolves its platform once per process, trying every `vllm.platform_plugins` entry point;
an out-of-tree plugin that answers a class name wins over the built-in detection. This one
answers None unless `GSD_TEST_RAY_CPU=1`, so a process without the variable gets vLLM's own
CPU platform, untouched. The variable has no `VLLM_` prefix on purpose: vLLM warns about
unknown `VLLM_*` variables. It must be in the environment before the process first touches
`vllm.platforms.current_platform`: Ray workers resolve the platform when they unpickle vLLM's
worker class, long before vLLM copies the driver's variables into them, so the test sets it
before `ray.init` and the workers inherit it from the raylet.
"""

from __future__ import annotations

import os

ENABLE_ENV = "GSD_TEST_RAY_CPU"
PLATFORM_QUALNAME = "gsd_test_ray_cpu.platform.RayCpuPlatform"


def platform_plugin() -> str | None:
    """vLLM's platform-plugin protocol: a platform class's qualified name, or None (inactive)."""
    return PLATFORM_QUALNAME if os.environ.get(ENABLE_ENV) == "1" else None
