"""One draft forward's inputs and attention metadata, built on the CPU from the step's arrays.

A `DraftForward` lists, per request it covers, the tokens to run, their rotary positions, the
KV positions they write and how many KV positions they may read. `forward_inputs` turns it into
the tensors and vLLM's CommonAttentionMetadata on the forward's device (slots from the draft's
block table), its host arrays moved in one pinned, non-blocking copy (engine/staging.py).
`level_forwards` lays out one graph level: the frontier rows of every request, grouped by
request, cut into forwards of at most max_num_tokens rows, with the graph mask (TreeAttention)
where a request's frontier is not a plain chain.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

from vllm_gsd.engine.staging import HostStaging
from vllm_gsd.engine.tree_batch import TreeAttention


@dataclass
class DraftForward:
    """Inputs of one draft forward over a subset of the runner's batch."""

    batch_rows: np.ndarray  # int64 [Bs]: runner batch index of each request in this forward
    token_ids: list[np.ndarray] = field(default_factory=list)  # per request
    positions: list[np.ndarray] = field(default_factory=list)  # rotary positions
    kv_positions: list[np.ndarray] = field(default_factory=list)  # where KV is written
    seq_lens: list[int] = field(default_factory=list)  # KV positions readable


@dataclass(frozen=True)
class ForwardInputs:
    """A DraftForward on the forward's device."""

    num_tokens: int
    token_ids: torch.Tensor  # int32 [T]
    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]
    common: CommonAttentionMetadata
    sample_index: torch.Tensor | None = None  # int64 [S]: the rows whose hidden states are kept


def forward_inputs(fwd: DraftForward, block_table, num_reqs: int, staging: HostStaging,
                   sample_index: np.ndarray | None = None) -> ForwardInputs:
    """fwd's tensors and causal attention metadata, its host arrays moved in one staged copy
    (engine/staging.py); block_table: the draft's (vLLM BlockTable), num_reqs: the runner
    batch's size, sample_index: rows of the forward to keep (moved with the rest)."""
    lengths = np.asarray([len(t) for t in fwd.token_ids], dtype=np.int64)
    num_tokens = int(lengths.sum())
    query_start_loc = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=query_start_loc[1:])
    seq_lens = np.asarray(fwd.seq_lens, dtype=np.int32)
    token_request = np.repeat(np.arange(len(lengths)), lengths)
    arrays = [np.concatenate(fwd.token_ids), np.concatenate(fwd.positions), np.concatenate(fwd.kv_positions),
              fwd.batch_rows, token_request, query_start_loc, seq_lens]
    staged = staging.stage(arrays if sample_index is None else [*arrays, sample_index])
    token_ids, positions, kv_positions, batch_rows, token_request_index, query_start, seq_lens_index = staged[:7]

    block_size = block_table.block_size
    table = block_table.get_device_tensor(num_reqs)[batch_rows]
    slot_mapping = (table[token_request_index, kv_positions // block_size].to(torch.int64) * block_size
                    + kv_positions % block_size)
    common = CommonAttentionMetadata(
        query_start_loc=query_start.to(torch.int32),
        query_start_loc_cpu=torch.from_numpy(query_start_loc),
        seq_lens=seq_lens_index.to(torch.int32),
        num_reqs=len(lengths),
        num_actual_tokens=num_tokens,
        max_query_len=int(lengths.max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=table,
        slot_mapping=slot_mapping,
        causal=True,
        positions=positions,
        seq_lens_cpu_upper_bound=torch.from_numpy(seq_lens),
    )
    return ForwardInputs(num_tokens, token_ids.to(torch.int32), positions, slot_mapping, common,
                         None if sample_index is None else staged[7])


@dataclass(frozen=True)
class LevelForwards:
    """The draft forwards of one graph level, and where their rows sit in the frontier."""

    forwards: list[tuple[DraftForward, TreeAttention | None]]  # None: every request a chain
    order: np.ndarray  # int64 [F]: the frontier index of each row, in the forwards' row order


def level_forwards(frontier, ancestor_words: torch.Tensor, batch_rows: np.ndarray, root_pos: np.ndarray,
                   max_num_tokens: int, device: torch.device) -> LevelForwards:
    """The forwards over the frontier rows of every request (one, unless the rows exceed
    max_num_tokens). Graph row g of a request is written at KV position root_pos + g, rotated at
    root_pos + depth(g), and attends to the context and its primary ancestors (ancestor_words:
    int32 [R, N + 1, W], the builder's draft_ancestor_words); batch_rows, root_pos: int64 [R]."""
    request = frontier.request_index.numpy()
    order = np.argsort(request, kind="stable")  # a forward wants rows grouped by request
    request, node_row = request[order], frontier.node_row.numpy()[order]
    depth, token = frontier.depth.numpy()[order], frontier.token_ids.numpy()[order]
    requests, starts = np.unique(request, return_index=True)
    ends = np.append(starts[1:], len(request))
    forwards = []
    for group in _groups_within(ends - starts, max_num_tokens):
        fwd = DraftForward(batch_rows=batch_rows[requests[group]])
        for b, s, e in zip(requests[group], starts[group], ends[group]):
            base = root_pos[b]
            fwd.token_ids.append(token[s:e])
            fwd.positions.append(base + depth[s:e])
            fwd.kv_positions.append(base + node_row[s:e])
            fwd.seq_lens.append(int(base + node_row[s:e].max() + 1))
        rows = slice(starts[group[0]], ends[group[-1]])
        lengths = ends[group] - starts[group]
        query_start = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        # A graph that is a chain so far (one frontier row, numbered as deep as it is: one
        # row per level before it, all its ancestors) needs no graph mask: the causal one is it.
        chain = (lengths == 1) & (node_row[starts[group]] == depth[starts[group]])
        trees = np.flatnonzero(~chain)
        query_tree_row = node_row[rows].astype(np.int32)
        query_tree_row[query_start[chain]] = -1
        attention = None if trees.size == 0 else TreeAttention.build(
            request_index=trees, query_start=query_start[trees], query_len=lengths[trees],
            tree_base=root_pos[requests[group][trees]],
            ancestor_words=ancestor_words[torch.from_numpy(requests[group][trees])],
            query_tree_row=query_tree_row, device=device)
        forwards.append((fwd, attention))
    return LevelForwards(forwards, order)


def _groups_within(sizes: np.ndarray, cap: int) -> list[np.ndarray]:
    """Consecutive index groups of `sizes` whose sums stay <= cap (each size is <= cap)."""
    groups, first, used = [], 0, 0
    for index, size in enumerate(sizes.tolist()):
        if used + size > cap:
            groups.append(np.arange(first, index))
            first, used = index, 0
        used += size
    groups.append(np.arange(first, len(sizes)))
    return groups
