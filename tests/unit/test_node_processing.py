"""Tree rows processed with their own path's history (engine/node_processing.py) equal vLLM's
own sampler processing a request whose output is that history: vLLM's Sampler with its built-in
logits processors (min_tokens, logit_bias, min_p) fed the request through a BatchUpdate, as its
input batch does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sampling_stand_ins import sampling_metadata

VOCAB = 32
PROMPT = [1, 2, 3, 7]
OUTPUT = [3, 4, 5]
# Node i's parent row (0 = root) and token: two branches, one through token 7 (a bad word's
# first token below), depths 1..3.
PARENTS = [0, 0, 1, 3, 2]
TOKENS = [7, 4, 8, 9, 7]

OPTIONS = {
    "penalties": dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.4),
    "bad_words": dict(),  # _bad_words_token_ids set below: [[7, 8], [4, 4, 6]]
    "allowed_token_ids": dict(allowed_token_ids=[4, 6, 8, 9, 10, 20]),
    "logit_bias": dict(logit_bias={6: 2.5, 9: -4.0, 30: 1.0}),
    "min_tokens": dict(min_tokens=5, stop_token_ids=[9, 12]),
    "everything": dict(presence_penalty=0.2, repetition_penalty=1.2, allowed_token_ids=list(range(4, 24)),
                       logit_bias={6: 1.5, 9: 3.0}, min_tokens=5, stop_token_ids=[9]),
}


def _params(name):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, **OPTIONS[name])
    if name == "bad_words":
        params._bad_words_token_ids = [[7, 8], [4, 4, 6]]
    return params


def _vllm_processed(logits_row: torch.Tensor, params, history: list[int]) -> torch.Tensor:
    """vLLM's Sampler processing one request's row after `history` (its output so far)."""
    from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, BatchUpdate, LogitsProcessors
    from vllm.v1.sample.sampler import Sampler

    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=4))
    processors = LogitsProcessors(ctor(config, torch.device("cpu"), False) for ctor in BUILTIN_LOGITS_PROCESSORS)
    for processor in processors.all:
        processor.update_state(BatchUpdate(batch_size=1, removed=[], added=[(0, params, PROMPT, history)], moved=[]))
    allowed_mask = None
    if params.allowed_token_ids:
        allowed_mask = torch.ones(1, VOCAB, dtype=torch.bool)
        allowed_mask[0, params.allowed_token_ids] = False
    penalties = dict(presence_penalties=torch.tensor([params.presence_penalty]),
                     frequency_penalties=torch.tensor([params.frequency_penalty]),
                     repetition_penalties=torch.tensor([params.repetition_penalty]))
    metadata = sampling_metadata(
        [0.0], no_penalties=not (params.presence_penalty or params.frequency_penalty
                                 or params.repetition_penalty != 1.0),
        prompt_token_ids=torch.tensor([PROMPT]), output_token_ids=[history], allowed_token_ids_mask=allowed_mask,
        bad_words_token_ids={0: params.bad_words_token_ids} if params.bad_words_token_ids else {},
        logitsprocs=processors, **penalties)
    return Sampler().apply_logits_processors(logits_row.clone(), metadata, predict_bonus_token=False)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_every_row_is_processed_as_vllm_processes_its_path(name):
    from vllm_gsd.engine.node_processing import options_of, process_rows, row_paths

    params = _params(name)
    paths = row_paths(PARENTS, TOKENS)
    logits = torch.randn(len(paths), VOCAB, generator=torch.Generator().manual_seed(len(name)))
    options = options_of(params, PROMPT, OUTPUT)
    assert options is not None
    got = process_rows(logits.clone(), [options] * len(paths), paths)
    for row, path in enumerate(paths):
        want = _vllm_processed(logits[row:row + 1], params, OUTPUT + path)[0]
        assert torch.equal(torch.isinf(got[row]), torch.isinf(want)), (row, path)
        finite = torch.isfinite(want)
        assert torch.allclose(got[row][finite], want[finite]), (row, path)
    # The option acts on some row (the test would otherwise pass for an ignored option).
    assert not torch.equal(got, logits)


def test_a_path_decides_what_its_row_refuses():
    """Bad word [7, 8]: only rows whose path ends with 7 refuse 8. min_tokens 5 after 3 output
    tokens: the root and depth-1 rows refuse the stop token, deeper rows do not."""
    from vllm_gsd.engine.node_processing import options_of, process_rows, row_paths

    paths = row_paths(PARENTS, TOKENS)
    logits = torch.zeros(len(paths), VOCAB)
    bad = process_rows(logits.clone(), [options_of(_params("bad_words"), PROMPT, OUTPUT)] * len(paths), paths)
    assert [bool(torch.isinf(bad[r, 8])) for r in range(len(paths))] == [path[-1:] == [7] for path in paths]
    short = process_rows(logits.clone(), [options_of(_params("min_tokens"), PROMPT, OUTPUT)] * len(paths), paths)
    assert [bool(torch.isinf(short[r, 9])) for r in range(len(paths))] == [len(path) < 2 for path in paths]


def test_requests_without_options_are_left_alone():
    from vllm import SamplingParams

    from vllm_gsd.engine.node_processing import options_of, process_rows

    assert options_of(SamplingParams(temperature=0.7, top_k=5, top_p=0.9), PROMPT, OUTPUT) is None
    logits = torch.randn(3, VOCAB)
    assert torch.equal(process_rows(logits.clone(), [None] * 3, [[], [1], [1, 2]]), logits)
    # min_tokens already reached: nothing left to apply.
    assert options_of(SamplingParams(min_tokens=2, stop_token_ids=[9]), PROMPT, OUTPUT) is None


def test_min_p_follows_vllm_after_the_temperature():
    from vllm.v1.sample.logits_processor import MinPLogitsProcessor
    from vllm.v1.sample.logits_processor.interface import BatchUpdate
    from vllm import SamplingParams

    from vllm_gsd.engine.sampling import processed_scores

    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    temperature = torch.tensor([0.7, 1.3])
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=4))
    min_p = MinPLogitsProcessor(config, torch.device("cpu"), False)
    min_p.update_state(BatchUpdate(batch_size=2, removed=[], moved=[],
                                   added=[(0, SamplingParams(min_p=0.2), None, []), (1, SamplingParams(min_p=0.05), None, [])]))
    want = min_p.apply(logits.clone() / temperature[:, None])
    got = processed_scores(logits, temperature, None, None, torch.tensor([0.2, 0.05]))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.isinf(got).any()
