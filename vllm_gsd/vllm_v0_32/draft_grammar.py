"""The draft's copy of each structured-output request's grammar, in the worker.

vLLM keeps a request's grammar in the scheduler's structured-output manager, which masks the
target's rows (vllm_v0_32/scheduler_hooks.py). The draft runs in the workers, which may be
other processes (tensor parallelism, Ray), so each worker compiles its own copy with vLLM's
own manager and backend (`StructuredOutputManager.grammar_init`, compiled in the manager's
threads: until it is ready, the request drafts unconstrained), follows the request's committed
output with it, and masks the draft's rows with the grammar's state after each row's path
(engine/tree_grammar.fill_path_bitmasks). The draft's children are then tokens the grammar
allows, so no node is spent on a token the scheduler would cut.

This decides only what is proposed: what is accepted stays the scheduler's grammar's and the
target's. An engine with a reasoning parser constrains from where reasoning ends, which the
scheduler decides: there the draft proposes unconstrained, as it does for a request whose
grammar failed to compile or whose output the copy could not follow.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import torch

from vllm_gsd.engine.staging import HostStaging
from vllm_gsd.engine.tree_grammar import fill_path_bitmasks


class DraftGrammars:
    """Per request id, the draft's copy of its grammar (made on first sight)."""

    def __init__(self, vllm_config) -> None:
        self._vllm_config = vllm_config
        self._manager = None  # vLLM's StructuredOutputManager, made for the first grammar
        self._grammars: dict[str, RequestGrammar] = {}
        self.enabled = (not vllm_config.structured_outputs_config.reasoning_parser
                        and not vllm_config.model_config.skip_tokenizer_init)

    def of(self, req_id: str, params, output_token_ids: Sequence[int]) -> RequestGrammar | None:
        """The request's grammar, caught up with its committed output; None if it has none, or
        none the draft can follow now."""
        if not self.enabled or params is None or params.structured_outputs is None:
            return None
        grammar = self._grammars.get(req_id)
        if grammar is None:
            grammar = self._grammars[req_id] = RequestGrammar(self._manager_for_grammars(), req_id, params)
        return grammar if grammar.catch_up(output_token_ids) else None

    def forget(self, req_ids) -> None:
        for req_id in req_ids:
            self._grammars.pop(req_id, None)

    def _manager_for_grammars(self):
        if self._manager is None:
            from vllm.v1.structured_output import StructuredOutputManager

            self._manager = StructuredOutputManager(self._vllm_config)
        return self._manager


class RequestGrammar:
    """One request's grammar as the draft follows it (engine/tree_grammar.PathGrammar)."""

    def __init__(self, manager, req_id: str, params) -> None:
        from vllm.v1.structured_output.request import StructuredOutputRequest

        self._req_id = req_id
        self._request = SimpleNamespace(request_id=req_id, sampling_params=params,
                                        structured_output_request=StructuredOutputRequest.from_sampling_params(params))
        self._backend = None
        self._followed = 0  # committed output tokens the grammar has accepted
        self._usable = self._request.structured_output_request is not None
        if self._usable:
            manager.grammar_init(self._request)  # compiles in the manager's threads
            self._backend = manager.backend

    def catch_up(self, output_token_ids: Sequence[int]) -> bool:
        """Accept the output committed since the last step; False while the grammar compiles,
        and for good if it failed or refuses the output (it then no longer constrains)."""
        if not self._usable:
            return False
        grammar = self._request.structured_output_request.grammar
        if grammar is None:
            return False  # still compiling
        if isinstance(grammar, Exception):
            self._usable = False
            return False
        new = [int(token) for token in output_token_ids[self._followed:]]
        if new:
            followed = grammar.validate_tokens(new)  # up to a refusal or the grammar's end
            grammar.accept_tokens(self._req_id, followed)
            self._followed = len(output_token_ids)
            if len(followed) < len(new) and not grammar.is_terminated():
                self._usable = False  # the output left this copy's grammar: stop following it
                return False
        return True

    def mask(self, scores: torch.Tensor, paths: Sequence[Sequence[int]], staging: HostStaging) -> None:
        """-inf in scores [len(paths), V] wherever the grammar, after each row's path, refuses
        the token; the bitmask reaches the device through `staging` (engine/staging.py)."""
        import xgrammar

        grammar = self._request.structured_output_request.grammar
        bitmask = self._backend.allocate_token_bitmask(len(paths))
        open_row = torch.tensor(-1, dtype=bitmask.dtype)

        def fill_row(row: int, constrained: bool) -> None:
            if constrained:
                grammar.fill_bitmask(bitmask, row)
            else:
                bitmask[row].fill_(open_row)

        fill_path_bitmasks(grammar, self._req_id, paths, fill_row)
        (staged,) = staging.stage([bitmask.numpy()])  # int32 words travel as int64: back to int32
        xgrammar.apply_token_bitmask_inplace(scores, staged.to(bitmask.dtype).view(bitmask.shape),
                                             vocab_size=min(scores.shape[-1], bitmask.shape[-1] * 32))
