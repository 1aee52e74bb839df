"""Worker-side probes for engine tests, mixed into vLLM's workers by `worker_extension_cls`.

Tests need to look inside the worker processes (multiprocessing or Ray actors) and, for the
tensor-parallel agreement check, to make one rank misbehave. vLLM's own worker-extension
mechanism does that without patching anything: the engine that names this class gets its
methods on every worker, callable through `LLM.collective_rpc`; no other engine is affected::

    llm = LLM(..., worker_extension_cls=WORKER_PROBES)
    llm.collective_rpc("gsd_test_worker_info")        # one dict per worker
    llm.collective_rpc("gsd_test_skew_trees", args=(1,))  # TP rank 1 now proposes other trees
"""

from __future__ import annotations

import os

WORKER_PROBES = "vllm_gsd.testing.worker_probes.WorkerProbes"
# GsdStats fields that count trees and nodes: equal on every tensor-parallel rank when the ranks
# build the same trees (the timing fields differ per rank).
TREE_COUNTS = ("trees_verified", "nodes_verified", "accepted_nodes", "graph_nodes_drafted", "merges")
# What `WorkerProbes.gsd_test_fail_draft` raises.
INJECTED_DRAFT_FAILURE = "gsd test: injected draft out-of-memory"


def tree_counts_per_rank(llm) -> list[dict[str, int]]:
    """TREE_COUNTS of every worker of an offline `vllm.LLM`, in worker order."""
    return [{f: stats[f] for f in TREE_COUNTS} for stats in llm.collective_rpc("gsd_stats")]


def shift_first_tokens(draft_token_ids, num_nodes, vocab_size: int) -> None:
    """In place: the first node token of every non-empty tree, plus one (mod vocab_size).

    draft_token_ids int64 [B, N] (-1 padded), num_nodes int64 [B]."""
    has_nodes = num_nodes > 0
    first = draft_token_ids[:, 0]
    first[has_nodes] = (first[has_nodes] + 1) % vocab_size


