"""kda: Kimi Delta Attention through interchangeable, verified kernel backends.

    import kda
    o, final_state = kda.chunk_kda(q, k, v, g, beta, backend="auto")
    print(kda.explain(q, k, v, g, beta))          # which backend, and why

See README.md for the backends, and `python -m kda.verify --all` to verify them on this machine.
"""

from kda._version import __version__
from kda.api import chunk_kda, explain
from kda.backends.base import Backend, ForwardResult, KDAGradients, KDAInputs, KDAOutputs, Verdict
from kda.dispatch import use_backends
from kda.errors import BackendSelectionError, GraphCaptureError, KDAError, KDAInputError
from kda.reference import kda_reference
from kda.registry import available_backends, get_backend, register_backend, registered_backends, unregister_backend
from kda.report import Explanation
from kda.routes import Route, trace_routes
from kda.spec import CaseClass, GateMode, KDASpec

__all__ = [
    "Backend",
    "BackendSelectionError",
    "CaseClass",
    "Explanation",
    "ForwardResult",
    "GateMode",
    "GraphCaptureError",
    "KDAError",
    "KDAGradients",
    "KDAInputError",
    "KDAInputs",
    "KDAOutputs",
    "KDASpec",
    "Route",
    "Verdict",
    "__version__",
    "available_backends",
    "chunk_kda",
    "explain",
    "get_backend",
    "kda_reference",
    "register_backend",
    "registered_backends",
    "trace_routes",
    "unregister_backend",
    "use_backends",
]
