"""The draft's LM head and each graph row's children.

`draft_children(head, hidden, ...)` returns the top_k children of each row: for greedy requests
the top-k of the draft's softmax, for sampled requests the Gumbel-top-k of the draft's processed
scores under the request's own sampling and the noise of the children's position
(engine/sampling.py), with probabilities under the noisy softmax. A request with options the
target's rows apply (penalties, allowed ids, logit bias, bad words, min_tokens, min_p:
engine/node_processing.py) has its draft logits processed with them first, each row with the
history the target's row after the same path has (the committed output, then the row's
primary path below the root), so its children are tokens the target may pick there; a request
with a grammar the draft follows (a candidate's `grammar`) has its rows masked with the
grammar's state after their path. The LM head and its softmax run
in row chunks (one [chunk, V] float32 copy at a time). A reduced head (engine/draft_head.py)
scores its kept ids and the step's extra ones (`step_vocabulary`): the softmax is over those,
and the other ids are never children.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from vllm_gsd.engine.draft_head import DraftHead, logit_columns, read_children, top_columns, widen
from vllm_gsd.engine.drafter.batch import DraftBatch
from vllm_gsd.engine.drafter.choose import Candidate
from vllm_gsd.engine.node_processing import min_p_of_rows, process_rows
from vllm_gsd.engine.sampling import processed_scores
from vllm_gsd.engine.scorer import rows_per_chunk
from vllm_gsd.engine.staging import HostStaging
from vllm_gsd.graph.gumbel import gumbel_noise, gumbel_top_k


class Vocabulary(NamedTuple):
    """The ids a reduced head scores in one step."""

    extra_ids: torch.Tensor | None  # int64 [E]: ids past the kept ones (None: none)
    columns: torch.Tensor  # int64 [kept + E]: the token id of each logit column


class Children(NamedTuple):
    """Each row's children, CPU, descending by probability."""

    tokens: torch.Tensor  # int64 [R, k]
    probs: torch.Tensor  # float32 [R, k]


def step_vocabulary(head: DraftHead, batch: DraftBatch, candidates: list[Candidate]) -> Vocabulary | None:
    """The reduced head's vocabulary this step: its kept ids, and past them every id in the
    candidates' own tokens (a prompt's names, a chat's turn markers) and their stop tokens.
    None: the head scores the whole vocabulary."""
    if not getattr(head, "reduced", False):
        return None
    token_ids = batch.token_ids
    ids = []
    for c in candidates:
        context = token_ids[c.batch_row, :c.root_pos + 1]
        ids.append(context[context >= head.kept])  # few: filter before sorting them
        params = batch.sampling_params[c.batch_row]
        if params is not None:
            ids.append(np.fromiter(params.all_stop_token_ids, dtype=token_ids.dtype))
            # Ids the request's options single out: the only ones it allows, or a bias favours.
            singled_out = [*(params.allowed_token_ids or ()), *(params.logit_bias or {})]
            ids.append(np.asarray([int(t) for t in singled_out], dtype=token_ids.dtype))
    ids = np.unique(np.concatenate(ids))
    extra_ids = torch.from_numpy(ids[(ids >= head.kept) & (ids < head.vocab_size)].astype(np.int64))
    return Vocabulary(extra_ids, logit_columns(head.kept, extra_ids))


def draft_children(head: DraftHead, hidden: torch.Tensor, top_k: int, vocab_size: int,
                   candidates: list[Candidate] | None = None, request_index: np.ndarray | None = None,
                   depth: np.ndarray | None = None, vocabulary: Vocabulary | None = None,
                   staging: HostStaging | None = None,
                   paths: Callable[[np.ndarray], list[list[int]]] | None = None) -> Children:
    """The children of each row of hidden [R, H]. Row r belongs to candidates[request_index[r]]
    at primary depth depth[r] (candidates None: every row greedy, as in a dummy run); paths(rows)
    gives the given rows' tokens below their root (None: every row is a root). Row indices and
    sampling knobs reach the device through `staging` (engine/staging.py; None: a pageable one)."""
    staging = staging or HostStaging(hidden.device, pin_memory=False)
    if vocabulary is None and getattr(head, "reduced", False):  # dummy runs: the kept ids alone
        vocabulary = Vocabulary(None, logit_columns(head.kept, None))
    extra_ids, columns = vocabulary if vocabulary is not None else (None, None)
    tokens = torch.empty((hidden.shape[0], top_k), dtype=torch.int64)
    probs = torch.empty((hidden.shape[0], top_k), dtype=torch.float32)
    sampled = np.zeros(hidden.shape[0], dtype=bool)
    if candidates is not None:
        sampled = np.asarray([candidates[b].sampling is not None for b in request_index], dtype=bool)
    chunk = rows_per_chunk(vocab_size)
    options = np.zeros(hidden.shape[0], dtype=bool)  # rows processed beyond the draft's softmax
    if candidates is not None:
        options = np.asarray([candidates[b].options is not None or candidates[b].grammar is not None
                              for b in request_index], dtype=bool)
    for lo in range(0, hidden.shape[0], chunk):
        logits = head(hidden[lo:lo + chunk]) if columns is None else head(hidden[lo:lo + chunk], extra_ids)
        rows = np.arange(lo, min(lo + chunk, hidden.shape[0]))
        # Each group's top k stays on the device; the chunk's children are read once.
        groups: list[tuple[np.ndarray, tuple[torch.Tensor, torch.Tensor]]] = []
        greedy = rows[~sampled[rows] & ~options[rows]]
        if greedy.size:
            groups.append((greedy, top_columns(_rows(logits, greedy - lo, staging), top_k)))
        constrained = rows[~sampled[rows] & options[rows]]
        if constrained.size:
            scores = _processed(_rows(logits, constrained - lo, staging), columns, head.vocab_size, candidates,
                                request_index[constrained], _paths_of(paths, constrained), staging)
            groups.append((constrained, top_columns(scores, top_k)))
        drawn = rows[sampled[rows]]
        if drawn.size:
            scores = _processed(_rows(logits, drawn - lo, staging), columns, head.vocab_size, candidates,
                                request_index[drawn], _paths_of(paths, drawn), staging)
            groups.append((drawn, _sampled_children(scores, top_k, candidates, request_index[drawn], depth[drawn],
                                                    staging)))
        order = np.concatenate([group_rows for group_rows, _ in groups])
        chunk_tokens, chunk_probs = read_children(torch.cat([t for _, (t, _) in groups]),
                                                  torch.cat([p for _, (_, p) in groups]))
        if columns is not None and greedy.size:  # the greedy rows' are logit columns: their ids
            chunk_tokens[:greedy.size] = columns[chunk_tokens[:greedy.size]]
        tokens[order], probs[order] = chunk_tokens, chunk_probs
    return Children(tokens, probs)


