"""Multi-process runs as users start them (``torchrun``, ``accelerate launch``): one process speaks.

Training is collective; what comes after it (messages, tables, reports, evaluation, exports) is done once, by the
main process (global rank 0). The other processes stop there: the launcher waits for every process, so the job ends
when the main one is done, with exit status 0. No collective is used for that wait, so a long evaluation on the main
process cannot time out a barrier elsewhere.
"""

from __future__ import annotations

import os
from contextlib import contextmanager


def process_rank() -> int:
    """This process's global rank (0 outside a multi-process job)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def is_main_process() -> bool:
    return process_rank() == 0


def print_once(*args, **kwargs) -> None:
    """``print`` on the main process (global rank 0) alone: a run's messages are said once, not once per node as
    ``accelerator.print`` (its local main processes) says them."""
    if is_main_process():
        print(*args, **kwargs)


@contextmanager
def main_process_first():
    """The main process runs the block first (e.g. building a cache), the others after it; yields whether this is
    the main process. Outside a multi-process job it just runs the block."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        yield True
        return
    import torch
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())  # as the trainer creates it
    with state.main_process_first():
        yield state.is_main_process


def quiet_unless_main(is_main: bool):
    """``print`` on the main process, a no-op on the others; also turns off the other processes' progress bars."""
    if is_main:
        return print
    from transformers.utils import logging

    logging.disable_progress_bar()
    return lambda *args, **kwargs: None


def sharded_by_accelerate(deepspeed_only: bool = False) -> bool:
    """Whether accelerate shards the student from host memory (its FSDP or DeepSpeed plugins; DeepSpeed alone)."""
    from accelerate.utils import parse_flag_from_env

    deepspeed = parse_flag_from_env("ACCELERATE_USE_DEEPSPEED")
    return deepspeed or (not deepspeed_only and parse_flag_from_env("ACCELERATE_USE_FSDP"))
