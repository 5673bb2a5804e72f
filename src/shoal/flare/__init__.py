"""FLARE on Shoal (docs/flare.md): step diagnosis, label synthesis, breakpoint regeneration and the
diagnosis as training signal. Modules: schema (what a diagnosis is, what a diagnoser sees),
diagnoser (the interface), programmatic (rules over the SWE probe), probe (what the sandbox tells),
judge (an LLM judge over an OpenAI-compatible endpoint), labels (RADAR-style labels, ROC-AUC),
policy (the fallible oracle), regen (the loop with breakpoint regeneration), exports (SFT filter,
dense reward)."""
from .diagnoser import Diagnoser, diagnose_trace
from .schema import TAXONOMY, Action, ErrorClass, Prefix, Risk, StepDiagnosis, StepView, Trace

__all__ = ["TAXONOMY", "Action", "Diagnoser", "ErrorClass", "Prefix", "Risk", "StepDiagnosis", "StepView", "Trace",
           "diagnose_trace"]
