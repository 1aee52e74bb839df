"""The `gsd` block of `--speculative-config`, and what "method": "gsd" means to vLLM's config.

User-facing contract::

    speculative_config = {
        "method": "gsd",
        "model": DRAFT,                    # a causal LM sharing the target's vocabulary
        "num_speculative_tokens": 24,      # node budget N: most draft nodes verified per request per step
        "gsd": {"top_k": 4, "max_depth": 6, "merge_ngram": 1,
                "min_child_ratio": 0.2, "leaf_prob": 0.05,
                "lookup_nodes": 2,          # nodes past the deepest leaf from the context's own n-grams
                "adaptive": True,           # node budget and depth chosen per step by load
                "cost_curve": None,         # measured at start-up, or {"target": [[q, s], ...], "draft": ...}
                "int8_draft_head": True,    # CPU: the draft's LM head from an int8 copy of its weight
                "draft_vocab": 100000},     # ... scoring the first 100000 token ids and the context's
    }

`GsdConfig` validates the block (pydantic: every bad value fails with the field's name and its
allowed range). `finalize_gsd_speculative_config` runs inside `SpeculativeConfig.__post_init__`
(see vllm_v0_32/patches.py) and checks what only the whole config can tell: the node budget, the
draft's vocabulary, the draft's tensor parallelism, an int8 draft the CPU's kernels cannot run.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, field_validator, model_validator

from vllm_gsd.engine import LOGGER_NAME

if TYPE_CHECKING:
    from vllm.config import SpeculativeConfig

    from vllm_gsd.graph.params import GraphParams

logger = logging.getLogger(LOGGER_NAME)

GSD_METHOD = "gsd"

# vLLM 0.32's scheduler and runner size per-request speculative buffers by
# num_speculative_tokens; 128 is the largest budget its V1 sampler plumbing accepts.
MAX_NODE_BUDGET = 128


CostPoints = list[tuple[PositiveInt, PositiveFloat]]


class CostCurveConfig(BaseModel):
    """Measured forward times, `[[query tokens, seconds], ...]`, of the target and the draft."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: CostPoints = Field(min_length=1)
    draft: CostPoints = Field(min_length=1)

    @model_validator(mode="after")
    def _distinct_token_counts(self) -> CostCurveConfig:
        for name in ("target", "draft"):
            counts = [q for q, _ in getattr(self, name)]
            if len(set(counts)) != len(counts):
                raise ValueError(f"cost_curve.{name}: each query-token count may appear once, got {counts}")
        return self


class GsdConfig(BaseModel):
    """Knobs of the hypothesis graph (see vllm_gsd.graph.GraphParams for their meaning)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    top_k: int = Field(default=4, ge=1, le=16)
    """Children proposed per expanded node (1 = a chain, as plain speculative decoding)."""
    max_depth: int = Field(default=6, ge=1, le=32)
    """Draft steps: levels of the graph, i.e. the longest hypothesis."""
    merge_ngram: int = Field(default=1, ge=-1, le=8)
    """r of the merge rule: a child merges into an existing node with the same token whose r
    preceding tokens match; 0 = same token anywhere; -1 disables merging (a plain tree)."""
    min_child_ratio: float = Field(default=0.2, ge=0.0, le=1.0)
    """Sibling pruning: keep child j only if p_j >= min_child_ratio * p_top1."""
    leaf_prob: float = Field(default=0.05, ge=0.0, lt=1.0)
    """A node whose draft probability is below this is verified but not expanded."""
    adaptive: bool = True
    """Choose per step whether to draft, how deep, and how many nodes to verify, from the number of
    running requests and the cost curves (vllm_gsd.policy); False = always draft max_depth
    levels and verify up to the node budget."""
    cost_curve: CostCurveConfig | None = None
    """Forward times by query tokens for the adaptive budget; None = measured at start-up."""
    lookup_nodes: int = Field(default=2, ge=0, le=16)
    """Context lookup (vllm_gsd.engine.lookup): at most this many nodes past a tree's deepest
    leaf, the tokens that followed the first earlier occurrence of its last n-gram in the
    request's own tokens; no draft forward computes them. 0 disables it."""
    int8_draft_head: bool = True
    """On a CPU, run the draft's LM head from an int8 copy of its weight (engine/draft_head.py):
    half the bytes a draft level reads there. Only proposals change; the target verifies."""
    draft_vocab: int = Field(default=100000, ge=0)
    """With the int8 head: the draft scores only the vocabulary's first draft_vocab token ids (BPE
    merge order, which follows frequency) plus the ids in each request's own tokens and its stop
    tokens (engine/draft_head.py). 0 = the whole vocabulary. Only proposals change."""

    def graph_params(self, node_budget: int) -> GraphParams:
        """The graph core's parameters for these knobs and node budget N. The graph core is
        imported here, where a gsd worker builds its drafter: it loads numba (and llvmlite), which
        loading the plugin, in every process vLLM starts, must not."""
        from vllm_gsd.graph.params import GraphParams

        return GraphParams(node_budget=node_budget, top_k=self.top_k, max_depth=self.max_depth,
                           merge_ngram=self.merge_ngram, min_child_ratio=self.min_child_ratio,
                           leaf_prob=self.leaf_prob)

    @model_validator(mode="after")
    def _cost_curve_needs_adaptive(self) -> GsdConfig:
        if self.cost_curve is not None and not self.adaptive:
            raise ValueError("cost_curve is only used with adaptive=true (the load-adaptive node budget)")
        return self

    @model_validator(mode="before")
    @classmethod
    def _reject_non_mapping(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, (dict, GsdConfig)):
            raise ValueError(
                f"the 'gsd' block must be a JSON object of graph knobs, got {type(value).__name__}"
            )
        return value

    @field_validator("top_k", "max_depth", "merge_ngram", "min_child_ratio", "leaf_prob", "lookup_nodes",
                     "draft_vocab", mode="before")
    @classmethod
    def _reject_booleans(cls, value: Any) -> Any:
        # pydantic reads true as 1: a boolean where a number belongs is a mistake, not a value.
        if isinstance(value, bool):
            raise ValueError(f"must be a number, got {str(value).lower()}")
        return value


