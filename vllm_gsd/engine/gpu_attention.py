"""vLLM's Triton attention backend (TRITON_ATTN) with the graph mask, for CUDA.

In a forward that carries a `TreeMask` (engine/tree_attention.py) the whole batch goes through
`vllm_gsd.kernels.graph_attention` (Triton, split-K), which applies the causal rule to ordinary
rows and the graph mask to tree rows, reading vLLM's paged cache in place; other forwards run
vLLM's own kernel. A gsd engine on CUDA selects this backend for the target and the draft, and
runs attention outside CUDA graphs (piecewise mode), since the mask changes every step
(engine/patches.py).

Status: the kernels are tested against their torch references in the Triton interpreter; this
glue has not run inside vLLM on a GPU (the project's GPU machine has no vLLM).
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl

from vllm_gsd.engine.tree_attention import current_graph_mask
from vllm_gsd.kernels.graph_attention import graph_attention


class GsdTritonAttentionImpl(TritonAttentionImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        mask = current_graph_mask()
        if (mask is None or attn_metadata is None or self.attn_type != AttentionType.DECODER):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("gsd: fused output quantization is not supported")
        num_tokens = attn_metadata.num_actual_tokens
        num_reqs = attn_metadata.seq_lens.shape[0]
        tree_base, ancestor_words = mask.full_batch(num_reqs, query.device)
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        graph_attention(
            query[:num_tokens],
            key_cache,
            value_cache,
            attn_metadata.block_table,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            tree_base,
            mask.query_tree_row[:num_tokens].to(query.device),
            ancestor_words,
            self.scale,
            out=output[:num_tokens].view(num_tokens, self.num_heads, self.head_size),
            layout="gpu",
            max_seq_len=attn_metadata.max_seq_len,
            max_query_len=attn_metadata.max_query_len,
        )
        return output


class GsdTritonAttentionBackend(TritonAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[GsdTritonAttentionImpl]:
        return GsdTritonAttentionImpl
