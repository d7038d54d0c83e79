"""The bridge registers its torch.compile backend, `hpu_backend`; this one records that it compiled a graph
and runs the graph as it is (eagerly, on the CPU). Registered once per process: tests import the stand-in
afresh."""

import torch._dynamo

from habana_frameworks import record


def hpu_backend(graph_module, example_inputs):
    record("hpu_backend")
    return graph_module.forward


if "hpu_backend" not in torch._dynamo.list_backends(exclude_tags=()):
    torch._dynamo.register_backend(hpu_backend, name="hpu_backend")
