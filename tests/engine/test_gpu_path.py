"""The CUDA path without a GPU: GSD's TRITON_ATTN backend driven on CPU tensors, its Triton
kernel in the interpreter (TRITON_INTERPRET=1, set by scripts/test.sh), metadata built by vLLM
0.32's own TRITON_ATTN metadata builder, KV in that backend's layout; the CUDA-only refusals;
vLLM's dummy sampler run through the scorer; the compaction's list of live caches.

vLLM's CPU build disables Triton (no GPU driver), so vLLM's own Triton attention kernel cannot
run here: for rows without a tree the test stands in for it with the causal reference and
checks that GSD leaves exactly what vLLM's path wrote.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs the Triton interpreter (scripts/test.sh sets TRITON_INTERPRET=1)")

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 32, 16, 48


@pytest.fixture(scope="module")
def vllm_config(tiny_target_path):
    from vllm.config import ModelConfig, VllmConfig

    return VllmConfig(model_config=ModelConfig(model=str(tiny_target_path), dtype="float32", max_model_len=512))


@pytest.fixture(scope="module")
def builder(vllm_config):
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_gsd.engine.tree_batch import TreeSlot
    from vllm_gsd.vllm_v0_32.attention.triton_backend import GsdTritonAttentionMetadataBuilder

    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                             dtype=torch.float32)
    with set_current_vllm_config(vllm_config):
        made = GsdTritonAttentionMetadataBuilder(spec, ["layer.0"], vllm_config, torch.device("cpu"))
    made.tree_slot = TreeSlot()
    return made


def make_impl(vllm_config, **features):
    from vllm.config import set_current_vllm_config

    from vllm_gsd.vllm_v0_32.attention.triton_backend import GsdTritonAttentionImpl

    args = dict(num_heads=NUM_HEADS, head_size=HEAD_SIZE, scale=HEAD_SIZE ** -0.5, num_kv_heads=NUM_KV_HEADS,
                alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    args.update(features)
    with set_current_vllm_config(vllm_config):
        return GsdTritonAttentionImpl(**args)


def random_tree(rng, num_nodes):
    """parent_row [n] of a breadth-first tree (every parent precedes its child)."""
    return np.array([rng.integers(0, row) for row in range(1, num_nodes + 1)], dtype=np.int64)


def mixed_batch(rng, kinds):
    """Requests of the given kinds: ("prefill", q_len), ("decode", 1), ("tree", n nodes), each
    with a random context; returns what the runner would hand the backend."""
    from vllm_gsd.graph import ancestor_words_from_parents

    query_lens, context_lens, parents = [], [], []
    for kind, size in kinds:
        query_lens.append(size + 1 if kind == "tree" else size)
        context_lens.append(int(rng.integers(0, 90)))
        parents.append(random_tree(rng, size) if kind == "tree" else None)
    seq_lens = np.array(context_lens) + np.array(query_lens)
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)])
    blocks_needed = -(-seq_lens // BLOCK_SIZE)
    block_table = torch.zeros((len(kinds), int(blocks_needed.max())), dtype=torch.int32)
    pool = rng.permutation(NUM_BLOCKS)
    used = 0
    for b, n in enumerate(blocks_needed):
        block_table[b, :n] = torch.from_numpy(pool[used:used + n].astype(np.int32))
        used += n
    tree_rows = [b for b, p in enumerate(parents) if p is not None]
    query_tree_row = np.full(int(query_start_loc[-1]), -1, dtype=np.int32)
    max_nodes = max((len(parents[b]) for b in tree_rows), default=1)
    parent_padded = torch.full((len(tree_rows), max_nodes), -1, dtype=torch.int64)
    for k, b in enumerate(tree_rows):
        n = len(parents[b])
        query_tree_row[query_start_loc[b]: query_start_loc[b] + n + 1] = np.arange(n + 1)
        parent_padded[k, :n] = torch.from_numpy(parents[b])
    words = ancestor_words_from_parents(parent_padded, torch.tensor([len(parents[b]) for b in tree_rows]))
    return SimpleNamespace(
        query_start_loc=query_start_loc, seq_lens=seq_lens, context_lens=np.array(context_lens),
        block_table=block_table, tree_rows=np.array(tree_rows, dtype=np.int64),
        query_tree_row=query_tree_row, ancestor_words=words, num_tokens=int(query_start_loc[-1]))


def common_metadata(batch):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.from_numpy(batch.query_start_loc.astype(np.int32))
    seq_lens = torch.from_numpy(batch.seq_lens.astype(np.int32))
    positions = torch.cat([torch.arange(c, s) for c, s in zip(batch.context_lens, batch.seq_lens)])
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens, num_reqs=len(batch.seq_lens),
        num_actual_tokens=batch.num_tokens, max_query_len=int(np.diff(batch.query_start_loc).max()),
        max_seq_len=int(batch.seq_lens.max()), block_table_tensor=batch.block_table,
        slot_mapping=torch.zeros(batch.num_tokens, dtype=torch.int64), causal=True, positions=positions,
        seq_lens_cpu_upper_bound=seq_lens)


def tree_attention(batch):
    from vllm_gsd.engine.tree_batch import TreeAttention

    index = batch.tree_rows
    starts = batch.query_start_loc[index]
    lengths = batch.query_start_loc[index + 1] - starts
    return TreeAttention.build(index, starts, lengths, batch.context_lens[index], batch.ancestor_words,
                               batch.query_tree_row, torch.device("cpu"))


def triton_kv_cache(rng):
    """One layer's cache as TRITON_ATTN receives it: logical [blocks, Hkv, block, 2 * D]."""
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    return torch.randn((NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE), generator=gen)