def finalize_gsd_speculative_config(spec: SpeculativeConfig) -> None:
    """Validate a SpeculativeConfig whose method is "gsd", after vLLM built its draft config.

    Raises ValueError naming the offending field.
    """
    if spec.gsd is None:
        spec.gsd = GsdConfig()
    elif isinstance(spec.gsd, dict):  # replace() of an unvalidated instance
        spec.gsd = GsdConfig(**spec.gsd)
    node_budget = spec.num_speculative_tokens
    if node_budget is None:
        raise ValueError(
            "speculative_config.num_speculative_tokens (the GSD node budget) is required "
            f"for method 'gsd': an integer in [1, {MAX_NODE_BUDGET}]"
        )
    if not 1 <= node_budget <= MAX_NODE_BUDGET:
        raise ValueError(
            "speculative_config.num_speculative_tokens (the GSD node budget) must be in "
            f"[1, {MAX_NODE_BUDGET}] for method 'gsd', got {node_budget}"
        )
    if spec.model is None:
        raise ValueError("speculative_config.model (the draft model) is required for method 'gsd'")
    if spec.parallel_drafting:
        raise ValueError("speculative_config.parallel_drafting is not supported by method 'gsd'")
    if spec.use_heterogeneous_vocab:
        raise ValueError(
            "speculative_config.use_heterogeneous_vocab is not supported by method 'gsd': "
            "the draft must share the target's vocabulary"
        )
    target, draft = spec.target_model_config, spec.draft_model_config
    if target is not None and draft is not None:
        target_vocab, draft_vocab = target.get_vocab_size(), draft.get_vocab_size()
        if target_vocab != draft_vocab:
            raise ValueError(
                f"speculative_config.model: the draft's vocabulary ({draft_vocab} tokens) differs "
                f"from the target's ({target_vocab} tokens); method 'gsd' needs a draft that "
                "shares the target's tokenizer"
            )
        difference = tokenizer_difference(
            TokenizerSource(str(target.tokenizer), target.tokenizer_revision, target.tokenizer_mode,
                            bool(target.trust_remote_code)),
            TokenizerSource(str(spec.model), spec.revision, target.tokenizer_mode,
                            bool(target.trust_remote_code)))
        if difference is not None:
            raise ValueError(
                f"speculative_config.model: the draft's tokenizer ({spec.model}) is not the target's "
                f"({target.tokenizer}): {difference}; method 'gsd' needs a draft that shares the "
                "target's tokenizer (the target verifies the draft's token ids)"
            )
    if target is not None and target.logprobs_mode != "raw_logprobs":
        raise ValueError(
            f"logprobs_mode={target.logprobs_mode!r} is not supported with speculative method "
            "'gsd' (it reports raw logprobs along the accepted path); use 'raw_logprobs'"
        )
    if draft is not None and _cpu_has_amx_tiles():
        refusal = amx_int8_refusal(draft.dtype, getattr(draft.hf_config, "quantization_config", None))
        if refusal is not None:
            raise ValueError(f"speculative_config.model: {refusal}")
    target_tp = spec.target_parallel_config.tensor_parallel_size if spec.target_parallel_config else 1
    if spec.draft_tensor_parallel_size not in (None, target_tp):
        raise ValueError(
            "speculative_config.draft_tensor_parallel_size must equal the target's "
            f"tensor_parallel_size ({target_tp}) for method 'gsd', got {spec.draft_tensor_parallel_size}"
        )


