"""GSD's own figures, beside vLLM's speculative-decoding metrics.

vLLM already reports what the scheduler sees (drafts, draft tokens, accepted tokens, per-position
acceptance; for a tree the mean acceptance length is the figure that matters). What only the
worker knows is counted here, per worker process:

* `gsd_trees_verified`, `gsd_nodes_verified`, `gsd_accepted_nodes`: verification;
* `gsd_graph_nodes_drafted`, `gsd_merges`, `gsd_draft_expansions_saved`, `gsd_draft_tokens_computed`:
  drafting (draft tokens computed = catch-up tokens + one per expanded graph row);
* `gsd_paths_through_merge`: verified trees whose accepted path used a merged node;
* the adaptive node budget's choices: `gsd_steps_speculated` (steps that drafted), and
  `gsd_steps_not_speculated` (steps with tree candidates that it ran as plain decoding; of
  them `gsd_steps_vetoed` where the cost model predicted a gain and the wall-clock referee,
  correcting it with measured step times, found plain decoding faster),
  `gsd_levels_drafted` (draft forwards, catch-up included), `gsd_levels_not_paying` (levels a
  step was allowed but did not draft: its draft was too unsure for them to pay), `gsd_nodes_offered` (tree nodes
  drafted) and `gsd_nodes_proposed` (the nodes it chose to verify);
* whole decode steps as they ran (the referee's figures): `gsd_speculative_step_us` /
  `gsd_speculative_step_tokens` for steps that verified trees, `gsd_plain_step_us` /
  `gsd_plain_step_tokens` for the others, `gsd_speculative_steps_timed` /
  `gsd_plain_steps_timed` counting them;
* where a decode step's time goes (host wall time, microseconds, summed over the
  `gsd_decode_steps`, the steps whose target forward had no prompt tokens: a prefill's forwards
  would swamp the split and are not what speculation changes): `gsd_target_forward_us` (the
  runner's execute_model: input preparation, the target's forward and its LM head),
  `gsd_draft_step_us` (catch-up, levels and tree building; of which `gsd_draft_model_us` in the
  draft model's layers and `gsd_draft_logits_us` in its LM head), `gsd_verify_us` (the tree
  walk with its sampling) and `gsd_kv_compaction_us`.

They are exported as Prometheus counters `vllm:gsd_*` (the OpenAI server collects worker
processes through vLLM's multiprocess registry, so they appear on /metrics), logged every
`LOG_INTERVAL_S` seconds by the worker, and readable offline with `gsd_stats(llm)`.

Every tensor-parallel rank runs the drafter and the scorer on the same trees and counts the
same figures; /metrics sums the counters of every worker process, so only one rank of each
engine, tensor-parallel rank 0 (`exports`), adds to them and logs them. Every rank keeps its
figures (`gsd_stats` reads the first worker's).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from dataclasses import asdict, dataclass, fields

from vllm_gsd.engine import LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)

LOG_INTERVAL_S = 10.0


@dataclass
class GsdStats:
    steps: int = 0
    decode_steps: int = 0  # of which decodes only: the steps the *_us phase timers cover
    trees_verified: int = 0
    nodes_verified: int = 0
    accepted_nodes: int = 0
    paths_through_merge: int = 0
    graph_nodes_drafted: int = 0
    merges: int = 0
    draft_expansions_saved: int = 0
    draft_tokens_computed: int = 0
    steps_speculated: int = 0
    steps_not_speculated: int = 0
    steps_vetoed: int = 0  # of which the model would draft but the measured step times say plain
    speculative_step_us: int = 0  # whole steps (decodes only) that verified trees: wall time
    speculative_step_tokens: int = 0  # and the tokens they emitted
    plain_step_us: int = 0  # whole steps (decodes only) without trees
    plain_step_tokens: int = 0
    speculative_steps_timed: int = 0
    plain_steps_timed: int = 0
    levels_drafted: int = 0
    levels_not_paying: int = 0  # levels a step's depth allowed, left out as not expected to pay
    nodes_offered: int = 0
    nodes_proposed: int = 0
    lookup_nodes_proposed: int = 0  # of nodes_proposed: context-lookup nodes (engine/lookup.py)
    lookup_nodes_tried: int = 0  # verified lookup nodes whose parent the target accepted
    lookup_nodes_accepted: int = 0
    target_forward_us: int = 0
    draft_step_us: int = 0
    draft_model_us: int = 0
    draft_logits_us: int = 0
    verify_us: int = 0
    kv_compaction_us: int = 0

    def summary(self) -> str:
        trees = max(self.trees_verified, 1)
        return (
            f"GSD metrics: trees verified: {self.trees_verified}, nodes per tree: "
            f"{self.nodes_verified / trees:.1f}, accepted nodes per tree: "
            f"{self.accepted_nodes / trees:.2f}, graph nodes drafted: {self.graph_nodes_drafted}, "
            f"merges: {self.merges}, draft expansions saved: {self.draft_expansions_saved}, "
            f"accepted paths through a merge: {100.0 * self.paths_through_merge / trees:.1f}%, "
            f"draft tokens computed: {self.draft_tokens_computed}, steps drafted / plain: "
            f"{self.steps_speculated} / {self.steps_not_speculated}, draft forwards / levels left out "
            f"as not paying: {self.levels_drafted} / {self.levels_not_paying}, nodes proposed / offered: "
            f"{self.nodes_proposed} / {self.nodes_offered}, context-lookup nodes proposed / tried / "
            f"accepted: {self.lookup_nodes_proposed} / {self.lookup_nodes_tried} / {self.lookup_nodes_accepted}"
        )


PHASE_TIMERS = frozenset(("target_forward_us", "draft_step_us", "draft_model_us", "draft_logits_us",
                          "verify_us", "kv_compaction_us"))


def decodes_only(scheduler_output) -> bool:
    """Every request of the step decoded (its root plus its draft tokens, no prompt tokens)."""
    spec = scheduler_output.scheduled_spec_decode_tokens
    return all(n == 1 + len(spec.get(r, ())) for r, n in scheduler_output.num_scheduled_tokens.items())


class GsdMetrics:
    """Accumulates GsdStats in a worker and, where `exports` (one rank of the engine: see the
    module's docstring), exports and logs them. A step runs from the runner's execute_model
    (`begin_step`) to the drafter's `step_done`."""

    def __init__(self, exports: bool = True) -> None:
        self.exports = exports
        self.stats = GsdStats()
        self._counters = None
        self._exported = GsdStats()
        self._last_log = time.monotonic()
        self._decode_step = True

    def begin_step(self, scheduler_output) -> None:
        self._decode_step = decodes_only(scheduler_output)

    @property
    def decode_step(self) -> bool:
        """Whether the step now running decodes only (its phase timers count)."""
        return self._decode_step

    def add(self, decode_step: bool | None = None, **increments: int) -> None:
        """Add to the figures; phase timers only for a decode step: this one, or the step
        `decode_step` says of a time measured later (a CUDA-timed forward)."""
        decode = self._decode_step if decode_step is None else decode_step
        for name, value in increments.items():
            if name in PHASE_TIMERS and not decode:
                continue
            setattr(self.stats, name, getattr(self.stats, name) + int(value))

    def step_done(self) -> None:
        self.stats.steps += 1
        self.stats.decode_steps += self._decode_step
        if not self.exports:
            return
        self._export()
        now = time.monotonic()
        if now - self._last_log >= LOG_INTERVAL_S and self.stats.trees_verified:
            self._last_log = now
            logger.info(self.stats.summary())

    def _export(self) -> None:
        counters = self._prometheus_counters()
        if counters is None:
            return
        for field in fields(GsdStats):
            delta = getattr(self.stats, field.name) - getattr(self._exported, field.name)
            if delta:
                counters[field.name].inc(delta)
        self._exported = copy.copy(self.stats)  # flat ints: asdict's deep copy is 10x slower

    def _prometheus_counters(self):
        if self._counters is None:
            self._counters = _process_counters()
        return self._counters or None


_COUNTERS: dict | None = None


def _process_counters() -> dict:
    """The Prometheus counters of this process, made once: a second gsd engine in one process
    (vLLM's in-process engine core) adds to them, as vLLM's own counters do."""
    global _COUNTERS
    if _COUNTERS is None:
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if directory is not None and not os.path.isdir(directory):
            # A Ray worker on another node than the server gets the driver's path
            # (vllm_v0_32/ray_env.py): prometheus_client would fail writing the counters there.
            logger.warning("gsd: PROMETHEUS_MULTIPROC_DIR=%s is not a directory on this node; this "
                           "worker does not export the vllm:gsd_* counters", directory)
            _COUNTERS = {}
            return _COUNTERS
        try:
            from prometheus_client import Counter
        except ImportError:  # pragma: no cover - vLLM depends on prometheus_client
            _COUNTERS = {}
            return _COUNTERS
        _COUNTERS = {f.name: Counter(f"vllm:gsd_{f.name}", f"GSD: {f.name.replace('_', ' ')}")
                     for f in fields(GsdStats)}
    return _COUNTERS


def worker_gsd_stats(worker) -> dict:
    """The worker's figures as a dict (installed as the worker method `gsd_stats`)."""
    state = getattr(worker.model_runner, "gsd", None)  # None: not a gsd engine
    return asdict(state.metrics.stats) if state is not None else {}


def gsd_stats(llm) -> GsdStats:
    """GSD figures of an offline `vllm.LLM` (from its first worker)."""
    per_worker = llm.collective_rpc("gsd_stats")
    return GsdStats(**per_worker[0]) if per_worker and per_worker[0] else GsdStats()
