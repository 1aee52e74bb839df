"""Which requests grow a tree in a step, and where each one's draft catches up from
(engine/drafter/choose.py), on a DraftBatch of stand-in arrays: the requests the scheduler left
out or is still prefilling draw nothing, those that cannot hold a tree decode plainly, and the
draft's KV progress follows the ledger (engine/draft_kv.py) across steps and a preemption."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from vllm import SamplingParams

from vllm_gsd.engine.drafter.batch import DraftBatch
from vllm_gsd.engine.drafter.choose import CandidateChooser, tokens_left
from vllm_gsd.engine.sampling import noise_key

BLOCK_SIZE = 16
NODE_BUDGET = 4
MAX_MODEL_LEN = 200  # the target's
DRAFT_MAX_MODEL_LEN = 100
ENGINE_SEED = 3


def _batch(rows: list[dict]) -> DraftBatch:
    """rows: per request its id, computed tokens, tokens (drafts left out), sampling params,
    output tokens so far and allocated blocks."""
    num = len(rows)
    token_ids = np.arange(num * MAX_MODEL_LEN, dtype=np.int32).reshape(num, MAX_MODEL_LEN) % 50
    blocks = np.zeros((num, 16), dtype=np.int32)
    for i, row in enumerate(rows):
        blocks[i, :row["blocks"]] = np.arange(row["blocks"]) + 100 * i
    block_table = SimpleNamespace(block_size=BLOCK_SIZE, block_table=SimpleNamespace(np=blocks),
                                  num_blocks_per_row=np.array([row["blocks"] for row in rows]))
    return DraftBatch([row["id"] for row in rows], np.array([row["computed"] for row in rows], dtype=np.int32),
                      np.array([row["tokens"] for row in rows], dtype=np.int32), token_ids,
                      [row["params"] for row in rows], [row["outputs"] for row in rows], block_table, MAX_MODEL_LEN)


def _scheduled(num_scheduled: dict[str, int], drafts: dict[str, list[int]] | None = None, resumed=()):
    return SimpleNamespace(num_scheduled_tokens=num_scheduled, scheduled_spec_decode_tokens=drafts or {},
                           scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set(resumed)))


GREEDY = SamplingParams(temperature=0.0, max_tokens=50)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, top_k=-1, max_tokens=50)

# One step. "tree": 20 computed, root + 2 drafts scheduled, 1 accepted + 1 bonus sampled, so its
# root (the last sampled token) sits at 22. The others fall out at one check each.
STEP = [
    dict(id="tree", computed=20, tokens=23, params=GREEDY, outputs=10, blocks=2),
    dict(id="idle", computed=30, tokens=31, params=GREEDY, outputs=3, blocks=2),  # not scheduled
    dict(id="prefill", computed=0, tokens=40, params=GREEDY, outputs=0, blocks=3),  # a chunk: no root
    dict(id="last_token", computed=30, tokens=31, params=SamplingParams(max_tokens=5), outputs=5, blocks=3),
    dict(id="context_end", computed=96, tokens=97, params=GREEDY, outputs=60, blocks=7),  # 96 + 4 >= 100
    dict(id="pooling", computed=30, tokens=31, params=None, outputs=2, blocks=3),  # generates nothing
    dict(id="few_blocks", computed=30, tokens=31, params=GREEDY, outputs=2, blocks=2),  # 30 + 4 >= 32
    dict(id="sampled", computed=40, tokens=41, params=SAMPLED, outputs=4, blocks=3),
]
NUM_SCHEDULED = {"tree": 3, "prefill": 16, "last_token": 1, "context_end": 1, "pooling": 1, "few_blocks": 1,
                 "sampled": 1}
SAMPLED_TOKENS = [[7, 8], [], [], [9], [9], [9], [9], [9]]


def _chooser() -> CandidateChooser:
    return CandidateChooser(NODE_BUDGET, DRAFT_MAX_MODEL_LEN, ENGINE_SEED)


def test_only_requests_that_can_hold_a_tree_grow_one():
    chosen = _chooser().choose(_batch(STEP), _scheduled(NUM_SCHEDULED, {"tree": [5, 6]}), SAMPLED_TOKENS)
    assert [c.req_id for c in chosen.candidates] == ["tree", "sampled"]
    assert [c.batch_row for c in chosen.candidates] == [0, 7]
    # The requests that decode without a tree: not the idle one nor the prefill chunk.
    assert chosen.num_plain == 4


def test_a_candidates_root_and_catch_up():
    chosen = _chooser().choose(_batch(STEP), _scheduled(NUM_SCHEDULED, {"tree": [5, 6]}), SAMPLED_TOKENS)
    tree, sampled = chosen.candidates
    assert tree.root_pos == 22 and sampled.root_pos == 40
    assert tree.catch_up_from == 0  # a new request: no draft KV yet, nothing in the ledger
    assert tree.sampling is None  # greedy: the draft's deterministic top-k
    assert sampled.sampling.temperature == pytest.approx(0.8)
    assert sampled.sampling.top_p == pytest.approx(0.9) and sampled.sampling.top_k == 0
    assert sampled.sampling.noise_key == noise_key("sampled", SAMPLED, ENGINE_SEED)


def test_the_draft_catches_up_from_where_it_stopped_and_after_a_preemption_from_its_marked_blocks():
    chooser = _chooser()
    first = [dict(id="r", computed=20, tokens=23, params=GREEDY, outputs=10, blocks=3)]
    batch = _batch(first)
    chosen = chooser.choose(batch, _scheduled({"r": 3}, {"r": [5, 6]}), [[7, 8]])
    assert chosen.candidates[0].catch_up_from == 0
    chooser.advance(batch, chosen.candidates)  # the draft now holds positions 0..22

    second = _batch([dict(id="r", computed=23, tokens=24, params=GREEDY, outputs=11, blocks=3)])
    chosen = chooser.choose(second, _scheduled({"r": 1}), [[9]])
    assert chosen.candidates[0].root_pos == 23
    assert chosen.candidates[0].catch_up_from == 23  # only the new root

    # Preempted and resumed with its KV recomputed: the draft KV counts only in the blocks the
    # ledger marked as full of this very prefix (block 0: positions 0..15).
    chosen = chooser.choose(second, _scheduled({"r": 1}, resumed={"r"}), [[9]])
    assert chosen.candidates[0].catch_up_from == BLOCK_SIZE

    chooser.forget(["r"])  # finished: a request with that id starts again from the ledger
    assert "r" not in chooser.progress


def test_tokens_left_averages_what_each_tree_request_may_still_generate():
    batch = _batch([dict(id="a", computed=20, tokens=21, params=SamplingParams(max_tokens=30), outputs=10, blocks=2),
                    dict(id="b", computed=190, tokens=191, params=SamplingParams(max_tokens=None), outputs=5,
                         blocks=13),
                    dict(id="c", computed=20, tokens=21, params=SamplingParams(max_tokens=12), outputs=12, blocks=2)])
    chooser = _chooser()
    chooser.draft_max_model_len = MAX_MODEL_LEN + NODE_BUDGET + 1  # let "b" in near the context end
    chosen = chooser.choose(batch, _scheduled({"a": 1, "b": 1, "c": 1}), [[1], [1], [1]])
    assert [c.req_id for c in chosen.candidates] == ["a", "b"]  # "c" has its last token
    # a: max_tokens 30 - 10 output = 20; b: context 200 - root 190 - 1 = 9.
    assert tokens_left(batch, chosen.candidates) == pytest.approx((20 + 9) / 2)
    assert tokens_left(batch, []) == 0.0
