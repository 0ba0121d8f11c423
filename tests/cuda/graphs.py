"""What CUDA graph trees would decide about a compiled step, checked where there is no GPU.

Inductor's cudagraph trees (torch/_inductor/cudagraph_utils.py, check_for_mutation) skip a graph when it mutates an
input that is not a static input: mutated_input_idxs of the forward graph against
TracingContext.fw_metadata.static_input_indices. Both are fixed by AOTAutograd, before any device code exists. This
backend runs AOTAutograd as inductor does (keep_inference_input_mutations=True, so a mutation stays a `copy_` onto its
placeholder) and records the two sets, then runs the graph eagerly: the same decision, on CPU or fake CUDA tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch._dynamo.backends.common import aot_autograd


@dataclass
class GraphInputs:
    """One compiled forward graph's inputs: which it mutates, which are static, and the mutated ones' names."""

    n_inputs: int = 0
    mutated: list[int] = field(default_factory=list)
    static: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)

    @property
    def mutated_not_static(self) -> list[str]:
        """What would make cudagraph trees skip the graph ("skipping cudagraphs due to mutated inputs")."""
        static = set(self.static)
        return [name for index, name in zip(self.mutated, self.names, strict=True) if index not in static]


def recording_backend() -> tuple[object, list[GraphInputs]]:
    """A torch.compile backend and the list it appends one GraphInputs to per compiled graph."""
    graphs: list[GraphInputs] = []

    def forward_compiler(gm: torch.fx.GraphModule, example_inputs):
        context = torch._guards.TracingContext.try_get()
        static = list(context.fw_metadata.static_input_indices) if context and context.fw_metadata else []
        placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
        mutated = sorted(
            {
                placeholders.index(node.args[0])
                for node in gm.graph.nodes
                if node.op == "call_function"
                and node.target is torch.ops.aten.copy_.default
                and node.args[0] in placeholders
            }
        )
        graphs.append(
            GraphInputs(
                n_inputs=len(placeholders),
                mutated=mutated,
                static=static,
                names=[placeholders[index].name for index in mutated],
            )
        )
        return gm

    return aot_autograd(fw_compiler=forward_compiler, keep_inference_input_mutations=True), graphs