def reference(query, kv_cache, batch, tree_rows_visible: bool):
    """graph_attention_ref over the whole batch: tree rows under the graph mask (or all causal)."""
    from vllm_gsd.kernels.graph_attention import graph_attention_ref

    key_cache, value_cache = kv_cache.transpose(1, 2).split(HEAD_SIZE, dim=-1)
    num_reqs = len(batch.seq_lens)
    tree_base = torch.zeros(num_reqs, dtype=torch.int32)
    words = torch.zeros((num_reqs, *batch.ancestor_words.shape[1:]), dtype=torch.int32)
    query_tree_row = torch.from_numpy(batch.query_tree_row)
    if tree_rows_visible and len(batch.tree_rows):
        tree_base[batch.tree_rows] = torch.from_numpy(batch.context_lens[batch.tree_rows].astype(np.int32))
        words[batch.tree_rows] = batch.ancestor_words
    else:
        query_tree_row = torch.full_like(query_tree_row, -1)
    return graph_attention_ref(
        query, key_cache, value_cache, batch.block_table, torch.from_numpy(batch.query_start_loc.astype(np.int32)),
        torch.from_numpy(batch.seq_lens.astype(np.int32)), tree_base, query_tree_row, words, HEAD_SIZE ** -0.5,
        layout="gpu")