def _rows(logits: torch.Tensor, index: np.ndarray, staging: HostStaging) -> torch.Tensor:
    """logits[index] (index: sorted host rows): a slice where they are consecutive (all rows of
    a chunk, the common case), else gathered with a staged index."""
    if index[-1] - index[0] + 1 == index.size:
        return logits[int(index[0]):int(index[-1]) + 1]
    return logits[staging.stage([index])[0]]


def _paths_of(paths: Callable[[np.ndarray], list[list[int]]] | None, rows: np.ndarray):
    """The rows' paths below their roots, read when a row's options need them."""
    return (lambda: [[] for _ in rows]) if paths is None else (lambda: paths(rows))


def _processed(logits: torch.Tensor, columns: torch.Tensor | None, vocab_size: int, candidates: list[Candidate],
               request_index: np.ndarray, row_paths: Callable[[], list[list[int]]],
               staging: HostStaging) -> torch.Tensor:
    """float32 [R, vocab_size]: rows of a (reduced) head's logits over the whole vocabulary (the
    noise, the sampling knobs and the options index it), with each request's options applied
    after each row's path (`row_paths()`), then its grammar's mask after that path."""
    scores = widen(logits, columns, vocab_size) if columns is not None else logits
    row_options = [candidates[b].options for b in request_index]
    grammars = {b: candidates[b].grammar for b in np.unique(request_index) if candidates[b].grammar is not None}
    if all(o is None for o in row_options) and not grammars:
        return scores
    paths = row_paths()
    processed = process_rows(scores.to(torch.float32, copy=True), row_options, paths, staging)
    for b, grammar in grammars.items():
        rows = np.flatnonzero(request_index == b)
        (index,) = staging.stage([rows])
        masked = processed[index]
        grammar.mask(masked, [paths[r] for r in rows], staging)
        processed[index] = masked
    # A row its options leave nothing in (say, allowed ids the head does not score) keeps the
    # draft's own scores: its children will not be accepted, but they are well defined.
    empty = torch.isneginf(processed).all(dim=-1, keepdim=True)
    return torch.where(empty, scores.to(torch.float32), processed)


def _sampled_children(logits: torch.Tensor, top_k: int, candidates: list[Candidate], request_index: np.ndarray,
                      depth: np.ndarray, staging: HostStaging) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, probs) on the device: the Gumbel-top-k children of sampled rows."""
    settings = [candidates[b].sampling for b in request_index]
    device, vocab = logits.device, logits.shape[-1]
    row_top_k = np.asarray([s.top_k if s.top_k > 0 else vocab for s in settings], dtype=np.int64)
    row_top_p = np.asarray([s.top_p for s in settings], dtype=np.float64)
    temperature, top_k_rows, top_p_rows = staging.stage(
        [np.asarray([s.temperature for s in settings], dtype=np.float64), row_top_k, row_top_p])
    scores = processed_scores(
        logits, temperature, None if (row_top_k == vocab).all() else top_k_rows,
        None if (row_top_p >= 1.0).all() else top_p_rows.to(torch.float32),
        min_p_of_rows([candidates[b].options for b in request_index], staging))
    # Children of a depth-d row sit at position root_pos + d + 1.
    positions = np.asarray([candidates[b].root_pos for b in request_index]) + depth + 1
    noise = gumbel_noise(np.asarray([s.noise_key for s in settings]), positions, vocab, device)
    return gumbel_top_k(scores, noise, top_k)
