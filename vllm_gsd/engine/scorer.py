"""Tree verification, version-independent: the scoring walk that the vLLM adapter's
rejection sampler (vllm_v0_32/scorer.py, in vLLM's rejection-sampler slot) runs on the step's
logits.

`score_trees` takes, per request, its `n + 1` verification rows of `logits` (root, then the n
tree nodes in breadth-first order) and the target's token at every root row, and returns the
accepted paths (`vllm_gsd.graph.AcceptedPaths`: the accepted path's tokens and then one token of
the target, -1 padded, in vLLM's `sampled_token_ids` layout).

The target's token at a row, and the walk (vllm_gsd.graph.walk_tree: follow the child that
carries the row's token, or emit it and stop):
* row 0 (the root) of every request: given by the caller (vLLM's own Sampler on the root rows of
  the whole batch, so requests without a tree, and their penalties and processors, are sampled
  exactly as without speculation; in a gsd engine that Sampler is the adapter's `GsdSampler`,
  which draws the `KeyedRoots` below with keyed noise);
* rows >= 1 of a greedy request: vLLM's greedy argmax;
* a sampled request with a tree: walked row by row from the root, each visited row's token the
  Gumbel-max draw argmax(processed scores + G(key, position)) of engine/sampling.py, the noise
  the draft chose the row's children with. Every emitted token is the target's own draw given
  its accepted prefix: the output follows the target's distribution exactly, for any tree, and
  a seeded request's text does not depend on the batch.
Vocabulary-sized float copies are made in row chunks of at most MAX_CHUNK_BYTES.

`sampling_metadata` is read for `all_greedy`, `temperature`, `top_k` and `top_p` (vLLM's
SamplingMetadata has them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_gsd.engine.node_processing import RequestOptions, min_p_of_rows, process_rows, row_paths
from vllm_gsd.engine.sampling import SAMPLING_EPS, processed_scores
from vllm_gsd.engine.staging import HostStaging
from vllm_gsd.engine.tree_batch import TreeBatch, chain_trees
from vllm_gsd.graph import AcceptedPaths, walk_tree
from vllm_gsd.graph.gumbel import gumbel_argmax, gumbel_noise


@dataclass
class KeyedRoots:
    """This step's root rows that GsdSampler draws with keyed noise (vllm_v0_32/runner/step_hooks.py)."""

    rows: list[int]  # batch index of each sampled request the tree path serves
    keys: list[int]  # its noise key (engine/sampling.py)
    positions: list[int]  # absolute position of the token each row samples
    min_p: list[float] = field(default_factory=list)  # each row's min_p (vLLM applies it in `sample`)


# The most bytes one float32 copy of vocabulary-sized rows may take in the scorer: rows are
# processed in chunks of at most this size (vLLM's memory profile runs the largest chunk).
MAX_CHUNK_BYTES = 256 << 20


