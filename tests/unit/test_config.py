"""`"method": "gsd"` through vLLM's own config entry points: accepted, and refused by field name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_gsd.plugin import register  # noqa: E402
from vllm_gsd.testing.tiny_models import config_only_model  # noqa: E402

register()

from vllm.engine.arg_utils import EngineArgs  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cfg_models")
    return {
        "target": config_only_model(root / "target", 512),
        "draft": config_only_model(root / "draft", 512),
        "other_vocab": config_only_model(root / "other_vocab", 600),
    }


def engine_config(models, spec, **kwargs):
    args = EngineArgs(model=models["target"], skip_tokenizer_init=True,
                      speculative_config=spec, **kwargs)
    return args.create_engine_config()


def gsd_spec(models, **overrides):
    spec = {"method": "gsd", "model": models["draft"], "num_speculative_tokens": 16}
    spec.update(overrides)
    return spec


def test_gsd_config_is_accepted_with_defaults(models):
    cfg = engine_config(models, gsd_spec(models))
    spec = cfg.speculative_config
    assert spec.method == "gsd"
    assert spec.num_speculative_tokens == 16
    assert spec.draft_model_config.model == models["draft"]
    assert (spec.gsd.top_k, spec.gsd.max_depth, spec.gsd.merge_ngram) == (4, 6, 1)
    # GSD builds its tree on the host between steps and runs on the V1 runner.
    assert cfg.scheduler_config.async_scheduling is False
    assert cfg.use_v2_model_runner is False


def test_gsd_knobs_are_taken(models):
    knobs = {"top_k": 2, "max_depth": 3, "merge_ngram": -1, "min_child_ratio": 0.0,
             "leaf_prob": 0.25, "adaptive": True,
             "cost_curve": {"target": [(1, 0.1), (16, 0.2)], "draft": [(1, 0.03)]},
             "lookup_nodes": 3, "int8_draft_head": False, "draft_vocab": 32000}
    spec = engine_config(models, gsd_spec(models, gsd=knobs)).speculative_config
    assert spec.gsd.model_dump() == knobs


@pytest.mark.parametrize(
    ("gsd_block", "field"),
    [
        ({"top_k": 0}, "gsd.top_k"),
        ({"top_k": "four"}, "gsd.top_k"),
        ({"max_depth": 0}, "gsd.max_depth"),
        ({"max_depth": 10**6}, "gsd.max_depth"),
        ({"merge_ngram": -2}, "gsd.merge_ngram"),
        ({"min_child_ratio": 1.5}, "gsd.min_child_ratio"),
        ({"leaf_prob": 1.0}, "gsd.leaf_prob"),
        ({"width": 3}, "gsd.width"),
        ({"adaptive": "sometimes"}, "gsd.adaptive"),
        ({"int8_draft_head": "sometimes"}, "gsd.int8_draft_head"),
        ({"lookup_nodes": -1}, "gsd.lookup_nodes"),
        ({"lookup_nodes": 17}, "gsd.lookup_nodes"),
        ({"lookup_nodes": True}, "gsd.lookup_nodes"),
        ({"draft_vocab": -1}, "gsd.draft_vocab"),
        ({"draft_vocab": True}, "gsd.draft_vocab"),
        ({"top_k": True}, "gsd.top_k"),
        ({"leaf_prob": False}, "gsd.leaf_prob"),
        ({"cost_curve": {"target": [[0, 0.1]], "draft": [[1, 0.1]]}}, "gsd.cost_curve.target"),
        ({"cost_curve": {"target": [[1, -0.1]], "draft": [[1, 0.1]]}}, "gsd.cost_curve.target"),
        ({"cost_curve": {"target": [[1, 0.1]]}}, "gsd.cost_curve.draft"),
        ({"adaptive": False, "cost_curve": {"target": [[1, 0.1]], "draft": [[1, 0.1]]}}, "gsd"),
        ("deep", "gsd"),
    ],
)
def test_bad_knob_is_refused_by_name(models, gsd_block, field):
    with pytest.raises(Exception) as err:
        engine_config(models, gsd_spec(models, gsd=gsd_block))
    assert field in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "kwargs", "message"),
    [
        ({"num_speculative_tokens": 0}, {}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 129}, {}, "num_speculative_tokens"),
        ({"model": None}, {}, "speculative_config.model"),
        ({}, {"async_scheduling": True}, "async_scheduling"),
        ({"draft_tensor_parallel_size": 2}, {}, "draft_tensor_parallel_size"),
        # vLLM refuses them for speculative engines only once a worker builds them, by a
        # message naming neither gsd nor the setting.
        ({}, {"logits_processors": ["vllm.v1.sample.logits_processor:MinPLogitsProcessor"]},
         "custom logits processors (logits_processors)"),
    ],
)
def test_bad_speculative_config_is_refused_by_name(models, overrides, kwargs, message):
    with pytest.raises(Exception) as err:
        engine_config(models, gsd_spec(models, **overrides), **kwargs)
    assert message in str(err.value)


def test_draft_with_other_vocabulary_is_refused(models):
    with pytest.raises(Exception) as err:
        engine_config(models, gsd_spec(models, model=models["other_vocab"]))
    assert "vocabulary" in str(err.value) and "speculative_config.model" in str(err.value)


def test_gsd_target_has_the_chains_compile_key(models):
    """A first gsd start loads the target a draft_model engine compiled (and the chain gsd's):
    vLLM keys compiled models by this hash. A data-parallel flag the user sets is kept."""
    chain = {"method": "draft_model", "model": models["draft"], "num_speculative_tokens": 4}
    gsd = engine_config(models, gsd_spec(models))
    assert gsd.scheduler_config.async_scheduling is False
    assert gsd.compute_hash() == engine_config(models, chain).compute_hash()
    kept = engine_config(models, gsd_spec(models), disable_nccl_for_dp_synchronization=False)
    assert kept.parallel_config.disable_nccl_for_dp_synchronization is False


def test_gsd_block_needs_gsd_method(models):
    with pytest.raises(Exception) as err:
        engine_config(models, {"method": "draft_model", "model": models["draft"],
                               "num_speculative_tokens": 4, "gsd": {"top_k": 2}})
    assert "speculative_config.gsd" in str(err.value)


def test_other_methods_still_work(models):
    cfg = engine_config(models, {"method": "draft_model", "model": models["draft"],
                                 "num_speculative_tokens": 4})
    assert cfg.speculative_config.method == "draft_model"
    assert cfg.speculative_config.gsd is None


def test_cli_parser_takes_gsd_config(models):
    """The server's --speculative-config JSON goes through the same validation."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    spec = json.dumps(gsd_spec(models, gsd={"top_k": 3}))
    args = parser.parse_args(["--model", models["target"], "--skip-tokenizer-init",
                              "--speculative-config", spec])
    cfg = EngineArgs.from_cli_args(args).create_engine_config()
    assert cfg.speculative_config.method == "gsd" and cfg.speculative_config.gsd.top_k == 3


def test_plugin_loads_through_entry_point_in_a_fresh_process(models):
    """vLLM itself loads the plugin (entry point), in a process where we import nothing of ours."""
    code = (
        "from vllm.engine.arg_utils import EngineArgs\n"
        f"a = EngineArgs(model={models['target']!r}, skip_tokenizer_init=True, "
        f"speculative_config={gsd_spec(models)!r})\n"
        "print('METHOD', a.create_engine_config().speculative_config.method)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "METHOD gsd" in out.stdout, out.stderr[-2000:]


def _int8_draft(models, root, symmetric_activations: bool) -> str:
    from vllm_gsd.quantize_draft import quantization_config

    config = json.loads((Path(models["draft"]) / "config.json").read_text())
    config["quantization_config"] = quantization_config(symmetric_activations)
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    return str(root)


def test_an_int8_draft_the_cpu_cannot_run_is_refused_by_name(models, tmp_path, monkeypatch):
    """On CPUs with AMX tiles, vLLM 0.32's int8 GEMM for symmetric activations takes no float32:
    the engine refuses at start with what to change, instead of failing in its first forward."""
    import vllm_gsd.engine.config as gsd_config

    monkeypatch.setattr(gsd_config, "_cpu_has_amx_tiles", lambda: True)
    symmetric = _int8_draft(models, tmp_path / "symmetric", True)
    with pytest.raises(Exception) as err:
        engine_config(models, gsd_spec(models, model=symmetric), dtype="float32")
    assert "speculative_config.model" in str(err.value) and "bfloat16" in str(err.value)
    # What runs there: bfloat16, or activations with a zero point (oneDNN's GEMM).
    assert engine_config(models, gsd_spec(models, model=symmetric), dtype="bfloat16").speculative_config
    zero_point = _int8_draft(models, tmp_path / "zero_point", False)
    assert engine_config(models, gsd_spec(models, model=zero_point), dtype="float32").speculative_config
    # Without AMX tiles every CPU takes it (oneDNN).
    monkeypatch.setattr(gsd_config, "_cpu_has_amx_tiles", lambda: False)
    assert engine_config(models, gsd_spec(models, model=symmetric), dtype="float32").speculative_config


def _with_tokenizer(root: Path, model_dir: Path, tokenizer: dict) -> str:
    """A copy of `model_dir`'s config and tokenizer files with `tokenizer` as tokenizer.json."""
    root.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        (root / name).write_bytes((model_dir / name).read_bytes())
    (root / "tokenizer.json").write_text(json.dumps(tokenizer))
    return str(root)


def test_a_draft_with_the_targets_vocabulary_size_but_other_tokens_is_refused(tiny_target_path, tmp_path):
    """A draft whose tokenizer has as many tokens as the target's but maps ids to other tokens
    would propose ids the target reads as other tokens: accepted almost never. Here the target's
    own tokenizer with two tokens' ids swapped (same size, same config)."""
    target = Path(tiny_target_path)
    tokenizer = json.loads((target / "tokenizer.json").read_text())
    models = {"target": str(target), "draft": _with_tokenizer(tmp_path / "same", target, tokenizer)}
    assert engine_config(models, gsd_spec(models)).speculative_config.method == "gsd"
    vocab = tokenizer["model"]["vocab"]
    swapped = {i: token for token, i in vocab.items() if i in (300, 301)}
    vocab[swapped[300]], vocab[swapped[301]] = 301, 300
    other = _with_tokenizer(tmp_path / "swapped", target, tokenizer)
    with pytest.raises(Exception) as err:
        engine_config(models, gsd_spec(models, model=other))
    message = str(err.value)
    assert "speculative_config.model" in message and "tokenizer" in message
    assert f"id 300 is {swapped[300]!r} for the target and {swapped[301]!r} for the draft" in message
