"""One ``fcsd convert`` step (argv[2:]: its command line) while recording the dtypes of every grouped matmul the
process runs, forward and backward; writes ``{argv[1]}.{rank}.json``: the sorted distinct (input, weight) dtypes."""

import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fcsd.cli import main


class GroupedMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket is torch.ops.aten._grouped_mm:
            self.dtypes.add((str(args[0].dtype), str(args[1].dtype)))
        return func(*args, **(kwargs or {}))


if __name__ == "__main__":
    with GroupedMatmuls() as seen:
        code = main(sys.argv[2:])
    rank = int(os.environ.get("RANK", 0))
    with open(f"{sys.argv[1]}.{rank}.json", "w") as out:
        json.dump({"code": code, "dtypes": sorted(seen.dtypes)}, out)