class TokenizerSource(NamedTuple):
    """Where a tokenizer is loaded from (vLLM's get_tokenizer arguments)."""

    path: str
    revision: str | None
    mode: str
    trust_remote_code: bool


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tekken.json")
DIFFERENCES_NAMED = 3


@functools.lru_cache(maxsize=16)
def tokenizer_difference(target: TokenizerSource, draft: TokenizerSource) -> str | None:
    """What differs between the target's tokenizer and the one beside the draft model: the token
    ids that name other tokens, ids added to either tokenizer (special and chat tokens, which a
    base draft of a chat target may lack or name otherwise) left aside. None where they agree,
    or where either cannot be loaded (a local model directory without tokenizer files, a hub
    model out of reach): the vocabulary sizes are all that is checked there. Loaded once per
    process and pair."""
    vocabularies = [_vocabulary(source) for source in (target, draft)]
    if None in vocabularies:
        return None
    (target_tokens, target_added), (draft_tokens, draft_added) = vocabularies
    differing = sorted(i for i in target_tokens.keys() & draft_tokens.keys()
                       if target_tokens[i] != draft_tokens[i] and i not in target_added | draft_added)
    if not differing:
        return None
    named = ", ".join(f"id {i} is {target_tokens[i]!r} for the target and {draft_tokens[i]!r} for the draft"
                      for i in differing[:DIFFERENCES_NAMED])
    return f"{len(differing)} token ids name other tokens ({named})"


def _vocabulary(source: TokenizerSource) -> tuple[dict[int, str], set[int]] | None:
    """id -> token of the tokenizer at `source`, and the ids of its added tokens; None where it
    cannot be loaded."""
    local = Path(source.path)
    if local.is_dir() and not any((local / name).exists() for name in TOKENIZER_FILES):
        return None
    try:
        from vllm.tokenizers.registry import get_tokenizer

        tokenizer = get_tokenizer(source.path, tokenizer_mode=source.mode, revision=source.revision,
                                  trust_remote_code=source.trust_remote_code)
        tokens = {i: token for token, i in tokenizer.get_vocab().items()}
        added = set(tokenizer.get_added_vocab().values()) | set(tokenizer.all_special_ids)
    except Exception as exc:  # noqa: BLE001 - any loader failure: the size check stands alone
        logger.debug("gsd: no tokenizer loaded from %s to compare vocabularies (%s)", source.path, exc)
        return None
    return tokens, added


def amx_int8_refusal(dtype: Any, quantization_config: dict | None) -> str | None:
    """Why vLLM 0.32 cannot run a draft of this dtype and quantization on an x86 CPU with AMX
    tiles, or None. There its int8 GEMM for symmetric activations (compressed-tensors W8A8, as
    scripts/quantize_draft.py writes by default) takes bfloat16 or float16 activations only: a
    float32 draft fails inside vLLM's first forward, with the draft_model method too."""
    import torch

    if dtype != torch.float32 or not isinstance(quantization_config, dict):
        return None
    if quantization_config.get("quant_method") != "compressed-tensors":
        return None
    for group in (quantization_config.get("config_groups") or {}).values():
        activations = (group or {}).get("input_activations") or {}
        if activations.get("num_bits") == 8 and activations.get("type") == "int" and activations.get("symmetric"):
            return ("an int8 (W8A8) draft with symmetric activations cannot run in float32 on a CPU with AMX "
                    "tiles: vLLM's AMX int8 GEMM takes bfloat16 or float16 activations. Use dtype bfloat16, "
                    "or a draft whose activations carry a zero point (scripts/quantize_draft.py "
                    "--zero-point-activations)")
    return None


def _cpu_has_amx_tiles() -> bool:
    import torch
    from vllm.platforms import current_platform

    return current_platform.is_cpu() and torch.cpu._is_amx_tile_supported()


def is_gsd(spec: Any) -> bool:
    return spec is not None and getattr(spec, "method", None) == GSD_METHOD