@pytest.fixture
def vllm_kernel_stand_in(monkeypatch):
    """vLLM's TritonAttentionImpl.forward, which cannot run on CPU: the causal reference over
    the rows and the metadata it is given."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    from vllm_gsd.kernels.graph_attention import graph_attention_ref

    calls = []

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args):
        calls.append(attn_metadata)
        num_tokens, num_reqs = attn_metadata.num_actual_tokens, attn_metadata.seq_lens.shape[0]
        key_cache, value_cache = kv_cache.transpose(1, 2).split(HEAD_SIZE, dim=-1)
        causal = graph_attention_ref(
            query[:num_tokens], key_cache, value_cache, attn_metadata.block_table, attn_metadata.query_start_loc,
            attn_metadata.seq_lens, torch.zeros(num_reqs, dtype=torch.int32),
            torch.full((num_tokens,), -1, dtype=torch.int32), torch.zeros((num_reqs, 1, 1), dtype=torch.int32),
            HEAD_SIZE ** -0.5, layout="gpu")
        output[:num_tokens] = causal.reshape(output[:num_tokens].shape)
        return output

    monkeypatch.setattr(TritonAttentionImpl, "forward", forward)
    return calls


KINDS = {
    # decode-shaped (no query longer than the longest tree's): the graph kernel attends every row
    "decodes": [("decode", 1), ("tree", 5), ("decode", 1), ("tree", 23), ("prefill", 3), ("tree", 1)],
    "trees only": [("tree", 9), ("tree", 33), ("tree", 2)],
    # prefill chunks after the decode-shaped requests, as vLLM orders the batch for this builder
    # (reorder_batch_threshold): the graph kernel for the leading rows, vLLM's for the chunks
    "mixed": [("tree", 5), ("decode", 1), ("tree", 23), ("tree", 1), ("prefill", 37), ("prefill", 2)],
    # a prefill chunk among the trees (a batch vLLM did not order): the graph kernel for every
    # row up to the last tree, the chunk's causal rows included
    "unordered": [("prefill", 37), ("tree", 5), ("decode", 1), ("tree", 23), ("prefill", 1), ("tree", 1)],
    "no trees": [("decode", 1), ("prefill", 11)],
}
PLAN_KIND = {"decodes": "decode step", "trees only": "draft level", "mixed": "split", "unordered": "decode step",
             "no trees": None}


@pytest.mark.parametrize("kinds", list(KINDS), ids=list(KINDS))
def test_tree_rows_get_the_graph_mask_and_other_rows_stay_vllms(kinds, builder, vllm_config, vllm_kernel_stand_in):
    """Tree rows get the graph mask; rows without a tree are causal: vLLM's exactly where its
    kernel attends them (the prefill chunks after the decode-shaped requests), the graph
    kernel's (close) among the trees."""
    rng = np.random.default_rng(len(kinds))
    batch = mixed_batch(rng, KINDS[kinds])
    tree = tree_attention(batch) if len(batch.tree_rows) else None
    with builder.tree_slot.holding(tree):
        metadata = builder.build(0, common_metadata(batch))
    assert (metadata.tree and metadata.tree.kind) == PLAN_KIND[kinds]
    kv_cache = triton_kv_cache(rng)
    query = torch.randn(batch.num_tokens, NUM_HEADS, HEAD_SIZE)
    impl = make_impl(vllm_config)
    output = torch.full((batch.num_tokens, NUM_HEADS * HEAD_SIZE), float("nan"))
    for _layer in range(2):  # layers share the forward's plan
        impl.forward(None, query, None, None, kv_cache, metadata, output)
    graph = reference(query, kv_cache, batch, tree_rows_visible=True).reshape(output.shape)
    causal = reference(query, kv_cache, batch, tree_rows_visible=False).reshape(output.shape)
    is_tree = torch.from_numpy(batch.query_tree_row >= 0)
    torch.testing.assert_close(output[is_tree], graph[is_tree], rtol=1e-4, atol=1e-4)
    # vLLM's rows: all of a batch without trees, the rest's in a split, none otherwise.
    plan = metadata.tree
    first_vllm_row = 0 if plan is None else plan.rest[0] if plan.rest is not None else batch.num_tokens
    vllm_rows = torch.arange(batch.num_tokens) >= first_vllm_row
    assert torch.equal(output[vllm_rows], causal[vllm_rows])  # exactly what vLLM's path wrote
    graph_causal = ~is_tree & ~vllm_rows  # the graph kernel's causal rows (float32: to rounding)
    torch.testing.assert_close(output[graph_causal], causal[graph_causal], rtol=1e-4, atol=1e-4)
    assert len(vllm_kernel_stand_in) == (2 if vllm_rows.any() else 0)
    if kinds == "mixed":  # the prefill chunks only, and every one of them
        assert batch.num_tokens - first_vllm_row == 37 + 2 and not is_tree[vllm_rows].any()


def test_the_builder_has_vllm_order_decodes_first(builder):
    """vLLM reorders a batch for a builder that asks (reorder_batch_threshold): requests of at
    most 1 + num_speculative_tokens tokens, every tree, before the prefill chunks."""
    assert builder.reorder_batch_threshold == builder.decode_query_len


def test_a_decode_step_is_judged_by_vllms_decode_length(builder, monkeypatch):
    """A request after the last tree is decode-shaped, and goes with the trees to the graph
    kernel, when no longer than 1 + num_speculative_tokens (vLLM's decode) or than the longest
    tree query; a longer one is a prefill chunk, vLLM's kernel's."""
    rng = np.random.default_rng(4)
    batch = mixed_batch(rng, [("tree", 5), ("prefill", 12)])
    kinds = []
    for spec_tokens in (None, 11):
        monkeypatch.setattr(type(builder), "decode_query_len", property(lambda self, n=spec_tokens: 1 + (n or 0)))
        with builder.tree_slot.holding(tree_attention(batch)):
            kinds.append(builder.build(0, common_metadata(batch)).tree.kind)
    assert kinds == ["split", "decode step"]


