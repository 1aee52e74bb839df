"""Which KV positions hold the draft's KV: per request, and per cache block across requests.

The draft's layers have KV caches of their own, addressed through the target's block tables. A
request's draft KV is valid below its `known` position (what the draft has computed since the
request started). With prefix caching a new request starts with blocks another request filled:
their target KV is what it would compute, but their draft KV exists only if the draft ran over
that prefix (a request served without speculation, or one that ran only plain steps, leaves
none). `DraftKvLedger` remembers, per physical block, the prefix whose draft KV it holds:

* a block is marked when the draft's KV of a request is valid over the whole block: the mark is
  a digest of the request's tokens from position 0 to the end of the block (chained block by
  block, as vLLM's prefix-cache hashes are);
* a request that starts (new, with a prefix-cache hit) or resumes after a preemption with its
  target KV valid below `start` trusts the draft KV of its leading blocks below `start` whose
  marks equal its own digests (`resume`), and the draft catches up from there.

A mark holds only while the draft has not written the block since: the draft writes a block only
for the requests that hold it, and `advance` marks the blocks it filled and drops the mark of every
other block the request holds (the block of its next position and those after it, where its
graph rows and its next catch-up write), before any other request reads the ledger. So a block
that is freed and handed to another request (or to the same one after a preemption) loses its
old mark as soon as the new holder's draft writes any of its positions; a block nobody's draft
wrote since keeps its mark, which names the prefix whose draft KV it still holds. Without that
drop, a block whose first positions were rewritten would keep a mark for the positions after
them: vLLM caches a reused block again under its new content, which can be the old prefix (a
request with the same prompt that got the evicted tail block of an earlier one), and a request
with that prefix would trust draft KV of other tokens there (lost acceptance; output stays exact).
Digests are blake2b (deterministic in every process, so every tensor-parallel rank decides the same).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np


@dataclass
class DraftProgress:
    """One request's draft KV: valid below `known`; its first `marked_blocks` blocks are in the
    ledger, `digest` being the mark of the last of them."""

    known: int = 0
    marked_blocks: int = 0
    digest: bytes = b""


def _chain(digest: bytes, block_tokens: np.ndarray) -> bytes:
    return hashlib.blake2b(digest + np.ascontiguousarray(block_tokens, dtype=np.int64).tobytes(),
                           digest_size=16).digest()


class DraftKvLedger:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._mark: dict[int, bytes] = {}  # physical block id -> digest of the prefix it holds

    def resume(self, token_ids: np.ndarray, block_ids: np.ndarray, start: int) -> DraftProgress:
        """Progress of a request whose target KV is valid below `start` while its own draft KV
        is not known: the leading blocks below `start` whose marks match its tokens."""
        progress = DraftProgress()
        bs = self.block_size
        for j in range(start // bs):
            digest = _chain(progress.digest, token_ids[j * bs:(j + 1) * bs])
            if self._mark.get(int(block_ids[j])) != digest:
                break
            progress.marked_blocks, progress.digest = j + 1, digest
        progress.known = progress.marked_blocks * bs
        return progress

    def advance(self, progress: DraftProgress, token_ids: np.ndarray, block_ids: np.ndarray,
                known: int) -> None:
        """The request's draft KV is now valid below `known`: mark every block it fills, and drop
        the marks of the blocks it holds past them (the draft writes there next, for this
        request only: `known` is past its computed tokens, so those blocks are not shared)."""
        bs = self.block_size
        progress.known = known
        for j in range(progress.marked_blocks, known // bs):
            progress.digest = _chain(progress.digest, token_ids[j * bs:(j + 1) * bs])
            self._mark[int(block_ids[j])] = progress.digest
            progress.marked_blocks = j + 1
        for block in block_ids[progress.marked_blocks:]:
            self._mark.pop(int(block), None)
