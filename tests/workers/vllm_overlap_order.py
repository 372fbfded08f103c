"""Runs in `.venv-vllm`: three converted layers of fcsd's vLLM wiring on stub sub-blocks, with a recording
all-reduce; prints the order of attentions, all-reduce starts and waits (paper Sec. 4.2: layer k's routed all-reduce
is started at the end of layer k and waited in layer k+1 after its attention)."""

import json
import sys

import torch
from torch import nn

from fcsd.serving.vllm import wiring

events: list[str] = []


class Recorded:
    def __init__(self, tensor, index):
        self.tensor, self.index = tensor, index

    def wait(self):
        events.append(f"wait {self.index}")


class RecordingAllReduce:
    def start(self, tensor):
        events.append(f"start {current[0]}")
        return Recorded(tensor, current[0])


class FusedAddNorm(nn.Module):  # vLLM's RMSNorm: norm(x), or (norm(x + residual), x + residual)
    def forward(self, x, residual=None):
        return x if residual is None else (x + residual, x + residual)


class StubLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm, self.mlp = FusedAddNorm(), FusedAddNorm(), nn.Identity()


current = [None]


def attention(layer, positions, x, *extra):
    current[0] = layer._farskip.index
    events.append(f"attention {current[0]}")
    return x


def main() -> None:
    overlapped = sys.argv[1] == "overlapped"
    wiring.is_moe_block = lambda mlp: True
    wiring.shared_and_routed = lambda mlp, x: (None, x * 0.5, True)  # no shared part; the routed one needs a sum
    wiring.blocking_all_reduce = lambda tensor: events.append(f"blocking {current[0]}") or tensor
    handover, layers = wiring.HandOver(), []
    for index in range(3):
        layer = StubLayer()
        layer.__class__ = type("FarSkipStub", (wiring.FarSkipDecoderLayerMixin, StubLayer), {})
        layer._farskip = wiring.LayerWiring(
            index, index > 0, index < 2, "mlp", attention, RecordingAllReduce() if overlapped else None
        )
        layer._farskip.handover = handover if overlapped else None
        layers.append(layer)
    hidden, residual = torch.ones(2, 4), None
    for layer in layers:  # vLLM's layer loop
        hidden, residual = layer(torch.arange(2), hidden, residual)
    print(json.dumps(events))


if __name__ == "__main__":
    main()