def test_the_plan_is_on_the_forwards_device_and_built_once(builder):
    rng = np.random.default_rng(3)
    batch = mixed_batch(rng, KINDS["mixed"])
    planned = []
    original = type(builder).plan_tree

    def counting(self, metadata, tree, common):
        planned.append(tree)
        return original(self, metadata, tree, common)

    type(builder).plan_tree = counting
    try:
        with builder.tree_slot.holding(tree_attention(batch)):
            metadata = builder.build(0, common_metadata(batch))
        again = builder.build(0, common_metadata(batch))  # the slot is empty again
    finally:
        type(builder).plan_tree = original
    assert len(planned) == 1 and again.tree is None
    plan = metadata.tree
    first, rest = plan.rest
    assert plan.launch.query_tree_row.device == metadata.seq_lens.device
    assert plan.launch.query_tree_row.tolist() == batch.query_tree_row[:first].tolist()
    # The rest's metadata: its requests alone, their rows numbered from 0.
    assert rest.query_start_loc.tolist() == (batch.query_start_loc[4:] - first).tolist()
    assert rest.seq_lens.tolist() == batch.seq_lens[4:].tolist()
    assert rest.num_actual_tokens == batch.num_tokens - first and rest.max_query_len == 37


@pytest.mark.parametrize("feature, value, named", [
    ("sliding_window", 64, "sliding-window"),
    ("alibi_slopes", [0.5, 0.25, 0.125, 0.0625], "ALiBi"),
    ("logits_soft_cap", 30.0, "soft-capping"),
    ("sinks", torch.zeros(NUM_HEADS), "sinks"),
    ("kv_cache_dtype", "fp8", "quantized KV cache"),
    ("chunk_lookback", 128, "chunked local attention"),
])
def test_attention_features_the_mask_lacks_are_refused(vllm_config, feature, value, named):
    with pytest.raises(NotImplementedError, match=named):
        make_impl(vllm_config, **{feature: value})


def test_encoder_layers_are_not_refused_for_their_window(vllm_config):
    from vllm.v1.attention.backend import AttentionType

    make_impl(vllm_config, sliding_window=64, attn_type=AttentionType.ENCODER_ONLY)


def test_only_full_graphs_for_mixed_batches_are_refused():
    """Tree steps are mixed batches: FULL (every batch from full graphs) is refused; the modes
    that replay mixed batches piecewise or eagerly are kept, and unset stays vLLM's to choose."""
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CUDAGraphMode

    from vllm_gsd.vllm_v0_32.cuda_graphs import refuse_full_graphs_for_trees

    with pytest.raises(ValueError, match="cudagraph_mode=FULL is not supported"):
        refuse_full_graphs_for_trees(CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL))
    for mode in ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "PIECEWISE", "NONE"):
        compilation = CompilationConfig(cudagraph_mode=CUDAGraphMode[mode])
        refuse_full_graphs_for_trees(compilation)
        assert compilation.cudagraph_mode == CUDAGraphMode[mode]
    unset = SimpleNamespace(cudagraph_mode=None)
    refuse_full_graphs_for_trees(unset)
    assert unset.cudagraph_mode is None


def _post_init_config(mode="FULL_AND_PIECEWISE", fuse_attn_quant=False, enable_dbo=False, ubatch_size=1):
    from vllm.config.compilation import CUDAGraphMode

    return SimpleNamespace(
        compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode[mode],
                                           pass_config=SimpleNamespace(fuse_attn_quant=fuse_attn_quant)),
        parallel_config=SimpleNamespace(use_ubatching=enable_dbo or ubatch_size > 1))


@pytest.mark.parametrize("config, env, named", [
    ({"mode": "FULL", "fuse_attn_quant": True}, {}, "fuse_attn_quant turns PIECEWISE into FULL"),
    ({"enable_dbo": True}, {}, "dual-batch overlap"),
    ({"ubatch_size": 2}, {}, "micro-batching"),
    ({}, {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}, "breakable CUDA graphs"),
])
def test_settings_vllms_post_init_brings_are_refused_by_name(monkeypatch, config, env, named):
    """Checked again after vLLM's post-init, which can turn PIECEWISE into FULL itself."""
    from vllm import envs

    from vllm_gsd.vllm_v0_32.cuda_graphs import refuse_after_post_init

    refuse_after_post_init(_post_init_config())  # vLLM's default on CUDA passes
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()
    with pytest.raises(ValueError, match=named):
        refuse_after_post_init(_post_init_config(**config))


