"""Runs in `.venv-vllm`: three converted layers of fcsd's vLLM wiring on stub sub-blocks, with a recording
all-reduce; prints the order of attentions, all-reduce starts and waits (paper Sec. 4.2: layer k's routed all-reduce
is started at the end of layer k and waited in layer k+1 after its attention).

argv[1]: "overlapped" / "blocking" (eager), "compiled" (overlapped, the layer loop under ``torch.compile`` with
Inductor, as vLLM's CPU build compiles a model: the order is the one the compiled code runs), or "split" (overlapped,
the Dynamo graph split by vLLM's own ``split_graph`` with the attention stub and the routed ops as splitting ops, as
vLLM's piecewise compilation does on GPUs: prints the op each split point runs, in order)."""

import json
import sys

import torch
from torch import nn

from fcsd.serving import routed_allreduce as overlap
from fcsd.serving.vllm import wiring

events: list[str] = []


@torch.library.custom_op("fcsd_test::record", mutates_args=())
def record(x: torch.Tensor, what: str) -> torch.Tensor:
    """An opaque op that logs when it runs (also from compiled code) and passes ``x`` on."""
    events.append(what)
    return x.clone()


@record.register_fake
def _(x, what):
    return torch.empty_like(x)


class RecordingChannel:
    """Stands in for a model's RoutedAllReduce under its keys (no process group): logs starts and waits."""

    name = "recording"

    def key(self, index):
        return f"{self.name}/{index}"

    def park(self, key, tensor):
        events.append(f"start {key.split('/')[1]}")
        tensor.mul_(2)  # the "sum" of two equal ranks, landing in place as a real all-reduce does

    def take(self, key):
        events.append(f"wait {key.split('/')[1]}")


class FusedAddNorm(nn.Module):  # vLLM's RMSNorm: norm(x), or (norm(x + residual), x + residual)
    def forward(self, x, residual=None):
        return x if residual is None else (x + residual, x + residual)


class StubLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm, self.mlp = FusedAddNorm(), FusedAddNorm(), nn.Identity()


def attention(layer, positions, x, *extra):
    return record(x * 1.5, f"attention {layer._farskip.index}")


def main() -> None:
    mode = sys.argv[1]
    channel = RecordingChannel() if mode != "blocking" else None
    overlap._CHANNELS[RecordingChannel.name] = channel
    wiring.is_moe_block = lambda mlp: True
    wiring.shared_and_routed = lambda mlp, x: (None, x * 0.5, True)  # no shared part; the routed one needs a sum
    wiring.blocking_all_reduce = lambda tensor: record(tensor * 2, "blocking")
    layers = []
    for index in range(3):
        layer = StubLayer()
        layer.__class__ = type("FarSkipStub", (wiring.FarSkipDecoderLayerMixin, StubLayer), {})
        layer._farskip = wiring.LayerWiring(index, index > 0, index < 2, "mlp", attention, channel)
        layers.append(layer)

    def forward(hidden):
        residual = None
        for layer in layers:  # vLLM's layer loop
            hidden, residual = layer(torch.arange(2), hidden, residual)
        return hidden + residual

    if mode == "split":
        print(json.dumps({"splits": split_points(forward)}))
        return
    run = torch.compile(forward, backend="inductor", fullgraph=True) if mode == "compiled" else forward
    out = run(torch.ones(2, 4))
    if mode == "compiled":
        events.clear()  # the first call traced and compiled the loop; this one runs the compiled code only
        out = run(torch.ones(2, 4))
    print(json.dumps({"order": labelled(events), "output": out.flatten().tolist()}))


def split_points(forward) -> list[str]:
    """The splitting ops of ``forward``'s Dynamo graph, in the order vLLM's ``split_graph`` runs its pieces, each as
    ``"<op> <layer>"`` (the attention's layer from its label, the routed ops' from their key)."""
    from vllm.compilation.backends import split_graph

    from fcsd.serving.routed_allreduce import ROUTED_OPS

    graphs = []

    def capture(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    torch.compile(forward, backend=capture, fullgraph=True)(torch.ones(2, 4))
    _, items = split_graph(graphs[0], ["fcsd_test::record", *ROUTED_OPS])
    points = []
    for item in (item for item in items if item.is_splitting_graph):
        for node in item.graph.graph.nodes:
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                name = node.target.name().split("::")[1]
                label = node.args[-1]  # the attention's label, or the routed op's key
                points.append(f"{name} {label.split()[-1] if name == 'record' else label.split('/')[-1]}")
    return points


def labelled(order: list[str]) -> list[str]:
    """Each "blocking" event named by the layer whose attention ran last before it."""
    result, last = [], None
    for event in order:
        last = event.split()[1] if event.startswith("attention") else last
        result.append(f"blocking {last}" if event == "blocking" else event)
    return result


if __name__ == "__main__":
    main()
