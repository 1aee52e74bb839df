"""Write an int8 copy of a draft model that vLLM loads as it is (compressed-tensors W8A8).

Decoding on a CPU is bound by the bytes of weights each forward reads, and a speculative step
runs the draft once per level, so the draft's bytes are most of what speculation costs. This
copy stores every decoder-layer projection (q/k/v/o, gate/up/down) as int8 with one float32
scale per output channel; vLLM then quantizes activations per token on the fly and runs oneDNN's
int8 GEMM (CUTLASS on a GPU). Embeddings, norms and the LM head stay as they are. Only the
draft is quantized: the target verifies every token, so the output is the target's whatever the
draft proposes (greedy: identical; sampling: the target's distribution).

    .venv/bin/python scripts/quantize_draft.py SRC_DIR DST_DIR    (or: python -m vllm_gsd.quantize_draft)

SRC_DIR: a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files), e.g.
the draft `python -m scripts.prepare_models --pair qwen` writes (which also writes this copy of it). Pass DST_DIR as the draft, for GSD and
for vLLM's draft_model alike: `--speculative-config '{"method": "gsd", "model": "DST_DIR", ...}'`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

# Qwen2 / Llama-style decoder projections; anything else is copied unchanged.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of a [N, K] weight: (int8 [N, K], float32 scales [N, 1]), weight ~= q * scale."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale


def is_projection(name: str) -> bool:
    return name.endswith(".weight") and any(f".{p}." in name for p in PROJECTIONS)


def quantization_config(symmetric_activations: bool = True) -> dict:
    """The config.json entry vLLM's compressed-tensors loader reads: int8 per-channel weights,
    dynamic int8 per-token activations (symmetric, or with a zero point), on every Linear but
    the LM head."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    int8 = dict(num_bits=8, type="int")
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(**int8, symmetric=True, strategy="channel"),
        input_activations=QuantizationArgs(**int8, symmetric=symmetric_activations, strategy="token",
                                           dynamic=True),
    )
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format="int-quantized")
    return config.model_dump(exclude_none=True)


def quantize_checkpoint(src: Path, dst: Path, symmetric_activations: bool = True) -> int:
    """Write src's int8 copy to dst; return how many projections were quantized.

    Symmetric activations are what the fast kernels take: on CPUs with AMX tiles vLLM 0.32 runs
    them through its AMX int8 GEMM, which takes bfloat16 or float16 activations only (a float32
    model fails at start there, in vLLM, with or without speculation). Activations with a zero
    point run oneDNN's int8 GEMM on every CPU and in every dtype."""
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    if "quantization_config" in config:
        raise ValueError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')})")
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{src} has no *.safetensors weights")
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, dst / path.name)
    quantized, scale_shard = 0, {}
    for shard in shards:
        tensors = {}
        for name, tensor in load_file(shard).items():
            if is_projection(name):
                scale_name = name.removesuffix("weight") + "weight_scale"
                tensors[name], tensors[scale_name] = quantize_per_channel(tensor)
                scale_shard[scale_name] = shard.name
                quantized += 1
            else:
                tensors[name] = tensor
        save_file(tensors, dst / shard.name, metadata={"format": "pt"})
    if quantized == 0:
        raise ValueError(f"{src} has no {'/'.join(PROJECTIONS)} weights to quantize")
    index = dst / "model.safetensors.index.json"
    if index.exists():  # sharded: the scales' shards go into the weight map too
        contents = json.loads(index.read_text())
        contents["weight_map"].update(scale_shard)
        index.write_text(json.dumps(contents, indent=2))
    config["quantization_config"] = quantization_config(symmetric_activations)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return quantized


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--zero-point-activations", action="store_true",
                        help="quantize activations with a zero point (oneDNN's int8 GEMM on every CPU, float32 included)")
    args = parser.parse_args(argv)
    try:
        count = quantize_checkpoint(args.src, args.dst, symmetric_activations=not args.zero_point_activations)
    except ValueError as error:
        print(f"quantize_draft: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.dst}: {count} projections in int8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
