"""Which layers' CPU cache packing GSD pins (vllm_v0_32/runner/setup_hooks.py `_pin_draft_cache_packing`):
the draft's, to the portable "vec", where the runner gave its layers attention groups of their
own; nothing where a group mixes target and draft layers, since every builder of a layer must
read the packing its cache is written in (tests/kernels check each packing against vLLM's)."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_gsd.vllm_v0_32.runner.setup_hooks import _pin_draft_cache_packing

TARGET = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
DRAFT = [f"draft_model.model.layers.{i}.self_attn.attn" for i in range(2)]


class Builder:
    def __init__(self):
        self.pinned = False

    def pin_portable_packing(self):
        self.pinned = True


def group(layer_names):
    return SimpleNamespace(layer_names=list(layer_names), metadata_builders=[Builder()])


def runner(runner_groups, drafter_groups):
    return SimpleNamespace(attn_groups=[runner_groups],
                           drafter=SimpleNamespace(_draft_attn_layer_names=set(DRAFT),
                                                   draft_attn_groups=drafter_groups))


def pinned(groups):
    return [g.metadata_builders[0].pinned for g in groups]


def test_the_drafts_own_groups_are_pinned_and_the_targets_are_not():
    target, draft = group(TARGET), group(DRAFT)
    drafters = [group(DRAFT[:1])]  # vLLM's drafter builds its group on its first layer's name
    _pin_draft_cache_packing(runner([target, draft], drafters))
    assert pinned([target, draft] + drafters) == [False, True, True]


def test_a_group_shared_with_the_target_pins_nothing():
    shared = group(TARGET + DRAFT)
    drafters = [group(DRAFT[:1])]
    _pin_draft_cache_packing(runner([shared], drafters))
    assert pinned([shared] + drafters) == [False, False]


def test_draft_layers_split_over_a_shared_and_an_own_group_pin_nothing():
    mixed, own = group(TARGET + DRAFT[:1]), group(DRAFT[1:])
    drafters = [group(DRAFT[:1])]
    _pin_draft_cache_packing(runner([mixed, own], drafters))
    assert pinned([mixed, own] + drafters) == [False, False, False]
