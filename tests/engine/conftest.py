"""Real vLLM engines on tiny models, shared by every engine test of the session.

Engines are expensive (about 20 s each on 2 cores), so each configuration starts once per test
session. Exactness is tested in float32: in bf16 vLLM's own greedy output depends on the batch
it runs in (see shared/reference/cpu-environment.md).
"""

from __future__ import annotations

import collections
import gc
import os

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

from vllm_gsd.testing.engines import (  # noqa: E402
    GSD_KNOBS,
    REDUCED_DRAFT_VOCAB,
    TEST_REASONING,
    TEST_STRUCTURED_OUTPUTS,
    WIDE_GSD,
    default_gsd_config,
    gsd_config,
    make_llm,
)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    from vllm_gsd.quantize_draft import quantize_checkpoint
    from vllm_gsd.testing.tiny_models import tiny_draft, tiny_target

    perturbed_int8 = tmp_path_factory.mktemp("drafts") / "perturbed-int8"
    # Exactness is tested in float32, which vLLM's AMX int8 GEMM (symmetric activations, CPUs
    # with AMX tiles) does not take: with a zero point every CPU runs oneDNN's int8 GEMM.
    quantize_checkpoint(tiny_draft("perturbed"), perturbed_int8, symmetric_activations=False)
    return {"target": str(tiny_target()), "perturbed": str(tiny_draft("perturbed")),
            "same": str(tiny_draft("same")), "short": str(tiny_draft("short")),
            "perturbed_int8": str(perturbed_int8)}


@pytest.fixture(scope="session")
def tokenizer(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models["target"])


class _Engines:
    """Lazily started engines, kept for the session: at most MAX_LIVE at a time (each takes
    about 1.3 GiB in its processes); the least recently used one is shut down to start another,
    and started again if a later test asks for it (its compiled model is in vLLM's cache)."""

    MAX_LIVE = 5

    def __init__(self, models):
        self.models = models
        self._llms: collections.OrderedDict = collections.OrderedDict()

    def get(self, name: str):
        if name in self._llms:
            self._llms.move_to_end(name)
        else:
            while len(self._llms) >= self.MAX_LIVE:
                _, oldest = self._llms.popitem(last=False)
                oldest.llm_engine.engine_core.shutdown()
                gc.collect()
            target = self.models["target"]
            if name == "target":
                # The reasoning markers act only on requests with a thinking_token_budget.
                llm = make_llm(target, reasoning_config=TEST_REASONING, structured_outputs_config=TEST_STRUCTURED_OUTPUTS)
            elif name == "target_defaults":
                from vllm import LLM

                llm = LLM(target)  # vLLM's defaults, as the README's examples run (KV cache: the env's)
            elif name == "gsd":
                from vllm_gsd.testing.worker_probes import WORKER_PROBES

                llm = make_llm(target, gsd_config(self.models["perturbed"]), reasoning_config=TEST_REASONING,
                               structured_outputs_config=TEST_STRUCTURED_OUTPUTS, worker_extension_cls=WORKER_PROBES)
            elif name == "gsd_defaults":
                # What users run: GSD's default knobs, the adaptive budget cutting trees under load.
                llm = make_llm(target, default_gsd_config(self.models["perturbed"]), reasoning_config=TEST_REASONING,
                               structured_outputs_config=TEST_STRUCTURED_OUTPUTS)
            elif name == "gsd_wide":
                llm = make_llm(target, gsd_config(self.models["perturbed"], WIDE_GSD["num_speculative_tokens"],
                                                  **WIDE_GSD["gsd"]))
            elif name == "gsd_int8":
                # As on a real pair: an int8 draft, its int8 head over a reduced vocabulary.
                from vllm_gsd.testing.worker_probes import WORKER_PROBES

                llm = make_llm(target, gsd_config(self.models["perturbed_int8"], draft_vocab=REDUCED_DRAFT_VOCAB),
                               worker_extension_cls=WORKER_PROBES)
            elif name == "gsd_same":
                llm = make_llm(target, gsd_config(self.models["same"]))
            elif name == "gsd_no_prefix_cache":
                llm = make_llm(target, gsd_config(self.models["perturbed"]), enable_prefix_caching=False)
            elif name == "gsd_short_draft":
                llm = make_llm(target, gsd_config(self.models["short"]))
            elif name == "gsd_eager":
                # The one eager engine: vLLM's enforce_eager mode stays covered too.
                llm = make_llm(target, gsd_config(self.models["perturbed"]), enforce_eager=True)
            elif name == "gsd_tp2":
                # Two CPU workers need one core each (shared/reference/cpu-environment.md).
                previous = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
                try:
                    # GSD's default knobs (CPU-like cost curves): the free-tree twin at tp 2 is
                    # test_gsd_tp's rank-skew engine.
                    from vllm_gsd.testing.worker_probes import WORKER_PROBES

                    llm = make_llm(target, default_gsd_config(self.models["perturbed"]), tensor_parallel_size=2,
                                   worker_extension_cls=WORKER_PROBES)
                finally:
                    if previous is None:
                        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND")
                    else:
                        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = previous
            elif name == "draft_model":
                llm = make_llm(target, {"method": "draft_model", "model": self.models["perturbed"],
                                        "num_speculative_tokens": GSD_KNOBS["max_depth"]})
            else:
                raise KeyError(name)
            self._llms[name] = llm
        return self._llms[name]

    def close(self):
        for llm in self._llms.values():
            llm.llm_engine.engine_core.shutdown()
        self._llms.clear()
        gc.collect()


@pytest.fixture(scope="session")
def engines(tiny_models):
    pool = _Engines(tiny_models)
    yield pool
    pool.close()
