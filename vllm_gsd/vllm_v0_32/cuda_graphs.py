"""Which steps of a gsd engine run in CUDA graphs, and the settings that would break that.

vLLM 0.32's default on CUDA is FULL_AND_PIECEWISE: "uniform decode" batches (every request
scheduling the same `uniform_decode_query_len` tokens) replay one FULL graph, attention
included; every other batch replays PIECEWISE graphs, with attention run eagerly between the
pieces. A verification tree's attention needs the graph mask, built each step on the host, so
tree rows must never be replayed from a FULL graph; GSD's plain steps (one token per request)
should, as they do without speculation: at low batch a 70B step is ~7-10 ms on an H100 and the
FULL graph saves the per-layer launches of attention.

vLLM sets `uniform_decode_query_len = 1 + num_speculative_tokens` (a chain verifies K drafts
per request in every decode step). GSD's N is a node budget, and a tree step schedules 1 + n_b
tokens for request b with n_b varying (down to 0): a batch where every n_b = N would be
dispatched to a FULL graph captured for the causal kernel, and its tree rows would see their
siblings. So a gsd runner declares `uniform_decode_query_len = 1` (`decode_graphs_for_plain_steps`):
FULL graphs are captured for, and dispatched to, batches of one token per request (GSD's plain
steps, the profile's and warm-up's decodes); any step with a tree has a request scheduling more
than one token and goes to PIECEWISE, where attention runs eagerly with the mask.

The draft's forwards replay the draft's own PIECEWISE graphs, as vLLM's draft_model drafter
does: vLLM gives a drafter its graph keys and captures them only for its own methods, so a gsd
runner initializes the drafter's keys from the resolved mode (runner/setup_hooks.py,
`wrap_check_and_update_cudagraph_mode`), its dummy run captures the draft's piecewise graph in
the runner's piecewise capture pass, and every draft forward (catch-up and levels) is padded to
the next captured size through the drafter's persistent buffers (engine/proposer.py `_forward`),
attention, with the level's graph mask, running between the pieces.

What is refused (`refuse_full_graphs_for_trees` before vLLM's config post-init,
`refuse_after_post_init` after it, since the post-init can change the mode):
* cudagraph_mode=FULL (every batch, mixed ones too, from FULL graphs);
* `pass_config.fuse_attn_quant` where vLLM then switches PIECEWISE to FULL;
* breakable CUDA graphs (VLLM_USE_BREAKABLE_CUDAGRAPH): graph breaks vLLM places itself, not
  around the attention GSD must run eagerly;
* dual-batch overlap / micro-batching (`enable_dbo`, `ubatch_size`): a step is split into
  micro-batches, while the tree plan is built for the whole batch.
"""

from __future__ import annotations

from typing import Any


def refuse_full_graphs_for_trees(compilation: Any) -> None:
    """Before vLLM's post-init: a mode that replays mixed batches (tree steps) from FULL graphs
    is refused. Unset stays unset: vLLM then picks its default, FULL_AND_PIECEWISE."""
    mode = compilation.cudagraph_mode
    if mode is not None and _mixed_batches_in_full_graphs(mode):
        raise ValueError(
            f"compilation_config.cudagraph_mode={mode.name} is not supported with speculative "
            "method 'gsd': tree steps must run attention outside captured graphs; use "
            "FULL_AND_PIECEWISE (vLLM's default: plain steps in FULL graphs), PIECEWISE, "
            "FULL_DECODE_ONLY or NONE, or leave cudagraph_mode unset")


def refuse_after_post_init(vllm_config: Any) -> None:
    """After vLLM's post-init, on CUDA: the settings that reach a tree step by another road."""
    from vllm import envs

    compilation = vllm_config.compilation_config
    refusals = []
    mode = compilation.cudagraph_mode
    if mode is not None and _mixed_batches_in_full_graphs(mode):
        why = (" (pass_config.fuse_attn_quant turns PIECEWISE into FULL: attention fused with "
               "quantization cannot run outside the graph)" if compilation.pass_config.fuse_attn_quant else "")
        refusals.append(f"cudagraph_mode={mode.name}{why}")
    if envs.VLLM_USE_BREAKABLE_CUDAGRAPH:
        refusals.append("breakable CUDA graphs (VLLM_USE_BREAKABLE_CUDAGRAPH=1): tree attention must "
                        "run between captured pieces")
    if vllm_config.parallel_config.use_ubatching:
        refusals.append("dual-batch overlap / micro-batching (enable_dbo, ubatch_size): the tree plan "
                        "is built for the whole batch")
    if refusals:
        raise ValueError("speculative method 'gsd' does not support " + "; ".join(refusals))


def decode_graphs_for_plain_steps(runner: Any) -> None:
    """A gsd runner's uniform decode is one token per request (see the module docstring). Set
    right after vLLM's runner __init__, before any capture or dispatch: the dispatcher keeps its
    own copy, and the runner passes its value to the keys it builds."""
    runner.uniform_decode_query_len = 1
    dispatcher = getattr(runner, "cudagraph_dispatcher", None)
    if dispatcher is not None:
        dispatcher.uniform_decode_query_len = 1


def _mixed_batches_in_full_graphs(mode: Any) -> bool:
    from vllm.config.compilation import CUDAGraphMode

    return mode.mixed_mode() == CUDAGraphMode.FULL
