"""The int8 draft copy: per-channel weights within half a step of the original, everything else
unchanged, and a config.json that vLLM's own compressed-tensors loader reads as W8A8 int8."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from vllm_gsd.quantize_draft import quantization_config, quantize_checkpoint, quantize_per_channel


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 37), cols=st.integers(1, 53), seed=st.integers(0, 2**31 - 1),
       zero_row=st.booleans())
def test_per_channel_int8_is_within_half_a_step(rows, cols, seed, zero_row):
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    if zero_row:
        weight[0] = 0
    q, scale = quantize_per_channel(weight)
    assert q.dtype == torch.int8 and scale.shape == (rows, 1) and scale.dtype == torch.float32
    assert int(q.abs().max()) <= 127
    error = (q.float() * scale - weight.float()).abs()
    assert bool((error <= scale / 2 + 1e-6).all())
    if zero_row:
        assert bool((q[0] == 0).all())


def _checkpoint(root):
    root.mkdir()
    tensors = {
        "model.embed_tokens.weight": torch.randn(11, 8, dtype=torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, dtype=torch.bfloat16),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(8, dtype=torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": torch.randn(8, 12, dtype=torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.ones(8, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(11, 8, dtype=torch.bfloat16),
    }
    save_file(tensors, root / "model.safetensors")
    (root / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    (root / "tokenizer.json").write_text("{}")
    return tensors


def test_checkpoint_quantizes_projections_only(tmp_path):
    original = _checkpoint(tmp_path / "src")
    assert quantize_checkpoint(tmp_path / "src", tmp_path / "dst") == 2
    written = load_file(tmp_path / "dst" / "model.safetensors")
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        assert written[name].dtype == torch.int8
        scale = written[name.removesuffix("weight") + "weight_scale"]
        assert torch.allclose(written[name].float() * scale, original[name].float(), atol=float(scale.max()))
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.bias",
                 "model.layers.0.input_layernorm.weight", "lm_head.weight"):
        assert torch.equal(written[name], original[name])
    assert (tmp_path / "dst" / "tokenizer.json").read_text() == "{}"
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"


@pytest.mark.parametrize("symmetric_activations", [True, False])
def test_vllm_reads_the_config_as_dynamic_w8a8_int8(symmetric_activations):
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import CompressedTensorsW8A8Int8

    config = CompressedTensorsConfig.from_config(quantization_config(symmetric_activations))
    scheme = config.get_scheme(torch.nn.Linear(8, 8), layer_name="model.layers.0.mlp.down_proj")
    assert isinstance(scheme, CompressedTensorsW8A8Int8)
    assert not scheme.is_static_input_scheme
    assert scheme.input_symmetric == symmetric_activations
    assert "lm_head" in config.ignore


def test_refuses_what_it_cannot_quantize(tmp_path):
    _checkpoint(tmp_path / "src")
    quantize_checkpoint(tmp_path / "src", tmp_path / "int8")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(tmp_path / "int8", tmp_path / "again")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        quantize_checkpoint(tmp_path / "empty", tmp_path / "out")