def test_plain_steps_replay_full_graphs_and_tree_steps_piecewise(vllm_config):
    """vLLM's own dispatcher and uniform-decode test, as a gsd runner sets them up under vLLM's
    default FULL_AND_PIECEWISE: a decode of one token per request (GSD's plain step) gets a FULL
    graph; a tree step (some request scheduling 1 + n tokens), even one where every request has
    the same n, gets PIECEWISE, so its attention runs with the graph mask. Without the set-up, the
    equal-n tree step would replay a FULL graph captured with the causal kernel. (The capture and
    replay themselves need a GPU.)"""
    import copy

    from vllm.config.compilation import CompilationMode, CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_gsd.vllm_v0_32.cuda_graphs import decode_graphs_for_plain_steps

    config = copy.deepcopy(vllm_config)
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    config.compilation_config.cudagraph_capture_sizes = [1, 2, 4, 8, 16, 32, 64]
    config.compilation_config.max_cudagraph_capture_size = 64
    # As on CUDA: vLLM's compilation, attention a splitting op run between the piecewise graphs.
    config.compilation_config.mode = CompilationMode.VLLM_COMPILE
    config.compilation_config.splitting_ops = list(config.compilation_config._attention_ops)
    num_nodes = 7  # a gsd engine's num_speculative_tokens: vLLM's uniform decode is 1 + 7 tokens

    def dispatch(runner, query_lens):
        uniform = GPUModelRunner._is_uniform_decode(max(query_lens), runner.uniform_decode_query_len,
                                                    sum(query_lens), len(query_lens))
        return runner.cudagraph_dispatcher.dispatch(sum(query_lens), uniform_decode=uniform)[0]

    runners = {}
    for name, set_up in (("vllm", lambda runner: None), ("gsd", decode_graphs_for_plain_steps)):
        runner = SimpleNamespace(uniform_decode_query_len=1 + num_nodes, cudagraph_dispatcher=CudagraphDispatcher(config))
        runner.cudagraph_dispatcher.uniform_decode_query_len = 1 + num_nodes
        set_up(runner)
        runner.cudagraph_dispatcher.initialize_cudagraph_keys(CUDAGraphMode.FULL_AND_PIECEWISE,
                                                              runner.uniform_decode_query_len)
        runners[name] = runner
    plain_step, equal_trees, mixed_trees = [1] * 4, [1 + num_nodes] * 4, [1, 1 + num_nodes, 3, 1]
    assert dispatch(runners["gsd"], plain_step) == CUDAGraphMode.FULL
    assert dispatch(runners["gsd"], equal_trees) == CUDAGraphMode.PIECEWISE
    assert dispatch(runners["gsd"], mixed_trees) == CUDAGraphMode.PIECEWISE
    # vLLM's set-up would replay the equal-n tree step from a FULL graph, and the plain step not.
    assert dispatch(runners["vllm"], equal_trees) == CUDAGraphMode.FULL
    assert dispatch(runners["vllm"], plain_step) == CUDAGraphMode.PIECEWISE


def _features_config(**overrides):
    model = SimpleNamespace(uses_mrope=False, logits_processors=None, rswa_window=None)
    config = SimpleNamespace(
        model_config=model, speculative_config=SimpleNamespace(draft_model_config=model),
        cache_config=SimpleNamespace(cache_dtype="auto", kv_offloading_size=None), kv_transfer_config=None,
        parallel_config=SimpleNamespace(decode_context_parallel_size=1))
    for path, value in overrides.items():
        owner, name = path.split(".") if "." in path else (None, path)
        setattr(getattr(config, owner) if owner else config, name, value)
    return config


@pytest.mark.parametrize("overrides, named", [
    ({"model_config": SimpleNamespace(uses_mrope=True, logits_processors=None)}, "target model's M-RoPE"),
    ({"speculative_config": SimpleNamespace(draft_model_config=SimpleNamespace(uses_mrope=True))},
     "draft model's M-RoPE"),
    ({"model_config.logits_processors": ["my_package:MyProcessor"]}, "custom logits processors"),
    ({"cache_config.cache_dtype": "fp8_e4m3"}, "kv_cache_dtype='fp8_e4m3'"),
    ({"kv_transfer_config": object()}, "KV connector"),
    ({"cache_config.kv_offloading_size": 4.0}, "KV offloading"),
    ({"model_config.rswa_window": 512}, "R-SWA"),
    ({"parallel_config.decode_context_parallel_size": 2}, "decode context parallelism"),
])
def test_engine_features_the_tree_path_lacks_are_refused_by_name(overrides, named):
    from vllm_gsd.vllm_v0_32.config_patches import _refuse_unsupported_features

    _refuse_unsupported_features(_features_config())  # the plain config passes
    with pytest.raises(ValueError, match=named):
        _refuse_unsupported_features(_features_config(**overrides))


