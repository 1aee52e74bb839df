"""runner/rank_failure.py: where an error in gsd's rank-local work goes, by the worker's place."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_gsd.vllm_v0_32.runner import rank_failure
from vllm_gsd.vllm_v0_32.runner.rank_failure import RankFailure, stop_on_rank_failure


def _runner(world_size: int, pcp: int = 1):
    return SimpleNamespace(parallel_config=SimpleNamespace(world_size=world_size, prefill_context_parallel_size=pcp))


@pytest.fixture
def place(monkeypatch):
    """Set this worker's tensor-parallel rank and whether it is on the last pipeline stage;
    os._exit is recorded instead (SystemExit stands in for it)."""
    import vllm.distributed
    import vllm.distributed.parallel_state

    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr(rank_failure.os, "_exit", exit_)

    def set_place(tp_rank: int, last_stage: bool = True, pcp_rank: int = 0):
        monkeypatch.setattr(vllm.distributed, "get_tp_group", lambda: SimpleNamespace(rank_in_group=tp_rank))
        monkeypatch.setattr(vllm.distributed, "get_pp_group", lambda: SimpleNamespace(is_last_rank=last_stage))
        monkeypatch.setattr(vllm.distributed.parallel_state, "get_pcp_group",
                            lambda: SimpleNamespace(rank_in_group=pcp_rank))

    return set_place


def _fail(runner, error):
    try:
        raise error
    except Exception as caught:
        stop_on_rank_failure(runner, "drafter", caught)


def test_a_single_worker_raises_the_error_itself():
    error = MemoryError("draft out of memory")
    with pytest.raises(MemoryError) as raised:
        _fail(_runner(1), error)
    assert raised.value is error


def test_the_output_rank_raises_naming_the_rank_and_the_error(place, caplog):
    place(tp_rank=0)
    error = MemoryError("draft out of memory")
    named = "tensor-parallel rank 0 failed in its drafter: MemoryError: draft out of memory"
    with pytest.raises(RankFailure, match=named) as raised:
        _fail(_runner(2), error)
    assert raised.value.__cause__ is error
    assert named in caplog.text


@pytest.mark.parametrize("tp_rank, last_stage, pcp_rank", [(1, True, 0), (0, False, 0), (0, True, 1)])
def test_any_other_rank_ends_its_process(place, caplog, tp_rank, last_stage, pcp_rank):
    """vLLM's executor drops these ranks' exceptions; a dead process it does notice."""
    place(tp_rank=tp_rank, last_stage=last_stage, pcp_rank=pcp_rank)
    with pytest.raises(SystemExit) as exited:
        _fail(_runner(4, pcp=2), MemoryError("draft out of memory"))
    assert exited.value.code == 1
    assert f"tensor-parallel rank {tp_rank} failed in its drafter: MemoryError: draft out of memory" in caplog.text
