"""GsdRejectionSampler on fake logits (engine/scorer.py): the accepted path, the target's token
after it, and the logprobs vLLM reports along it, for trees built by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sampling_stand_ins import sampling_metadata

VOCAB = 16
# Request 0: a tree of 4 nodes under its root (rows 1..4): rows 1, 2 children of the root,
# row 3 a child of row 1, row 4 a child of row 3. Request 1: no nodes. Request 2: a chain of 2.
PARENTS = [[0, 0, 1, 3], [], [0, 1]]
DRAFTS = [[5, 6, 7, 8], [], [9, 10]]
# The target's argmax at every row, request by request (root first): request 0 takes row 2
# (token 6), whose row predicts 11, a token no child carries; request 2 accepts its whole chain.
ARGMAX = [[6, 3, 11, 1, 2], [4], [9, 10, 12]]


def _scorer_inputs(temperature: list[float] | None = None, host_drafts: bool = False, **metadata_fields):
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from vllm_gsd.engine.tree_batch import build_tree_batch
    from vllm_gsd.vllm_v0_32.spec_decode import TreeSpecDecodeMetadata

    batch = len(PARENTS)
    width = max(map(len, PARENTS))
    parent_row = torch.full((batch, width), -1, dtype=torch.int64)
    depth = torch.zeros((batch, width), dtype=torch.int64)
    for b, parents in enumerate(PARENTS):
        for i, parent in enumerate(parents):
            parent_row[b, i] = parent
            depth[b, i] = 1 + (depth[b, parent - 1] if parent else 0)
    num_nodes = torch.tensor([len(p) for p in PARENTS])
    query_start_loc = np.concatenate([[0], np.cumsum(num_nodes.numpy() + 1)])
    tree_base = np.array([40, 7, 23])
    temperature = temperature or [0.0] * batch
    keys = [None if t == 0.0 else 1234 + b for b, t in enumerate(temperature)]
    draft_token_ids = None
    if host_drafts:  # the runner's host copy of the draft tokens (step_hooks._verification_trees)
        draft_token_ids = torch.full((batch, width), -1, dtype=torch.int64)
        for b, drafts in enumerate(DRAFTS):
            draft_token_ids[b, :len(drafts)] = torch.tensor(drafts, dtype=torch.int64)
    tree = build_tree_batch(parent_row, depth, num_nodes, tree_base, torch.zeros_like(parent_row, dtype=torch.bool),
                            keys, query_start_loc, torch.device("cpu"), draft_token_ids=draft_token_ids)
    metadata = TreeSpecDecodeMetadata.wrap(SpecDecodeMetadata.make_dummy(DRAFTS, torch.device("cpu")), tree)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(int(query_start_loc[-1]), VOCAB, generator=generator)
    for row, token in enumerate(sum(ARGMAX, [])):
        logits[row, token] += 8.0
    return metadata, logits, sampling_metadata(temperature, **metadata_fields)


def _score(metadata, logits, sampling):
    from vllm.v1.sample.sampler import Sampler

    from vllm_gsd.vllm_v0_32.scorer import GsdRejectionSampler, GsdSampler

    scorer = GsdRejectionSampler(GsdSampler(logprobs_mode="raw_logprobs"), None, torch.device("cpu"))
    return scorer(metadata, None, logits.clone(), sampling), Sampler.compute_logprobs(logits)


def test_greedy_walk_emits_the_accepted_path_and_the_targets_token():
    output, _ = _score(*_scorer_inputs())
    assert output.sampled_token_ids.tolist() == [[6, 11, -1, -1, -1], [4, -1, -1, -1, -1], [9, 10, 12, -1, -1]]
    assert output.accepted.num_accepted.tolist() == [1, 0, 2]
    assert output.accepted.accepted_rows[0, :2].tolist() == [0, 2]


def test_the_trees_host_copy_of_the_draft_tokens_replaces_vllms():
    """With TreeBatch.draft_token_ids the scorer does not read vLLM's device copy: the same
    output, even with vLLM's tokens scrambled (they are not looked at)."""
    expected, _ = _score(*_scorer_inputs(host_drafts=True))
    for temperature in (None, [0.7, 0.0, 1.0]):
        reference, _ = _score(*_scorer_inputs(temperature))
        metadata, logits, sampling = _scorer_inputs(temperature, host_drafts=True)
        metadata.draft_token_ids = torch.full_like(metadata.draft_token_ids, VOCAB - 1)
        output, _ = _score(metadata, logits, sampling)
        assert torch.equal(output.sampled_token_ids, reference.sampled_token_ids)
        assert torch.equal(output.accepted.accepted_rows, reference.accepted.accepted_rows)
    assert expected.accepted.num_accepted.tolist() == [1, 0, 2]