def rows_per_chunk(vocab_size: int) -> int:
    return max(1, MAX_CHUNK_BYTES // (4 * vocab_size))


class PathsOfRows:
    """The options of each request of the step and, for requests that have some, the tokens of
    each tree row's path below the root (engine/node_processing.py), computed once a step."""

    def __init__(self, tree, parent_row: torch.Tensor, draft_token_ids: torch.Tensor):
        self._tree, self._parent_row, self._draft_token_ids = tree, parent_row, draft_token_ids
        self._paths: dict[int, list[list[int]]] = {}

    def options(self, requests: torch.Tensor) -> list[RequestOptions | None]:
        if self._tree is None or not any(o is not None for o in self._tree.options):
            return [None] * requests.numel()
        return [self._tree.options_of(b) for b in requests.tolist()]

    def of(self, requests: torch.Tensor, local_rows: torch.Tensor) -> list[list[int]]:
        return [self._paths_of(b)[row] for b, row in zip(requests.tolist(), local_rows.tolist())]

    def _paths_of(self, b: int) -> list[list[int]]:
        if b not in self._paths:
            n = int((self._parent_row[b] >= 0).sum())
            self._paths[b] = row_paths(self._parent_row[b, :n].tolist(), self._draft_token_ids[b, :n].tolist())
        return self._paths[b]


def score_trees(root_tokens: torch.Tensor, logits: torch.Tensor, num_draft: list[int], row_start: torch.Tensor,
                tree: TreeBatch | None, flat_draft_token_ids: torch.Tensor, sampling_metadata,
                staging: HostStaging | None = None) -> AcceptedPaths:
    """The accepted path of every request of the step.

    root_tokens [B]: the target's token at each request's row 0 (logits row row_start[b]);
    num_draft: each request's node count; flat_draft_token_ids: the step's draft tokens, request
    after request (vLLM's layout), read only where the tree carries no host copy of them
    (`TreeBatch.draft_token_ids`); tree: the step's TreeBatch, or None, where the drafts are
    scored as chains, with fresh noise (vLLM's dummy sampler runs); staging: the caller's
    (engine/staging.py), through which host arrays reach the device (None: a pageable one).
    """
    batch_size = len(num_draft)
    max_nodes = max(num_draft)
    rows_per_request = torch.tensor(num_draft, dtype=torch.int64) + 1
    device = logits.device
    staging = staging or HostStaging(device, pin_memory=False)
    row_target = torch.full((batch_size, max_nodes + 1), -1, dtype=torch.int64, device=device)
    row_target[:, 0] = root_tokens
    if max_nodes > 0:
        if tree is not None:
            parent_row, depth = tree.parent_row[:, :max_nodes], tree.depth[:, :max_nodes]
        else:
            parent_row, depth = chain_trees(num_draft)
        valid = torch.arange(max_nodes)[None, :] < rows_per_request[:, None] - 1
        if tree is not None and tree.draft_token_ids is not None:  # the host's copy: no read
            draft_token_ids = torch.where(valid, tree.draft_token_ids[:, :max_nodes], -1)
        else:
            draft_token_ids = torch.full((batch_size, max_nodes), -1, dtype=torch.int64)
            draft_token_ids[valid] = flat_draft_token_ids.cpu().to(torch.int64)
        fill_node_rows(row_target, logits, num_draft, row_start, parent_row, depth, draft_token_ids,
                       tree, sampling_metadata, staging)
        drafts, parents, counts = staging.stage([draft_token_ids.numpy(), parent_row.numpy(), np.asarray(num_draft)])
        accepted = walk_tree(drafts.view(batch_size, max_nodes), parents.view(batch_size, max_nodes), counts,
                             row_target, max_depth=int(depth.max()))
    else:  # no request has nodes: each emits its root token (the runner samples such steps plainly)
        accepted = AcceptedPaths(torch.zeros_like(row_target), row_target,
                                 torch.zeros(batch_size, dtype=torch.int64, device=device))
    return accepted


def fill_node_rows(row_target, logits, num_draft, row_start, parent_row, depth, draft_token_ids,
                   tree, sampling_metadata, staging: HostStaging):
    """The target's token at the rows each request's walk needs.

    Greedy requests: vLLM's greedy argmax at rows 1..n (the walk reads any of them). Sampled
    requests with a tree: `walk_sampled` draws the rows on their walk (row 0 included).
    """
    device = logits.device
    counts = torch.tensor(num_draft, dtype=torch.int64)
    if sampling_metadata.all_greedy:
        sampled = torch.zeros(len(num_draft), dtype=torch.bool)
    elif tree is not None and len(tree.noise_key) == len(num_draft):
        # The host knows: a request with nodes has a noise key iff it samples (temperature >=
        # SAMPLING_EPS, engine/sampling.is_sampled); requests without nodes are not looked at.
        sampled = torch.tensor([key is not None for key in tree.noise_key], dtype=torch.bool)
    else:
        sampled = sampling_metadata.temperature.cpu() >= SAMPLING_EPS
    request_of_row = torch.repeat_interleave(torch.arange(len(num_draft)), counts + 1)
    local_row = torch.arange(logits.shape[0]) - row_start[request_of_row]
    greedy_rows = torch.nonzero((counts > 0)[request_of_row] & ~sampled[request_of_row]
                                & (local_row > 0)).squeeze(1)
    chunk = rows_per_chunk(logits.shape[-1])
    paths = PathsOfRows(tree, parent_row, draft_token_ids)
    for lo in range(0, greedy_rows.numel(), chunk):
        rows = greedy_rows[lo:lo + chunk]
        requests, local = request_of_row[rows], local_row[rows]
        rows_on_device, requests_on_device, local_on_device = staging.stage(
            [rows.numpy(), requests.numpy(), local.numpy()])
        row_logits = logits[rows_on_device]  # vLLM's greedy pick, no fp32 copy without options
        options = paths.options(requests)
        if any(o is not None for o in options):
            row_logits = process_rows(row_logits.to(torch.float32), options, paths.of(requests, local), staging)
        row_target[requests_on_device, local_on_device] = row_logits.argmax(dim=-1)
    walkers = torch.nonzero((counts > 0) & sampled).squeeze(1)
    if walkers.numel():
        walk_sampled(row_target, logits, walkers, row_start, parent_row, depth, draft_token_ids,
                     tree, sampling_metadata, paths, staging)


# Device types whose tensors the host reads without waiting for a stream (the CPU): there the
# sampled walk visits only the walks still going and ends with the last one. On any other device
# it runs a fixed number of levels over every walk, masked, and never reads. The host-read
# counter (testing/host_reads.py) empties this to count a GPU's branch on the CPU.
HOST_DEVICE_TYPES = ("cpu",)


def walk_sampled(row_target, logits, walkers, row_start, parent_row, depth, draft_token_ids, tree,
                 sampling_metadata, paths: PathsOfRows, staging: HostStaging) -> None:
    """Walk the trees of sampled requests, one level per iteration (batched over requests):
    draw the current row's token with its position's noise, move to the lowest-row child that
    carries it (walk_tree's rule), or stop there.

    A walk at level d is at a depth-d row (a child is one deeper than its parent), whose noise
    key is (request key, tree_base + d + 1): the host knows every level's noise without knowing
    which row a walk is at. So on a device the walk runs the trees' depth + 1 levels, stopped
    walks masked, with no read. Requests with options (penalties, bad words: each row processed
    with its own path, engine/node_processing.py) have every depth-d row processed at level d
    (`LevelRows`), which the walk then picks its row from: no read either. On the CPU, where
    reading is free, only the rows walked are processed.
    """
    device = logits.device
    vocab = logits.shape[-1]
    visit_only_active = device.type in HOST_DEVICE_TYPES
    num_walkers = walkers.numel()
    # A request without keys (vLLM's dummy runs) draws fresh noise.
    keys = (np.asarray([tree.noise_key[b] for b in walkers.tolist()], dtype=np.int64) if tree is not None
            else np.random.randint(0, 2**62, num_walkers))
    tree_base = (tree.tree_base[walkers.numpy()] if tree is not None else np.zeros(num_walkers, np.int64))
    options = paths.options(walkers)
    any_options = any(o is not None for o in options)
    # Each walk's nodes (parent row, or -2 past its nodes: never matched) and their tokens, and
    # the first row of each walk's logits: one staged copy.
    is_node = torch.arange(1, parent_row.shape[1] + 1) <= (parent_row[walkers] >= 0).sum(1, keepdim=True)
    requests, node_parent, node_token, first_row = staging.stage(
        [walkers.numpy(), torch.where(is_node, parent_row[walkers], -2).numpy(), draft_token_ids[walkers].numpy(),
         row_start[walkers].numpy()])
    node_parent, node_token = node_parent.view(num_walkers, -1), node_token.view(num_walkers, -1)
    temperature = sampling_metadata.temperature[requests]
    top_k = None if sampling_metadata.top_k is None else sampling_metadata.top_k[requests]
    top_p = None if sampling_metadata.top_p is None else sampling_metadata.top_p[requests]
    min_p = min_p_of_rows(options, staging)
    level_rows = None
    if any_options and not visit_only_active:
        level_rows = LevelRows(logits, walkers, row_start, depth[walkers], is_node, options, paths, staging)
    current = torch.zeros(num_walkers, dtype=torch.int64, device=device)  # row of each walk
    active = torch.ones(num_walkers, dtype=torch.bool, device=device)
    for level in range(int(depth[walkers].max()) + 1):
        if visit_only_active:
            sel = torch.nonzero(active).squeeze(1)  # a host tensor: no wait
            if sel.numel() == 0:
                break
            host_sel = sel.numpy()
        else:
            sel = host_sel = slice(None)
        rows = current[sel]
        row_logits = logits[first_row[sel] + rows]
        if level_rows is not None:
            row_logits = level_rows.processed(level, row_logits, rows)
        elif any_options:  # on the CPU: the rows walked, their paths read
            row_logits = process_rows(row_logits.to(torch.float32), [options[i] for i in host_sel],
                                      paths.of(walkers[sel], rows), staging)
        scores = processed_scores(row_logits, temperature[sel], None if top_k is None else top_k[sel],
                                  None if top_p is None else top_p[sel], None if min_p is None else min_p[sel])
        noise = gumbel_noise(keys[host_sel], tree_base[host_sel] + level + 1, vocab, device)
        tokens = gumbel_argmax(scores, noise)
        still = active[sel]
        row_target[requests[sel], rows] = torch.where(still, tokens, row_target[requests[sel], rows])
        is_child = (node_parent[sel] == rows[:, None]) & (node_token[sel] == tokens[:, None])
        found = still & is_child.any(1)
        current[sel] = torch.where(found, is_child.int().argmax(1) + 1, rows)
        active[sel] = found


class LevelRows:
    """The rows of walks with options, processed a level at a time without reading where a walk
    is: at level d a walk is at one of its depth-d rows, so all of them are processed (each with
    its path, as the greedy rows are) and each walk takes its own by a device-side lookup.
    Processed in chunks of at most `rows_per_chunk` rows, the float32 copies bounded as
    fill_node_rows's are."""

    def __init__(self, logits, walkers, row_start, walker_depth, is_node, options, paths: PathsOfRows,
                 staging: HostStaging):
        self._logits, self._staging = logits, staging
        self._options = options
        self._with_options = np.asarray([o is not None for o in options])
        self._walkers, self._row_start = walkers, row_start
        self._depth = torch.where(is_node, walker_depth, -1)  # [W, max_nodes], host
        self._paths = paths
        self._chunk = rows_per_chunk(logits.shape[-1])

    def processed(self, level: int, row_logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """float32 [W, V]: row_logits (each walk's current row, `rows` its local index) with the
        rows of walks with options replaced by their processed copies."""
        walk, local = self._level_rows(level)
        out = row_logits.to(torch.float32)
        if walk.size == 0:
            return out
        num_walkers, width = self._depth.shape[0], self._depth.shape[1] + 1
        for lo in range(0, walk.size, self._chunk):
            chunk_walk, chunk_local = walk[lo:lo + self._chunk], local[lo:lo + self._chunk]
            # slot[w, r]: the chunk's index of walk w's row r, or -1.
            slot = np.full((num_walkers, width), -1, dtype=np.int64)
            slot[chunk_walk, chunk_local] = np.arange(chunk_walk.size)
            requests = self._walkers[torch.from_numpy(chunk_walk)]
            logit_rows, slot_on_device = self._staging.stage(
                [self._row_start[requests].numpy() + chunk_local, slot])
            processed = process_rows(self._logits[logit_rows].to(torch.float32),
                                     [self._options[w] for w in chunk_walk],
                                     self._paths.of(requests, torch.from_numpy(chunk_local)), self._staging)
            index = slot_on_device.view(num_walkers, width).gather(1, rows[:, None]).squeeze(1)
            out = torch.where((index >= 0)[:, None], processed[index.clamp(min=0)], out)
        return out

    def _level_rows(self, level: int) -> tuple[np.ndarray, np.ndarray]:
        """(walk, local row) of every depth-`level` row of walks with options (level 0: roots)."""
        if level == 0:
            walk = np.flatnonzero(self._with_options)
            return walk, np.zeros_like(walk)
        walk, node = np.nonzero((self._depth == level).numpy() & self._with_options[:, None])
        return walk, node + 1
