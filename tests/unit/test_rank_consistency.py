"""Tensor-parallel ranks that build different trees are caught, not left to diverge."""

from __future__ import annotations

import os
import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from vllm_gsd.engine.rank_consistency import RankDivergence, check_same_on_all_ranks, tree_fingerprint


def test_fingerprint_depends_on_tokens_and_shape():
    base = tree_fingerprint([[5, 6, 7]], [[0, 0, 1]])
    assert base == tree_fingerprint([[5, 6, 7]], [[0, 0, 1]])
    assert base != tree_fingerprint([[5, 6, 8]], [[0, 0, 1]])
    assert base != tree_fingerprint([[5, 6, 7]], [[0, 1, 1]])
    assert 0 <= base < 2**63


def _rank_main(rank, port, fingerprints, results):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=len(fingerprints))
    try:
        check_same_on_all_ranks(fingerprints[rank], dist.group.WORLD, rank)
        results[rank] = "same"
    except RankDivergence as err:
        results[rank] = str(err)
    finally:
        dist.destroy_process_group()


def _run(fingerprints):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_rank_main, args=(port, fingerprints, results), nprocs=len(fingerprints), join=True)
    return [results[r] for r in range(len(fingerprints))]


def test_agreeing_ranks_pass():
    assert _run([123, 123]) == ["same", "same"]


@pytest.mark.parametrize("fingerprints", [[123, 124], [2**62, 7]])
def test_diverging_ranks_fail_on_every_rank(fingerprints):
    results = _run(fingerprints)
    assert all("proposed different trees" in r for r in results)