def test_top_logprobs_come_from_the_row_that_predicted_each_token():
    output, logprobs = _score(*_scorer_inputs(max_num_logprobs=2))
    tensors = output.logprobs_tensors
    width = output.sampled_token_ids.shape[1]
    # Request 0 emitted 6 from its root (row 0) and 11 from its node row 2 (logits row 2).
    for j, logits_row in enumerate([0, 2]):
        row = 0 * width + j
        emitted = output.sampled_token_ids[0, j]
        assert tensors.logprob_token_ids[row, 0] == emitted
        assert torch.allclose(tensors.logprobs[row, 0], logprobs[logits_row, emitted])
        top2 = logprobs[logits_row].topk(2)
        assert tensors.logprob_token_ids[row, 1:].tolist() == top2.indices.tolist()


def test_logprob_token_ids_are_reported_along_the_path():
    """A request naming token ids gets their logprobs at every token it emitted, from the row
    that predicted it; the sampled token comes first, as vLLM's Sampler lays them out."""
    output, logprobs = _score(*_scorer_inputs(logprob_token_ids={2: [3, 14]}))
    tensors = output.logprobs_tensors
    assert tensors is not None
    width = output.sampled_token_ids.shape[1]
    for j, logits_row in enumerate([6, 7, 8]):  # request 2's rows: root, node 1, node 2
        row = 2 * width + j
        emitted = int(output.sampled_token_ids[2, j])
        assert tensors.logprob_token_ids[row].tolist() == [emitted, 3, 14]
        assert torch.allclose(tensors.logprobs[row], logprobs[logits_row, [emitted, 3, 14]])


def test_sampled_walk_draws_every_row_with_its_positions_noise():
    """A sampled request's token at each visited row is argmax(logits / T + G(key, position)):
    row 0 at tree_base + 1, a node at tree_base + depth + 1."""
    from vllm_gsd.graph.gumbel import gumbel_argmax, gumbel_noise

    metadata, logits, sampling = _scorer_inputs(temperature=[0.0, 0.0, 0.8])
    output, _ = _score(metadata, logits, sampling)
    emitted = output.sampled_token_ids[2]
    accepted = int(output.accepted.num_accepted[2])
    for j in range(accepted + 1):
        logits_row = 6 + j  # a chain: the path's j-th row is node j
        noise = gumbel_noise(np.array([1234 + 2]), np.array([23 + j + 1]), VOCAB)
        assert emitted[j] == gumbel_argmax(logits[logits_row:logits_row + 1] / 0.8, noise)[0]