def test_several_kv_cache_groups_are_refused():
    from vllm_gsd.vllm_v0_32.runner.setup_hooks import _refuse_several_kv_groups

    _refuse_several_kv_groups(SimpleNamespace(kv_cache_groups=[object()]))
    with pytest.raises(NotImplementedError, match="several groups"):
        _refuse_several_kv_groups(SimpleNamespace(kv_cache_groups=[object(), object()]))


def test_vllms_dummy_sampler_run_goes_through_the_scorer():
    """vLLM's _dummy_sampler_run (profile and warm-up): one dummy draft token per request, no
    TreeBatch; mixed sampling then all-greedy, as vLLM calls it."""
    from dataclasses import replace

    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from vllm_gsd.vllm_v0_32.scorer import GsdRejectionSampler, GsdSampler

    num_reqs, vocab = 5, 64
    scorer = GsdRejectionSampler(GsdSampler(logprobs_mode="raw_logprobs"))
    full = lambda v: torch.full((num_reqs,), v)  # noqa: E731
    metadata = SamplingMetadata(
        temperature=full(0.5), all_greedy=False, all_random=False, top_p=full(0.9), top_k=full(vocab - 1),
        generators={}, max_num_logprobs=None, logprob_token_ids=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=full(0.1), presence_penalties=full(0.1), repetition_penalties=full(0.1),
        output_token_ids=[[] for _ in range(num_reqs)], spec_token_ids=[[] for _ in range(num_reqs)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
    dummy = SpecDecodeMetadata.make_dummy([[0]] * num_reqs, torch.device("cpu"))
    logits = torch.randn(2 * num_reqs, vocab)
    for sampling in (metadata, replace(metadata, temperature=None, all_greedy=True)):
        output = scorer(dummy, None, logits, sampling)
        assert output.sampled_token_ids.shape == (num_reqs, 2)
        tokens = output.sampled_token_ids
        assert ((tokens >= 0) & (tokens < vocab) | (tokens == -1)).all() and (tokens[:, 0] >= 0).all()
        assert output.accepted.num_accepted.max() <= 1


def test_compaction_acts_on_the_caches_bound_now():
    """The GPU runner rebuilds its KV caches after profiling: the list compaction uses is taken
    whenever the runner (re)initializes its caches, never cached from the first time."""
    from vllm_gsd.vllm_v0_32.runner.setup_hooks import wrap_initialize_kv_cache
    from vllm_gsd.vllm_v0_32.runner.state import GsdRunnerState

    layers = {"model.layers.0.attn": SimpleNamespace(kv_cache=None),
              "draft_model.layers.0.attn": SimpleNamespace(kv_cache=None)}

    def initialize_kv_cache(runner, kv_cache_config, is_profiling=False):
        for layer in layers.values():
            layer.kv_cache = torch.zeros(4 if is_profiling else 8)

    runner = SimpleNamespace(
        speculative_config=SimpleNamespace(method="gsd"), gsd=GsdRunnerState(), device=torch.device("cuda"),
        model_config=SimpleNamespace(enforce_eager=False),
        drafter=SimpleNamespace(_draft_attn_layer_names={"draft_model.layers.0.attn"},
                                prepare_policy=lambda runner: None),
        compilation_config=SimpleNamespace(static_forward_context=layers))
    wrapped = wrap_initialize_kv_cache(initialize_kv_cache)
    one_group = SimpleNamespace(kv_cache_groups=[object()])
    wrapped(runner, one_group, is_profiling=True)
    wrapped(runner, one_group)
    assert runner.gsd.target_kv_caches == [layers["model.layers.0.attn"].kv_cache]
    assert runner.gsd.target_kv_caches[0].numel() == 8


@pytest.mark.parametrize("device, enforce_eager, timed_at", [
    ("cuda", False, "capture"), ("cuda", True, "kv cache"), ("cpu", False, "kv cache")])
def test_cost_curves_are_timed_after_the_graphs_are_captured(device, enforce_eager, timed_at):
    """The adaptive budget times its forwards where serving's graphs exist: after vLLM's
    capture on CUDA, once the KV cache exists where nothing is captured."""
    from vllm_gsd.vllm_v0_32.runner.setup_hooks import wrap_capture_model, wrap_initialize_kv_cache
    from vllm_gsd.vllm_v0_32.runner.state import GsdRunnerState

    events = []
    runner = SimpleNamespace(
        speculative_config=SimpleNamespace(method="gsd"), gsd=GsdRunnerState(), device=torch.device(device),
        model_config=SimpleNamespace(enforce_eager=enforce_eager),
        drafter=SimpleNamespace(_draft_attn_layer_names=set(), prepare_policy=lambda runner: events.append("timed")),
        compilation_config=SimpleNamespace(static_forward_context={}))
    initialize_kv_cache = wrap_initialize_kv_cache(lambda runner, config, is_profiling=False: events.append("kv"))
    capture_model = wrap_capture_model(lambda runner: events.append("captured"))
    one_group = SimpleNamespace(kv_cache_groups=[object()])
    initialize_kv_cache(runner, one_group, is_profiling=True)
    initialize_kv_cache(runner, one_group)
    if device == "cuda" and not enforce_eager:  # vLLM's worker captures only then
        capture_model(runner)
    expected = {"capture": ["kv", "kv", "captured", "timed"], "kv cache": ["kv", "kv", "timed"]}[timed_at]
    assert events == expected


# ------------------------------------------------------------------ launches per layer (issue 39)


class LaunchCount:
    """What one stretch of code puts on the device, counted on CPU tensors: aten ops (through a
    TorchDispatchMode, the ops a CUDA run dispatches: views, allocations, and the rest, which
    launch a kernel each on a GPU), Triton launches (the interpreter's grid executor, per kernel
    name) and calls of vLLM's kernel (the stand-in). Ops inside a Triton launch or the stand-in
    (the interpreter's own copies, the reference) are not counted."""

    def __init__(self):
        self.views, self.allocations, self.device_ops, self.triton, self.vllm = [], [], [], [], 0

    @property
    def launches(self) -> int:
        """Kernels a GPU would launch: aten ops that are neither views nor allocations, Triton
        launches, vLLM's kernel."""
        return len(self.device_ops) + len(self.triton) + self.vllm

    def summary(self) -> dict:
        return dict(launches=self.launches, device_ops=len(self.device_ops), triton=len(self.triton),
                    vllm=self.vllm, views=len(self.views), allocations=len(self.allocations),
                    ops=sorted(self.device_ops), kernels=sorted(self.triton))


@pytest.fixture
def launch_counter(monkeypatch):
    """counter() -> a context manager yielding a LaunchCount of what runs inside it."""
    import contextlib

    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime import interpreter
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    state = {"count": None, "paused": 0}

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            count = state["count"]
            if count is not None and not state["paused"]:
                name = func.overloadpacket.__name__
                if func.is_view or name in ("view", "_unsafe_view", "alias", "detach"):
                    count.views.append(name)
                elif name.startswith(("empty", "new_empty")):
                    count.allocations.append(name)
                else:
                    count.device_ops.append(name)
            return func(*args, **(kwargs or {}))

    def paused(call, record):
        def wrapped(*args, **kwargs):
            if state["count"] is not None and not state["paused"]:
                record(state["count"], *args)
            state["paused"] += 1
            try:
                return call(*args, **kwargs)
            finally:
                state["paused"] -= 1
        return wrapped

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", paused(
        interpreter.GridExecutor.__call__, lambda count, executor, *a: count.triton.append(executor.fn.__name__)))
    vllm_forward = TritonAttentionImpl.forward  # the stand-in, when the test installed one
    monkeypatch.setattr(TritonAttentionImpl, "forward", paused(
        vllm_forward, lambda count, *a: setattr(count, "vllm", count.vllm + 1)))

    @contextlib.contextmanager
    def counter():
        count = LaunchCount()
        state["count"] = count
        try:
            with Mode():
                yield count
        finally:
            state["count"] = None
    return counter


