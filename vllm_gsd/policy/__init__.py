"""When and how much to draft: cost curves, the acceptance model, the node budget and the
wall-clock referee. No vLLM import; answers are dataclasses."""

from .acceptance_model import AcceptanceModel
from .cost_model import BestStep, CostCurve, StepForecast, StepKind, best_step
from .node_budget import Decision, NodeBudgetPolicy, Selection
from .referee import ArmChoice, WallClockReferee, pays_back

__all__ = [
    "AcceptanceModel",
    "ArmChoice",
    "BestStep",
    "CostCurve",
    "Decision",
    "NodeBudgetPolicy",
    "Selection",
    "StepForecast",
    "StepKind",
    "WallClockReferee",
    "best_step",
    "pays_back",
]
