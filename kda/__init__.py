"""kda: Kimi Delta Attention through interchangeable, verified kernel backends.

    import kda
    o, final_state = kda.chunk_kda(q, k, v, g, beta, backend="auto")
    print(kda.explain(q, k, v, g, beta))          # which backend, and why
    o, pool = kda.fused_recurrent_kda(q1, k1, v1, g1, beta1, initial_state=pool,   # decoding, a state pool
                                      ssm_state_indices=slots, inplace_final_state=True)

See README.md for the backends, and `python -m kda.verify --all` to verify them on this machine.
"""

from kda._version import __version__
from kda.api import Route, chunk_kda, explain, trace_routes
from kda.backends.base import (
    Backend,
    ForwardResult,
    KDAGradients,
    KDAInputs,
    KDAOutputs,
    RecurrentInputs,
    RecurrentResult,
    Verdict,
)
from kda.dispatch import use_backends
from kda.errors import BackendSelectionError, KDAError, KDAInputError
from kda.recurrent.api import explain_recurrent, fused_recurrent_kda
from kda.recurrent.gate import kda_gate
from kda.recurrent.spec import RecurrentCaseClass, RecurrentSpec
from kda.reference import kda_reference
from kda.registry import available_backends, get_backend, register_backend, registered_backends, unregister_backend
from kda.report import Explanation
from kda.spec import CaseClass, GateMode, KDASpec

__all__ = [
    "Backend",
    "BackendSelectionError",
    "CaseClass",
    "Explanation",
    "ForwardResult",
    "GateMode",
    "KDAError",
    "KDAGradients",
    "KDAInputError",
    "KDAInputs",
    "KDAOutputs",
    "KDASpec",
    "RecurrentCaseClass",
    "RecurrentInputs",
    "RecurrentResult",
    "RecurrentSpec",
    "Route",
    "Verdict",
    "__version__",
    "available_backends",
    "chunk_kda",
    "explain",
    "explain_recurrent",
    "fused_recurrent_kda",
    "get_backend",
    "kda_gate",
    "kda_reference",
    "register_backend",
    "registered_backends",
    "trace_routes",
    "unregister_backend",
    "use_backends",
]