def _layer_counts(kinds, builder, vllm_config, launch_counter, seed=5):
    """Counts of one layer's forward on a batch of `kinds` (plan built outside the count)."""
    rng = np.random.default_rng(seed)
    batch = mixed_batch(rng, kinds)
    with builder.tree_slot.holding(tree_attention(batch)):
        metadata = builder.build(0, common_metadata(batch))
    kv_cache = triton_kv_cache(rng)
    query = torch.randn(batch.num_tokens, NUM_HEADS, HEAD_SIZE)
    impl = make_impl(vllm_config)
    output = torch.full((batch.num_tokens, NUM_HEADS * HEAD_SIZE), float("nan"))
    impl.forward(None, query, None, None, kv_cache, metadata, output)  # warm (first-call imports)
    with launch_counter() as count:
        impl.forward(None, query, None, None, kv_cache, metadata, output)
    return count, metadata


@pytest.mark.parametrize("kinds, expected", [
    # decode step / draft level: the graph kernel alone (forward + split-K reduce), nothing else
    ("decodes", dict(launches=2, device_ops=0, triton=2, vllm=0, views=2, allocations=0)),
    ("trees only", dict(launches=2, device_ops=0, triton=2, vllm=0, views=2, allocations=0)),
    # prefill chunks after the trees: the graph kernel for the leading rows, vLLM's kernel for
    # the chunks (views of their rows), no gather, no scatter, no copy
    ("mixed", dict(launches=3, device_ops=0, triton=2, vllm=1, views=4, allocations=0)),
], ids=["decodes", "trees only", "mixed"])
def test_launches_per_layer(kinds, expected, builder, vllm_config, vllm_kernel_stand_in, launch_counter):
    """What one attention layer puts on the device on a tree step (docs/results/launches.md),
    counted on CPU tensors: a regression (a second pass over the tree rows, a per-layer copy,
    allocation or planning op) fails here. The batches are long enough for a split KV (2 Triton
    launches: forward + reduce), the most a layer may take."""
    count, metadata = _layer_counts(KINDS[kinds], builder, vllm_config, launch_counter)
    got = {name: value for name, value in count.summary().items() if name in expected}
    assert got == expected, count.summary()
    assert set(count.triton) == {"_graph_attn_fwd_kernel", "_graph_attn_reduce_kernel"}


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_compaction_is_one_launch_over_vllms_layer_caches(vllm_config, launch_counter, layout):
    """KV compaction over the layer caches as vLLM 0.32 allocates them (one backing buffer,
    every layer a view: utils.allocate_kv_cache, layer- or block-outermost) is one Triton launch
    for all layers, equal to the reference, and adds no device op per layer; the layers' offset
    table is built on the first step only."""
    import copy

    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from vllm_gsd.kernels import compact_kv, compact_kv_ref

    num_layers, num_blocks = 7, 12
    config = copy.deepcopy(vllm_config)
    config.cache_config.kv_cache_layout = layout
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                             dtype=torch.bfloat16)
    names = [f"model.layers.{i}.attn" for i in range(num_layers)]
    kv_config = get_kv_cache_config_from_groups(config, [KVCacheGroupSpec(names, spec)],
                                                num_layers * num_blocks * spec.page_size_bytes)
    caches = allocate_kv_cache(kv_config, torch.device("cpu"), KVCacheLayout[layout])
    layers = [caches[name] for name in names]
    assert len({t.untyped_storage().data_ptr() for t in layers}) == 1  # one allocation
    gen = torch.Generator().manual_seed(7)
    for t in layers:
        t.copy_(torch.randn(t.shape, generator=gen))
    block_table = torch.randperm(num_blocks, generator=gen)[:12].view(3, 4).to(torch.int32)  # blocks of their own
    tree_base = torch.tensor([3, 17, 30], dtype=torch.int32)
    accepted_rows = torch.tensor([[0, 2, 5, 9, -1], [0, 1, 3, 4, 11], [0, 4, -1, -1, -1]])
    num_accepted = torch.tensor([3, 4, 1])
    expect = [t.clone() for t in layers]
    compact_kv_ref(expect, block_table, BLOCK_SIZE, tree_base, accepted_rows, num_accepted, layout="gpu_bhnc")
    compact_kv(layers, block_table, BLOCK_SIZE, tree_base, accepted_rows, num_accepted, layout="gpu_bhnc")
    for got, want in zip(layers, expect):
        assert torch.equal(got, want)
    with launch_counter() as count:  # a later step: the plan is kept
        compact_kv(layers, block_table, BLOCK_SIZE, tree_base, accepted_rows, num_accepted, layout="gpu_bhnc")
    assert count.triton == ["_compact_kv_kernel"] and count.device_ops == [] and count.allocations == []
    assert len(count.views) <= 3  # the first layer's key view, not one per layer
