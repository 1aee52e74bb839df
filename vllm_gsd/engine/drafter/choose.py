"""The requests that grow a tree this step, and where each one's draft KV is valid.

`CandidateChooser.choose(batch, scheduler_output, valid_sampled_token_ids)` returns the requests
that grow a tree (eligible by engine/eligibility.py, not finishing, with room for the tree before
the target's and the draft's context limits and inside the blocks the scheduler allocated) and
how many other requests decode this step. Per request it keeps where the draft's KV is valid
(engine/draft_kv.py): a new or resumed request counts only the prefix-cache blocks the draft
itself wrote; `advance` moves it to the roots once the draft has caught up. A candidate carries
what its children are chosen under: its sampling, its options and, where the chooser is given
the draft's grammars (`grammars`, the vLLM adapter's), its grammar.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from vllm_gsd.engine import LOGGER_NAME
from vllm_gsd.engine.draft_kv import DraftKvLedger, DraftProgress
from vllm_gsd.engine.drafter.batch import DraftBatch
from vllm_gsd.engine.eligibility import tree_refusal_reason
from vllm_gsd.engine.node_processing import RequestOptions, options_of
from vllm_gsd.engine.sampling import is_sampled, noise_key
from vllm_gsd.engine.tree_grammar import PathGrammar

logger = logging.getLogger(LOGGER_NAME)


@dataclass(frozen=True)
class Sampling:
    """How a sampled request's children are drawn (engine/sampling.py)."""

    noise_key: int
    temperature: float
    top_k: int  # 0: all
    top_p: float


@dataclass(frozen=True)
class Candidate:
    """A request that grows a tree this step."""

    batch_row: int  # index in the runner's batch
    req_id: str
    catch_up_from: int  # first position whose draft KV is missing
    root_pos: int  # position of the root (the last sampled token)
    sampling: Sampling | None  # None: greedy (the draft's deterministic top-k)
    # What the target's rows will apply beyond temperature, top-k and top-p (penalties, allowed
    # ids, logit bias, ...): the children are chosen under it too (drafter/children.py).
    options: RequestOptions | None = None
    # The grammar the target's rows are masked with (a structured-output request), as far as the
    # draft can follow it: its children are tokens it allows.
    grammar: PathGrammar | None = None


@dataclass(frozen=True)
class Chosen:
    """`CandidateChooser.choose`'s answer."""

    candidates: list[Candidate]  # in batch order
    num_plain: int  # the other requests that decode this step (one token each)