def _ray_actor_id() -> str | None:
    """The Ray actor this process runs, or None outside Ray."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_actor_id()


class WorkerProbes:
    """Methods added to vLLM's worker class (self is the worker)."""

    def gsd_test_exports_metrics(self) -> bool:
        """Whether this worker adds its figures to the vllm:gsd_* counters (one rank does)."""
        return self.model_runner.gsd.metrics.exports

    def gsd_test_worker_info(self) -> dict:
        """Where this worker runs and what it was configured with."""
        from vllm.distributed import get_tp_group
        from vllm.platforms import current_platform

        import vllm_gsd.plugin

        spec = self.vllm_config.speculative_config
        return {
            "pid": os.getpid(),
            "ray_actor_id": _ray_actor_id(),
            "platform": type(current_platform).__qualname__,
            "tp_rank": get_tp_group().rank_in_group,
            "plugin_registered": vllm_gsd.plugin._registered,
            "method": spec.method if spec is not None else None,
            "node_budget": spec.num_speculative_tokens if spec is not None else None,
            "drafter": type(getattr(self.model_runner, "drafter", None)).__name__,
            # engine/draft_head.py: "Int8DraftHead", or "method" (the model's own compute_logits)
            "draft_head": type(getattr(getattr(self.model_runner, "drafter", None), "draft_head", None)).__name__,
            # the token ids it scores before a step's extra ones (None: the whole vocabulary)
            "draft_head_kept": getattr(getattr(getattr(self.model_runner, "drafter", None), "draft_head", None),
                                       "kept", None),
        }

    def gsd_test_skew_trees(self, tp_rank: int) -> bool:
        """From now on, the worker of tensor-parallel rank `tp_rank` shifts the first node token
        of every tree it proposes, as a nondeterministic kernel or another library build on one
        rank would make it differ. Returns whether this worker is that rank."""
        from vllm.distributed import get_tp_group

        if get_tp_group().rank_in_group != tp_rank:
            return False
        drafter = self.model_runner.drafter
        vocab_size = self.model_config.get_vocab_size()  # gsd requires the draft's to equal it
        grow = drafter._grow

        def skewed_grow(*args, **kwargs):
            tree = grow(*args, **kwargs)
            shift_first_tokens(tree.draft_token_ids, tree.num_nodes, vocab_size)
            return tree

        drafter._grow = skewed_grow
        return True

    def gsd_test_fail_draft(self, tp_rank: int) -> bool:
        """From now on, the next draft forward of the worker of tensor-parallel rank `tp_rank`
        raises `INJECTED_DRAFT_FAILURE` (an out-of-memory error, as a rank whose draft runs out
        of memory raises it) before it reaches the draft model's collectives. Returns whether
        this worker is that rank."""
        import torch
        from vllm.distributed import get_tp_group

        if get_tp_group().rank_in_group != tp_rank:
            return False
        drafter = self.model_runner.drafter

        def failing_forward(*args, **kwargs):
            raise torch.OutOfMemoryError(f"{INJECTED_DRAFT_FAILURE} (tensor-parallel rank {tp_rank})")

        drafter._forward = failing_forward
        return True

    def gsd_test_kernel_buckets(self) -> dict:
        """The Triton launch buckets of this worker: which ran in warm-up, which while serving
        (kernels/launch_buckets.py), what the warm-up did and planned (vllm_v0_32/kernel_warmup.py)."""
        from vllm_gsd.vllm_v0_32.kernel_warmup import kernel_report

        return kernel_report(self.model_runner)

    def gsd_test_draft_graph_sizes(self, sizes: list[int] | None) -> None:
        """Dispatch this worker's draft forwards as on CUDA with piecewise graphs captured at
        `sizes`: each forward padded to the next size through the drafter's persistent buffers
        (a CPU has no graphs to replay, so the model runs the padded batch eagerly); None: back
        to no graphs. Records (actual, padded) token counts for gsd_test_draft_graph_forwards."""
        from vllm.config.compilation import CUDAGraphMode

        drafter = self.model_runner.drafter
        dispatcher = drafter.cudagraph_dispatcher
        if sizes is None:
            dispatcher.initialize_cudagraph_keys(CUDAGraphMode.NONE)
            drafter.__dict__.pop("_graph_inputs", None)
            return
        compilation = dispatcher.compilation_config
        compilation.cudagraph_capture_sizes = sorted(sizes)
        compilation.max_cudagraph_capture_size = max(sizes)
        dispatcher.initialize_cudagraph_keys(CUDAGraphMode.PIECEWISE)
        original = type(drafter)._graph_inputs
        drafter.gsd_test_graph_forwards = []

        def recording(token_ids, positions, num_tokens):
            drafter.gsd_test_graph_forwards.append((int(token_ids.shape[0]), int(num_tokens)))
            return original(drafter, token_ids, positions, num_tokens)

        drafter._graph_inputs = recording

    def gsd_test_draft_graph_forwards(self) -> list[tuple[int, int]]:
        """(actual, padded) tokens of each draft forward dispatched to graphs since
        gsd_test_draft_graph_sizes."""
        return list(getattr(self.model_runner.drafter, "gsd_test_graph_forwards", []))

    def gsd_test_slow_draft(self, seconds: float) -> None:
        """From now on, every draft forward of this worker takes `seconds` longer: a draft too
        slow for speculation to pay on any machine."""
        import time

        drafter = self.model_runner.drafter
        forward = drafter._forward

        def slow_forward(*args, **kwargs):
            time.sleep(seconds)
            return forward(*args, **kwargs)

        drafter._forward = slow_forward

    def gsd_test_draft_under_grammars(self, enabled: bool) -> None:
        """Whether this worker's draft chooses children under the requests' grammars
        (vllm_v0_32/draft_grammar.py) for requests it meets from now on."""
        grammars = self.model_runner.drafter.chooser.grammars
        grammars.enabled = enabled
        grammars.forget(list(grammars._grammars))

    def gsd_test_count_tree_scoring(self) -> None:
        """From now on, count the steps this worker scores through GSD's rejection sampler (the
        steps that verify trees; every other step samples as without speculation)."""
        sampler = self.model_runner.rejection_sampler
        forward = sampler.forward
        sampler.gsd_test_calls = 0

        def counted_forward(*args, **kwargs):
            sampler.gsd_test_calls += 1
            return forward(*args, **kwargs)

        sampler.forward = counted_forward

    def gsd_test_tree_scoring_calls(self) -> int:
        return self.model_runner.rejection_sampler.gsd_test_calls

    def gsd_test_count_reorders(self) -> int:
        """From now on, count the steps in which vLLM reordered this worker's batch (decode-shaped
        requests moved before prefill chunks: the attention builders' reorder_batch_threshold);
        returns that threshold."""
        from vllm.v1.worker import gpu_model_runner

        reorder = gpu_model_runner.reorder_batch_to_split_decodes_and_prefills
        runner = self.model_runner
        runner.gsd_test_reorders = 0

        def counted(*args, **kwargs):
            moved = reorder(*args, **kwargs)
            runner.gsd_test_reorders += bool(moved)
            return moved

        gpu_model_runner.reorder_batch_to_split_decodes_and_prefills = counted
        return runner.reorder_batch_threshold

    def gsd_test_reorders(self) -> int:
        return self.model_runner.gsd_test_reorders

    def gsd_test_time_cost_curves(self, sizes: list[int]) -> dict:
        """Time this worker's cost curves again (engine/cost_calibration.py) as on CUDA with
        piecewise graphs captured at `sizes`, for the target and the draft: each timed forward
        padded to the next size by the model's own dispatcher (a CPU has no graphs to replay, so
        the padded batch runs eagerly). Returns the curves and, per model, the (tokens, padded
        tokens, mode) of each dispatch, and the (tokens, padded tokens) the draft's persistent
        buffers got. Writes scratch KV: for an engine that serves nothing afterwards."""
        from vllm.config.compilation import CUDAGraphMode

        from vllm_gsd.engine.cost_calibration import budget_cost_curves

        runner = self.model_runner
        drafter = runner.drafter
        dispatches = {"target": [], "draft": []}
        for name, owner in (("target", runner), ("draft", drafter)):
            dispatcher = owner.cudagraph_dispatcher
            dispatcher.compilation_config.cudagraph_capture_sizes = sorted(sizes)
            dispatcher.compilation_config.max_cudagraph_capture_size = max(sizes)
            dispatcher.initialize_cudagraph_keys(CUDAGraphMode.PIECEWISE)
            dispatch = dispatcher.dispatch

            def recording(num_tokens, *args, _dispatch=dispatch, _seen=dispatches[name], **kwargs):
                mode, descriptor = _dispatch(num_tokens, *args, **kwargs)
                _seen.append((int(num_tokens), int(descriptor.num_tokens), mode.name))
                return mode, descriptor

            dispatcher.dispatch = recording
        graph_inputs = []
        original = type(drafter)._graph_inputs

        def recording_inputs(token_ids, positions, num_tokens):
            graph_inputs.append((int(token_ids.shape[0]), int(num_tokens)))
            return original(drafter, token_ids, positions, num_tokens)

        drafter._graph_inputs = recording_inputs
        try:
            target, draft = budget_cost_curves(runner, drafter, None)
        finally:
            drafter.__dict__.pop("_graph_inputs", None)
            for owner in (runner, drafter):
                owner.cudagraph_dispatcher.__dict__.pop("dispatch", None)
                owner.cudagraph_dispatcher.initialize_cudagraph_keys(CUDAGraphMode.NONE)
        return {"target": list(zip(target.tokens, target.seconds)), "draft": list(zip(draft.tokens, draft.seconds)),
                "dispatches": dispatches, "draft_inputs": graph_inputs}
