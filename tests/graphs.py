"""The graphs torch.compile hands its backend, kept for tests to read (`tests/test_compile.py`,
`tests/recurrent/test_compile_recurrent.py`)."""

from __future__ import annotations

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd


class GraphRecorder:
    """An AOT backend that keeps the forward and backward FX graphs it is given and runs them as they are."""

    def __init__(self):
        self.forward: list[torch.fx.GraphModule] = []
        self.backward: list[torch.fx.GraphModule] = []
        self.backend = aot_autograd(fw_compiler=self._keep(self.forward), bw_compiler=self._keep(self.backward))

    @staticmethod
    def _keep(into: list):
        def compiler(gm: torch.fx.GraphModule, example_inputs):
            into.append(gm)
            return make_boxed_func(gm.forward)

        return compiler
