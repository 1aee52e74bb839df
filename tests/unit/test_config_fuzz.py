"""Fuzzing the speculative config through vLLM's own entry point (EngineArgs.create_engine_config).

Any `gsd` block and node budget either build a config whose values are in range, or fail at start
with a ValueError (pydantic's ValidationError is one) that names every offending field; never an
exception of another kind from deep inside vLLM. Every accepted block also drafts a graph with the
worker's own GraphParams / GraphBuilder (tests/engine/test_gsd_faults.py runs a request at the
extreme corner of the accepted space).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_gsd.plugin import register

register()

from vllm.engine.arg_utils import EngineArgs  # noqa: E402

from vllm_gsd.engine.config import MAX_NODE_BUDGET  # noqa: E402
from vllm_gsd.graph import GraphBuilder  # noqa: E402
from vllm_gsd.testing.tiny_models import config_only_model  # noqa: E402

INT_KNOBS = {"top_k": (1, 16), "max_depth": (1, 32), "merge_ngram": (-1, 8)}
FLOAT_KNOBS = {"min_child_ratio": (0.0, 1.0, True), "leaf_prob": (0.0, 1.0, False)}  # (lo, hi, hi allowed)
UNKNOWN_KNOBS = ("width", "topk", "depth", "node_budget", "")
VALID, INVALID, EITHER = "valid", "invalid", "either"  # EITHER: pydantic may coerce ("3", 3.0)

garbage = st.one_of(
    st.integers(min_value=-10**30, max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=6),
    st.sampled_from(["3", "0.5", "1e3", " 4 ", "nan", "inf"]),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz_models")
    return {"target": config_only_model(root / "target", 512), "draft": config_only_model(root / "draft", 512)}


def build(models, spec):
    return EngineArgs(model=models["target"], skip_tokenizer_init=True,
                      speculative_config=spec).create_engine_config()


def _classify_int(value, lo: int, hi: int) -> str:
    if isinstance(value, bool):
        return INVALID  # refused by name: true is not the number 1
    if isinstance(value, float) and value.is_integer():
        return EITHER
    if isinstance(value, int):
        return VALID if lo <= value <= hi else INVALID
    if isinstance(value, str):
        try:
            return EITHER if lo <= int(value.strip()) <= hi else INVALID
        except ValueError:
            return EITHER if value.strip() else INVALID
    return INVALID  # None, lists, dicts, non-integral or non-finite floats


def _classify_float(value, lo: float, hi: float, hi_closed: bool) -> str:
    if isinstance(value, bool):
        return INVALID
    if isinstance(value, str):
        return EITHER
    if isinstance(value, (int, float)):
        if math.isnan(value) or not lo <= value <= hi or (value == hi and not hi_closed):
            return INVALID
        return VALID
    return INVALID


def classify(block: dict) -> dict[str, str]:
    out = {}
    for name, value in block.items():
        if name in INT_KNOBS:
            out[name] = _classify_int(value, *INT_KNOBS[name])
        elif name in FLOAT_KNOBS:
            out[name] = _classify_float(value, *FLOAT_KNOBS[name])
        else:
            out[name] = INVALID  # unknown knob
    return out


def assert_refused_naming(err: BaseException, fields: list[str]) -> None:
    assert isinstance(err, ValueError), f"{type(err).__module__}.{type(err).__name__}: {err}"
    assert any(field in str(err) for field in fields), f"none of {fields} named in: {err}"


def assert_drafts_a_graph(spec) -> None:
    """What the worker does with the knobs (engine/proposer.py): GraphParams, then every level of
    a GraphBuilder on random draft probabilities, then the tree within the node budget."""
    knobs = spec.gsd
    params = knobs.graph_params(spec.num_speculative_tokens)
    generator = torch.Generator().manual_seed(0)
    history = torch.randint(0, 50, (2, max(knobs.merge_ngram, 0)), generator=generator)
    builder = GraphBuilder(params, torch.tensor([3, 7]), history)
    while (frontier := builder.frontier()) is not None:
        probs = torch.rand(frontier.request_index.numel(), 50, generator=generator).softmax(-1)
        top_probs, top_tokens = probs.topk(knobs.top_k, dim=-1)
        builder.expand(top_tokens, top_probs)
    tree = builder.build_tree()
    assert (tree.num_nodes <= spec.num_speculative_tokens).all()


knob_values = st.one_of(st.integers(-3, 40), st.floats(-0.5, 1.5), garbage)
gsd_blocks = st.dictionaries(st.sampled_from([*INT_KNOBS, *FLOAT_KNOBS, *UNKNOWN_KNOBS]), knob_values,
                             max_size=4)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(block=gsd_blocks)
def test_any_gsd_block_is_taken_in_range_or_refused_by_field(models, block):
    spec = {"method": "gsd", "model": models["draft"], "num_speculative_tokens": 16, "gsd": block}
    kinds = classify(block)
    invalid = [name for name, kind in kinds.items() if kind == INVALID]
    try:
        cfg = build(models, spec)
    except Exception as err:  # noqa: BLE001 - the kind of exception is what is tested
        assert invalid or EITHER in kinds.values(), f"valid block {block} refused: {err}"
        assert_refused_naming(err, [f"gsd.{name}" for name in (invalid or kinds)])
        for name in invalid:  # pydantic reports every offending field
            assert f"gsd.{name}" in str(err)
        return
    assert not invalid, f"{block} accepted although {invalid} are out of range"
    knobs = cfg.speculative_config.gsd
    for name, kind in kinds.items():
        value = getattr(knobs, name)
        if kind == VALID:
            assert value == block[name]
        lo, hi = (INT_KNOBS.get(name) or FLOAT_KNOBS[name])[:2]
        assert lo <= value <= hi and isinstance(value, int if name in INT_KNOBS else float)
    assert_drafts_a_graph(cfg.speculative_config)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(budget=st.one_of(st.integers(-5, 3 * MAX_NODE_BUDGET), garbage),
       extra=st.dictionaries(st.sampled_from(["draft", "nodes", "gsd_block", "num_nodes"]), garbage, max_size=2))
def test_any_node_budget_and_unknown_keys_are_taken_or_refused_by_field(models, budget, extra):
    spec = {"method": "gsd", "model": models["draft"], "num_speculative_tokens": budget, **extra}
    # num_speculative_tokens is vLLM's own field: its pydantic schema reads true as 1 before any
    # plugin sees the value, for every method, so a boolean there may be taken.
    kind = EITHER if isinstance(budget, bool) else _classify_int(budget, 1, MAX_NODE_BUDGET)
    try:
        cfg = build(models, spec)
    except Exception as err:  # noqa: BLE001
        assert extra or kind != VALID, f"valid budget {budget!r} refused: {err}"
        assert_refused_naming(err, ["num_speculative_tokens", *extra])
        for name in extra:
            assert name in str(err)
        return
    assert not extra and kind != INVALID
    assert 1 <= cfg.speculative_config.num_speculative_tokens <= MAX_NODE_BUDGET
    assert_drafts_a_graph(cfg.speculative_config)


@pytest.mark.parametrize("draft", ["missing", "empty_dir", "not_a_model_file"])
def test_a_draft_that_cannot_be_loaded_is_refused_by_field(models, tmp_path, draft):
    path = tmp_path / draft
    if draft == "empty_dir":
        path.mkdir()
    elif draft == "not_a_model_file":
        path.write_text("not a model\n")
    with pytest.raises(ValueError) as err:
        build(models, {"method": "gsd", "model": str(path), "num_speculative_tokens": 8})
    assert "speculative_config.model" in str(err.value) and str(path) in str(err.value)


def test_a_draft_with_another_vocabulary_is_refused_by_field(models, tiny_other_vocab_path):
    with pytest.raises(ValueError) as err:
        build(models, {"method": "gsd", "model": str(tiny_other_vocab_path), "num_speculative_tokens": 8})
    assert "speculative_config.model" in str(err.value) and "vocabulary" in str(err.value)


def test_the_server_command_line_refuses_a_bad_block_before_starting(models):
    """`vllm serve --speculative-config` goes through the same validation: no engine starts."""
    import json
    import subprocess
    import sys

    spec = json.dumps({"method": "gsd", "model": models["draft"], "num_speculative_tokens": 8,
                       "gsd": {"top_k": 99}})
    vllm = os.path.join(os.path.dirname(sys.executable), "vllm")
    out = subprocess.run([vllm, "serve", models["target"], "--skip-tokenizer-init",
                          "--speculative-config", spec], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "gsd.top_k" in out.stderr + out.stdout
    assert "EngineCore" not in out.stderr + out.stdout
