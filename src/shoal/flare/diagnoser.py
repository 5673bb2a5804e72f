"""The one interface every diagnoser implements, and helpers to diagnose whole traces.

A diagnoser answers for the last step of a `Prefix`; it never sees a later step or the outcome.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from .schema import Prefix, StepDiagnosis, Trace


class Diagnoser(ABC):
    name: str = "diagnoser"

    @abstractmethod
    async def diagnose(self, prefix: Prefix) -> StepDiagnosis:
        """The diagnosis of `prefix.last` (step `prefix.k`), from `prefix` alone."""

    async def aclose(self) -> None:  # noqa: B027 - optional: most diagnosers hold nothing
        pass


async def diagnose_trace(diagnoser: Diagnoser, trace: Trace) -> list[StepDiagnosis]:
    """Every step of a trace, each from its own prefix (so step k's answer cannot depend on k+1..)."""
    return [await diagnoser.diagnose(trace.prefix(k)) for k in range(1, len(trace.steps) + 1)]
