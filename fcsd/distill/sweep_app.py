"""The Hydra application behind ``fcsd sweep``: ``python -m fcsd.distill.sweep_app --multirun [overrides]`` runs
one FCSD run per combination of swept values with the selected Hydra launcher (see :mod:`fcsd.distill.sweep`)."""

import hydra

from fcsd.distill.config import recipes_dir, register_schemas

register_schemas()


@hydra.main(config_path=str(recipes_dir()), config_name="fcsd", version_base="1.3")
def main(cfg) -> None:
    from pathlib import Path

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from fcsd.distill.config import to_config
    from fcsd.distill.sweep import job_overrides, run_job, run_name

    hydra_config = HydraConfig.get()
    run_dir = Path(hydra_config.sweep.dir) / run_name(cfg.train.batch_tokens, cfg.train.lr)
    job = job_overrides(run_dir, cfg.sweep.steps, cfg.sweep.schedule)
    config = to_config(OmegaConf.merge(cfg, OmegaConf.from_dotlist(job)))
    run_job(config, run_dir, [*hydra_config.overrides.task, *job])


if __name__ == "__main__":
    import sys

    from fcsd import stopping

    stopping.install()  # SIGTERM stops the run as Ctrl-C does (its lock released)
    try:
        main()
    except BaseException as stop:  # `fcsd sweep` passed Ctrl-C or SIGTERM on; it reports the stop itself
        code = stopping.was_stopped(stop)
        if code is None:
            raise
        sys.exit(code)
