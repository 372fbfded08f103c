"""``fcsd convert``: FarSkip conversion + FCSD self-distillation (paper Sec. 3.1, 5.1), then the export of the
result (its ``best/`` when MBPP+ early stopping kept one) and, when asked, the push to the hub."""

from __future__ import annotations

from pathlib import Path

from fcsd.distill.config import FCSDConfig
from fcsd.distill.preflight import output_dir_claimed, preflight
from fcsd.distill.trainer import RunResult, process_state, train


def convert(config: FCSDConfig) -> RunResult:
    """Check the hub token, check every input once (:func:`~fcsd.distill.preflight.preflight`), claim the output
    folder (:func:`~fcsd.distill.preflight.output_dir_claimed`), train, export, push; returns the training result."""
    state = process_state(config)  # the process group, waiting up to parallel.timeout_minutes in a collective
    if config.push_to_hub:  # fail now, not after the training run
        from huggingface_hub import get_token

        if not get_token():
            raise ValueError(f"push_to_hub={config.push_to_hub} needs a hub token: set HF_TOKEN or `hf auth login`")
    checked = preflight(config, state.is_main_process)
    with output_dir_claimed(config, state.is_main_process, checked=True):  # one run per folder, for the whole run
        state.wait_for_everyone()
        result = train(checked)
        if config.export and (config.parallel.ep_size > 1 or config.parallel.fsdp):  # no process loads it whole
            from fcsd.export.laid_out import export_laid_out
            from fcsd.parallel.training import run_meshes

            export_dir = Path(config.export_dir or checked.run.export)
            source = result.best_dir or result.final_dir
            export_laid_out(
                source, export_dir, run_meshes(config, state), True, config.export_format, config.export_text_only
            )
            if state.is_main_process:
                print(f"exported {source.name}/ to {export_dir} (reload parity checked, laid out)")
        elif config.export and state.is_main_process:  # after the summary: the export's model card reads it
            from fcsd.export.save import export_checkpoint

            export_dir = Path(config.export_dir or checked.run.export)
            source = result.best_dir or result.final_dir
            # the run's own export/ is the run's to replace; an explicit export_dir only with overwrite=true (checked
            # before training, and again under its lock at the rename: another command may have written it since)
            overwrite = config.overwrite or not config.export_dir
            export_checkpoint(
                source, export_dir, overwrite, export_format=config.export_format, text_only=config.export_text_only
            )
            print(f"exported {source.name}/ to {export_dir} (reload parity checked)")
        if config.export and config.push_to_hub and state.is_main_process:
            from fcsd.export.push import push

            print(f"pushed to {config.push_to_hub}: {push(export_dir, config.push_to_hub)}")
    # no barrier after the export: the other processes return once training is done (fcsd.parallel.processes), so
    # a long export or push never runs into a collective's timeout
    return result
