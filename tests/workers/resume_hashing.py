"""Worker for test_launcher_voice's shared-hashing test: ``fcsd convert --resume``'s pre-flight of the run folder
beside ``<out>`` on 2 gloo processes, recording which files each process hashed (every read of a file's SHA-256
goes through :func:`fcsd.files.checksums.file_digest`) and the refusal the main process raised. Writes
``<out>.<rank>.json``."""

import json
import sys
from pathlib import Path

import torch.distributed
from accelerate import PartialState
from omegaconf import OmegaConf

from fcsd.distill.config import FCSDConfig
from fcsd.distill.preflight import preflight
from fcsd.files import checksums

state = PartialState(cpu=True)
out = Path(sys.argv[1])
run = out.parent / "run"
hashed = []
read = checksums.file_digest


def counted(path):
    hashed.append(str(Path(path).relative_to(run)))
    return read(path)


checksums.file_digest = counted
config = OmegaConf.to_object(
    OmegaConf.merge(OmegaConf.structured(FCSDConfig), OmegaConf.load(run / "fcsd_config.yaml"))
)
config.output_dir, config.train.resume, config.train.stop_after = str(run), True, None
refusal = None
try:
    preflight(config, state.is_main_process)
except ValueError as error:
    refusal = str(error)
Path(f"{out}.{state.process_index}.json").write_text(json.dumps({"hashed": hashed, "refusal": refusal}))
torch.distributed.barrier()
torch.distributed.destroy_process_group()