class CandidateChooser:
    """Chooses a step's tree requests; keeps each request's draft KV progress."""

    def __init__(self, node_budget: int, draft_max_model_len: int, seed: int | None) -> None:
        self.node_budget = node_budget
        self.draft_max_model_len = draft_max_model_len  # vLLM clamps it to the target's
        self.seed = seed
        self.progress: dict[str, DraftProgress] = {}  # per request: where its draft KV is valid
        self._ledger: DraftKvLedger | None = None  # made once the block size is known
        self._refusals_logged: set[str] = set()
        # The draft's grammars: grammars.of(req_id, params, output_token_ids) -> PathGrammar |
        # None, grammars.forget(req_ids). None: children are chosen without grammars.
        self.grammars = None

    def forget(self, finished_req_ids) -> None:
        for req_id in finished_req_ids:
            self.progress.pop(req_id, None)
            self._refusals_logged.discard(req_id)
        if self.grammars is not None:
            self.grammars.forget(finished_req_ids)

    def choose(self, batch: DraftBatch, scheduler_output, valid_sampled_token_ids: list[list[int]]) -> Chosen:
        resumed = scheduler_output.scheduled_cached_reqs.resumed_req_ids
        candidates, num_plain = [], 0
        for i, req_id in enumerate(batch.req_ids):
            num_scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if num_scheduled == 0:
                continue
            start = int(batch.num_computed_tokens[i])
            progress = self.progress.get(req_id)
            if progress is None or req_id in resumed:
                # New (perhaps with a prefix-cache hit) or resumed after a preemption: the draft
                # KV of its cached blocks counts only where the draft wrote this very prefix.
                progress = self.progress[req_id] = self._ledger_of(batch).resume(
                    batch.token_ids[i], batch.block_ids(i), start)
            num_sampled = len(valid_sampled_token_ids[i])
            if num_sampled == 0:  # a prefill chunk: no root yet
                continue
            num_spec = len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
            end = min(int(batch.num_tokens_no_spec[i]), start + num_scheduled - num_spec + num_sampled)
            root_pos = end - 1
            if root_pos < start or not self._may_grow_tree(batch, i, root_pos):
                num_plain += 1
                continue
            # The root is run again when the draft already holds it: its logits are needed.
            candidates.append(Candidate(i, req_id, min(progress.known, root_pos), root_pos,
                                        self._sampling_of(req_id, batch.sampling_params[i]),
                                        _options_of(batch, i), self._grammar_of(batch, i)))
        return Chosen(candidates, num_plain)

    def advance(self, batch: DraftBatch, candidates: list[Candidate]) -> None:
        """The draft has caught up on every candidate's tokens up to its root."""
        ledger = self._ledger_of(batch)
        for candidate in candidates:
            ledger.advance(self.progress[candidate.req_id], batch.token_ids[candidate.batch_row],
                           batch.block_ids(candidate.batch_row), candidate.root_pos + 1)

    def _sampling_of(self, req_id: str, params) -> Sampling | None:
        if not is_sampled(params):
            return None
        return Sampling(noise_key(req_id, params, self.seed), float(params.temperature), max(int(params.top_k), 0),
                        float(params.top_p))

    def _ledger_of(self, batch: DraftBatch) -> DraftKvLedger:
        if self._ledger is None:
            self._ledger = DraftKvLedger(batch.block_table.block_size)
        return self._ledger

    def _may_grow_tree(self, batch: DraftBatch, batch_row: int, root_pos: int) -> bool:
        req_id, params = batch.req_ids[batch_row], batch.sampling_params[batch_row]
        num_output_tokens = batch.num_output_tokens[batch_row]
        if params is not None and params.max_tokens is not None and num_output_tokens >= params.max_tokens:
            return False  # it has its last token: the scheduler finishes it, no tree is read
        reason = tree_refusal_reason(params, num_output_tokens)
        if reason is not None:
            if req_id not in self._refusals_logged:
                self._refusals_logged.add(req_id)
                logger.info("gsd: request %s is served without speculation (%s)", req_id, reason)
            return False
        # Room for every node: the target writes node rows at root_pos + 1 .. root_pos + N and
        # the draft writes graph rows there too; stay inside max_model_len and the blocks the
        # scheduler allocated (near the context limit the request decodes without a tree).
        block_table = batch.block_table
        allocated = int(block_table.num_blocks_per_row[batch_row]) * block_table.block_size
        last_slot = root_pos + self.node_budget
        return last_slot < self.draft_max_model_len and last_slot < allocated


    def _grammar_of(self, batch: DraftBatch, batch_row: int) -> PathGrammar | None:
        params = batch.sampling_params[batch_row]
        if self.grammars is None or params is None or params.structured_outputs is None:
            return None
        return self.grammars.of(batch.req_ids[batch_row], params, batch.prompt_and_output(batch_row)[1])


def _options_of(batch: DraftBatch, batch_row: int) -> RequestOptions | None:
    params = batch.sampling_params[batch_row]
    if params is None:
        return None
    return options_of(params, *batch.prompt_and_output(batch_row))


def tokens_left(batch: DraftBatch, candidates: list[Candidate]) -> float:
    """How many tokens the tree requests may still generate, on average: their max_tokens, or
    the context limit, less what they have generated."""
    left = []
    for candidate in candidates:
        params = batch.sampling_params[candidate.batch_row]
        by_context = batch.max_model_len - candidate.root_pos - 1
        max_tokens = params.max_tokens if params is not None else None
        by_request = by_context if max_tokens is None else max_tokens - batch.num_output_tokens[candidate.batch_row]
        left.append(max(1, min(by_context, by_request)))
    return float(np.mean(left)) if left else 0.0
