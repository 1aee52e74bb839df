"""vLLM's CPU platform, plus the one attribute that vLLM's Ray executor requires.

vLLM's Ray executors reserve one unit of `ray_device_key` per worker in a placement group and
read each worker's unit back with `ray.get_runtime_context().get_accelerator_ids()[key]`. That
mapping only holds Ray's accelerator resource names, so the key must be one of them: "GPU" is
the one Ray lets a machine declare without having it (`ray.init(num_gpus=N)` is a count of
logical slots, nothing probes for a device). So on this platform a Ray "GPU" is a scheduling
slot for one CPU worker; the worker still runs vLLM's CPU worker on the CPU. Ray would set
CUDA_VISIBLE_DEVICES in each worker to its slot; the noset variable below keeps the workers'
environment that of an ordinary CPU process.
"""

from __future__ import annotations

from vllm.platforms.cpu import CpuPlatform


class RayCpuPlatform(CpuPlatform):
    ray_device_key: str = "GPU"
    ray_noset_device_env_vars: list[str] = ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]
