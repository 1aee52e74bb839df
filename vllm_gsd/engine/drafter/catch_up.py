"""The draft's catch-up: causal forwards over every token it has not seen, up to the roots.

Per candidate the draft runs over positions catch_up_from .. root_pos at their real positions,
writing its own KV. That is usually the tokens the target committed this step, but after steps
without drafting (high load, a request not eligible yet, a prefill) it is everything since the
draft last ran, and for a new request everything past the prefix-cache blocks whose draft KV is
known to be valid (engine/draft_kv.py). The tokens of all candidates are packed into forwards of
at most max_num_tokens; a request's tokens may span forwards. Tree slots the draft wrote last
step are overwritten, so its cache holds only accepted tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from vllm_gsd.engine.drafter.choose import Candidate
from vllm_gsd.engine.drafter.forward_metadata import DraftForward


@dataclass(frozen=True)
class CatchUp:
    """What the catch-up computed."""

    root_hidden: torch.Tensor  # [R, H]: the draft's hidden state at each candidate's root
    num_tokens: int  # tokens run


def catch_up(candidates: list[Candidate], token_ids: np.ndarray, max_num_tokens: int,
             forward: Callable[[DraftForward, None, np.ndarray], torch.Tensor]) -> CatchUp:
    """Run the draft over each candidate's unseen tokens (token_ids: the batch's, [>= B, L]);
    forward(fwd, None, sample_index) runs one causal forward and returns the hidden states of
    its rows sample_index."""
    forwards: list[list[tuple[int, int, int]]] = [[]]  # per forward: (candidate, lo, hi)
    used = 0
    for k, candidate in enumerate(candidates):
        lo, hi = candidate.catch_up_from, candidate.root_pos + 1
        while lo < hi:
            if used == max_num_tokens:
                forwards.append([])
                used = 0
            take = min(hi - lo, max_num_tokens - used)
            forwards[-1].append((k, lo, lo + take))
            used, lo = used + take, lo + take
    root_hidden: list[torch.Tensor | None] = [None] * len(candidates)
    total_tokens = 0
    for pieces in forwards:
        fwd = DraftForward(batch_rows=np.asarray([candidates[k].batch_row for k, _, _ in pieces]))
        for k, lo, hi in pieces:
            fwd.token_ids.append(token_ids[candidates[k].batch_row, lo:hi].astype(np.int64))
            fwd.positions.append(np.arange(lo, hi, dtype=np.int64))
            fwd.kv_positions.append(fwd.positions[-1])
            fwd.seq_lens.append(hi)
        ends_root = [j for j, (k, _, hi) in enumerate(pieces) if hi == candidates[k].root_pos + 1]
        last_token = np.cumsum([hi - lo for _, lo, hi in pieces]) - 1
        hidden = forward(fwd, None, last_token[ends_root])
        for row, j in enumerate(ends_root):
            root_hidden[pieces[j][0]] = hidden[row]
        total_tokens += int(last_token[-1] + 1)
    return CatchUp(torch.stack(root_hidden), total_tokens)
