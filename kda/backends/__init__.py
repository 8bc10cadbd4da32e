"""Backends: one folder each. `base` defines what a backend is; `torch` is the always-there fallback."""

from kda.backends.base import Backend, ForwardResult, KDAGradients, KDAInputs, KDAOutputs, Verdict

__all__ = ["Backend", "ForwardResult", "KDAGradients", "KDAInputs", "KDAOutputs", "Verdict"]