def _random_trees(rng: np.random.Generator, batch: int, vocab: int):
    """Trees built level by level (depth non-decreasing, children after their parents, tokens
    drawn from a small vocabulary so siblings repeat tokens and walks go deep), as
    (parent_row, depth, draft_token_ids) int64 [B, Nmax], -1 / 0 / -1 padded."""
    trees = []
    for _ in range(batch):
        parents, depths, level = [], [], [0]
        for depth in range(1, int(rng.integers(0, 5)) + 1):
            below = sorted(int(rng.choice(level)) for _ in range(int(rng.integers(1, 4))))
            level = list(range(len(parents) + 1, len(parents) + 1 + len(below)))
            parents += below
            depths += [depth] * len(below)
        trees.append((parents, depths, rng.integers(0, vocab, len(parents)).tolist()))
    width = max(1, max(len(p) for p, _, _ in trees))
    parent_row = torch.full((batch, width), -1, dtype=torch.int64)
    depth = torch.zeros((batch, width), dtype=torch.int64)
    draft_token_ids = torch.full((batch, width), -1, dtype=torch.int64)
    for b, (parents, depths, tokens) in enumerate(trees):
        parent_row[b, :len(parents)] = torch.tensor(parents, dtype=torch.int64)
        depth[b, :len(depths)] = torch.tensor(depths, dtype=torch.int64)
        draft_token_ids[b, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    return parent_row, depth, draft_token_ids


def _reference_walk(logits, start, parents, tokens, key, base, temperature, top_k, top_p, options):
    """One request's sampled walk, row by row in plain Python: the emitted tokens. A row's
    options see the tokens accepted above it (those emitted so far) as its path."""
    from vllm_gsd.engine.node_processing import process_rows
    from vllm_gsd.engine.sampling import processed_scores
    from vllm_gsd.graph.gumbel import gumbel_argmax, gumbel_noise

    row, level, emitted = 0, 0, []
    while True:
        row_logits = logits[start + row:start + row + 1]
        if options is not None:
            row_logits = process_rows(row_logits.to(torch.float32), [options], [list(emitted)])
        scores = processed_scores(row_logits, torch.tensor([temperature]),
                                  None if top_k is None else torch.tensor([top_k]),
                                  None if top_p is None else torch.tensor([top_p]),
                                  None if options is None or not options.min_p else torch.tensor([options.min_p]))
        token = int(gumbel_argmax(scores, gumbel_noise(np.array([key]), np.array([base + level + 1]),
                                                       logits.shape[1]))[0])
        emitted.append(token)
        children = [i + 1 for i, (p, t) in enumerate(zip(parents, tokens)) if p == row and t == token]
        if not children:
            return emitted
        row, level = children[0], level + 1


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("truncation", ["none", "top_k_top_p", "options"])
def test_the_sampled_walk_reads_nothing_on_a_device_and_walks_as_on_the_cpu(monkeypatch, seed, truncation):
    """The sampled walk on random trees: on a device (the counter's device tensors, the GPU's
    branch) it runs every level masked and reads nothing (requests with options too: each
    level's rows are processed before the walk picks its own); on the CPU it visits only walks
    still going. Both emit, request
    by request, what a plain row-by-row walk with each position's noise emits."""
    from vllm_gsd.engine import scorer, staging
    from vllm_gsd.engine.node_processing import RequestOptions
    from vllm_gsd.engine.staging import HostStaging
    from vllm_gsd.engine.tree_batch import build_tree_batch
    from vllm_gsd.graph import walk_tree
    from vllm_gsd.testing.host_reads import HostReadCounter, StepReads

    rng = np.random.default_rng(seed)
    batch, vocab = 9, 5
    parent_row, depth, draft_token_ids = _random_trees(rng, batch, vocab)
    num_nodes = (parent_row >= 0).sum(1)
    row_start = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(num_nodes + 1, 0)[:-1]])
    logits = 3.0 * torch.randn(int((num_nodes + 1).sum()), vocab, generator=torch.Generator().manual_seed(seed))
    # Most nodes carry their parent row's likeliest token, as a good draft's would: walks go deep.
    for b, i in (parent_row >= 0).nonzero().tolist():
        if rng.random() < 0.8:
            draft_token_ids[b, i] = logits[row_start[b] + parent_row[b, i]].argmax()
    temperature = rng.uniform(0.3, 1.5, batch).round(2).tolist()
    temperature[3] = 0.0  # a greedy request beside them: not walked
    keys = [None if t == 0.0 else int(k) for t, k in zip(temperature, rng.integers(0, 2**62, batch))]
    tree_base = rng.integers(0, 100, batch)
    walkers = torch.tensor([b for b in range(batch) if keys[b] is not None and num_nodes[b] > 0])
    options = [None] * batch
    if truncation == "options":  # penalties that see the path, a bias and min_p on walked requests
        first, second, third = walkers[:3].tolist()
        options[first] = RequestOptions(prompt_token_ids=[1], output_token_ids=[2, 2], repetition_penalty=3.0,
                                        presence_penalty=1.0)
        options[second] = RequestOptions(prompt_token_ids=[], output_token_ids=[], logit_bias={0: 2.0}, min_p=0.2)
        options[third] = RequestOptions(prompt_token_ids=[3], output_token_ids=[], frequency_penalty=2.0)
    tree = build_tree_batch(parent_row, depth, num_nodes, tree_base, torch.zeros_like(parent_row, dtype=torch.bool),
                            keys, np.concatenate([[0], np.cumsum(num_nodes.numpy() + 1)]), torch.device("cpu"),
                            options=options, draft_token_ids=draft_token_ids)
    fields = {}
    if truncation == "top_k_top_p":
        fields = dict(top_k=torch.tensor(rng.integers(2, vocab + 1, batch)),
                      top_p=torch.tensor(rng.uniform(0.5, 1.0, batch), dtype=torch.float32))
    metadata = sampling_metadata(temperature, **fields)

    def walk(on_device: bool):
        monkeypatch.setattr(scorer, "HOST_DEVICE_TYPES", () if on_device else ("cpu",))
        row_target = torch.full((batch, parent_row.shape[1] + 1), -1, dtype=torch.int64)
        counter = HostReadCounter()
        counter.step = StepReads()
        # What the staging returns is on the device, as on a GPU (a non-blocking copy).
        monkeypatch.setattr(staging, "STAGED_HOOKS", [counter.mark])
        with counter:
            counter.mark([row_target, logits, metadata.temperature, metadata.top_k, metadata.top_p])
            scorer.walk_sampled(row_target, logits, walkers, row_start, parent_row, depth, draft_token_ids, tree,
                                metadata, scorer.PathsOfRows(tree, parent_row, draft_token_ids),
                                HostStaging(torch.device("cpu"), pin_memory=False))
        return walk_tree(draft_token_ids, parent_row, num_nodes, row_target), counter.step

    on_device, device_reads = walk(on_device=True)
    on_cpu, _ = walk(on_device=False)
    levels = int(depth[walkers].max()) + 1
    # Nothing waits: no read, no pageable copy, options or not (depth + 1 = `levels` levels).
    assert device_reads.total == 0, (levels, device_reads.reads, device_reads.h2d)
    assert torch.equal(on_device.output_token_ids[walkers], on_cpu.output_token_ids[walkers])
    for b in walkers.tolist():
        n = int(num_nodes[b])
        expected = _reference_walk(logits, int(row_start[b]), parent_row[b, :n].tolist(),
                                   draft_token_ids[b, :n].tolist(), keys[b], int(tree_base[b]), temperature[b],
                                   None if "top_k" not in fields else int(fields["top_k"][b]),
                                   None if "top_p" not in fields else float(fields["top_p"][b]), options[b])
        assert on_device.output_token_ids[b, :len(expected)].tolist() == expected
        assert int(on_device.num_accepted[b]) == len(expected) - 1
    assert int(on_device.num_accepted[walkers].max()) >= 2  # the trees were walked, not only their roots
