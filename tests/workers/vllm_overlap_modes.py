"""Runs in `.venv-vllm`: what fcsd's plugin decides about the routed all-reduce under vLLM's execution settings,
with vLLM's own ``CompilationConfig`` and a CUDA device pretended (``torch.cuda.is_available``): whether the overlap
is on for ``auto``, whether ``true`` is refused, the splitting ops and the CUDA-graph mode after the plugin placed
its ops, the token count above which a forward overlaps (vLLM's largest capture size here: 256) and which forwards of
a RoutedAllReduce overlap. Prints one JSON object, a case each."""

import json
from types import SimpleNamespace

import torch
from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode

from fcsd.serving.routed_allreduce import RoutedAllReduce, resolve_overlap
from fcsd.serving.vllm import models

ATTENTION = list(CompilationConfig._attention_ops)  # what vLLM splits at by default (set_splitting_ops_for_v1)
CASES = {  # name -> (enforce_eager, mode, splitting ops, CUDA-graph mode)
    "gpu default (piecewise, full and piecewise graphs)": (
        False,
        CompilationMode.VLLM_COMPILE,
        ATTENTION,
        CUDAGraphMode.FULL_AND_PIECEWISE,
    ),
    "gpu full decode only": (False, CompilationMode.VLLM_COMPILE, ATTENTION, CUDAGraphMode.FULL_DECODE_ONLY),
    "gpu splitting ops without attention": (False, CompilationMode.VLLM_COMPILE, [], CUDAGraphMode.FULL),
    "gpu breakable graphs (mode none)": (False, CompilationMode.NONE, None, CUDAGraphMode.PIECEWISE),
    "gpu enforce eager": (True, CompilationMode.NONE, None, CUDAGraphMode.NONE),
}


def decide(enforce_eager, mode, splitting_ops, cudagraph_mode) -> dict:
    compilation = CompilationConfig(mode=mode, splitting_ops=list(splitting_ops) if splitting_ops is not None else None)
    compilation.cudagraph_mode = cudagraph_mode
    compilation.max_cudagraph_capture_size = 256
    config = SimpleNamespace(model_config=SimpleNamespace(enforce_eager=enforce_eager), compilation_config=compilation)
    what, piecewise, unsplit = models._execution(config)
    auto = resolve_overlap(None, 2, unsplit)
    try:
        resolve_overlap(True, 2, unsplit)
        forced = "on"
    except ValueError as error:
        forced = f"refused: {error}"
    if auto:
        models._place_routed_ops(config, piecewise, SimpleNamespace(info=lambda *a: None))
    above = models._above_tokens(config, None)
    channel = RoutedAllReduce(group=None, above_tokens=above)
    return {
        "above_tokens": above,
        "overlaps": {n: channel.overlaps(torch.empty(n, 8)) for n in (1, above, above + 1, 8192)},
        "what": what,
        "auto": auto,
        "true": forced,
        "splitting_ops": compilation.splitting_ops,
        "cudagraph_mode": str(compilation.cudagraph_mode),
    }


def main() -> None:
    torch.cuda.is_available = lambda: True  # decisions only: nothing runs on a device
    print(json.dumps({name: decide(*case) for name, case in CASES.items()}))


if __name__ == "__main__":
    main()
