"""DraftKvLedger: a request trusts cached draft KV only where the draft wrote that very prefix."""

from __future__ import annotations

import numpy as np

from vllm_gsd.engine.draft_kv import DraftKvLedger

BS = 4


def tokens(n: int, offset: int = 0) -> np.ndarray:
    return np.arange(offset, offset + n, dtype=np.int64)


def test_a_new_request_without_marks_starts_at_zero():
    ledger = DraftKvLedger(BS)
    progress = ledger.resume(tokens(20), np.arange(5), start=16)
    assert progress.known == 0 and progress.marked_blocks == 0


def test_blocks_the_draft_filled_are_trusted_by_a_request_sharing_the_prefix():
    ledger = DraftKvLedger(BS)
    first = ledger.resume(tokens(30), np.arange(8), start=0)
    ledger.advance(first, tokens(30), np.arange(8), known=14)  # blocks 0..2 full, block 3 partial
    assert first.marked_blocks == 3
    # Same prefix, same physical blocks (a prefix-cache hit of 3 blocks): trusted up to 12.
    sharer = ledger.resume(tokens(30), np.array([0, 1, 2, 9, 10]), start=12)
    assert sharer.known == 12
    # A hit shorter than the marks: only below start.
    assert ledger.resume(tokens(30), np.array([0, 1, 2]), start=8).known == 8


def test_a_different_prefix_or_other_blocks_do_not_match():
    ledger = DraftKvLedger(BS)
    progress = ledger.resume(tokens(16), np.arange(4), start=0)
    ledger.advance(progress, tokens(16), np.arange(4), known=16)
    other = tokens(16).copy()
    other[5] = 99  # differs in block 1: blocks 1.. are not this prefix's
    assert ledger.resume(other, np.arange(4), start=16).known == 4
    # Same tokens in other physical blocks (never written by the draft): nothing trusted.
    assert ledger.resume(tokens(16), np.arange(10, 14), start=16).known == 0


def test_a_block_reused_for_other_content_loses_its_old_meaning():
    ledger = DraftKvLedger(BS)
    a = ledger.resume(tokens(8), np.array([0, 1]), start=0)
    ledger.advance(a, tokens(8), np.array([0, 1]), known=8)
    # Block 1 is freed and reused by a request with other tokens, whose draft fills it.
    b_tokens = tokens(8, offset=100)
    b = ledger.resume(b_tokens, np.array([5, 1]), start=0)
    ledger.advance(b, b_tokens, np.array([5, 1]), known=8)
    assert ledger.resume(tokens(8), np.array([0, 1]), start=8).known == 4
    assert ledger.resume(b_tokens, np.array([5, 1]), start=8).known == 8


def test_advance_is_incremental():
    ledger = DraftKvLedger(BS)
    ids, blocks = tokens(40), np.arange(10)
    progress = ledger.resume(ids, blocks, start=0)
    for known in (3, 5, 9, 9, 17, 40):
        ledger.advance(progress, ids, blocks, known)
        assert progress.known == known and progress.marked_blocks == known // BS
    whole = ledger.resume(ids, blocks, start=40)
    assert whole.known == 40 and whole.digest == progress.digest


def test_a_reused_block_the_draft_wrote_only_in_part_keeps_no_stale_mark():
    """A's draft filled and marked blocks [0, 1] (prefix P). The block 1 is freed, evicted and
    handed to B, a request with the same prompt at the same place (the tail of a freed request
    is the first block evicted). B's draft catches up to its root at position 5 and writes its
    graph rows (drafted tokens, not P's) into positions 6 and 7 of block 1, then B decodes
    plainly: the target fills the block with P's tokens, so vLLM caches it for P again, while
    its draft KV holds B's graph rows. A request C with prefix P that hits B's blocks must not
    trust block 1's draft KV: A's mark is stale for every position written since."""
    ledger = DraftKvLedger(BS)
    prefix = tokens(8)
    a = ledger.resume(prefix, np.array([0, 1]), start=0)
    ledger.advance(a, prefix, np.array([0, 1]), known=8)
    assert ledger.resume(prefix, np.array([0, 1]), start=8).known == 8
    b = ledger.resume(prefix, np.array([5, 1]), start=0)
    ledger.advance(b, prefix, np.array([5, 1]), known=6)  # graph rows then go to slots 6, 7
    c = ledger.resume(prefix, np.array([5, 1]), start=8)
    assert c.known == 4  # block 5 (B's, full and marked); not block 1
