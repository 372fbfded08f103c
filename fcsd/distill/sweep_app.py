"""The Hydra application behind ``fcsd sweep``: ``python -m fcsd.distill.sweep_app --multirun [overrides]`` runs
one FCSD run per combination of swept values with the selected Hydra launcher (see :mod:`fcsd.distill.sweep`)."""

import hydra

from fcsd.distill.config import recipes_dir, register_schemas

register_schemas()


@hydra.main(config_path=str(recipes_dir()), config_name="fcsd", version_base="1.3")
def main(cfg) -> None:
    from pathlib import Path

    from hydra.core.hydra_config import HydraConfig

    from fcsd.distill.config import to_config
    from fcsd.distill.sweep import run_job, run_name

    config = to_config(cfg)
    hydra_config = HydraConfig.get()
    run_dir = Path(hydra_config.sweep.dir) / run_name(config.train.batch_tokens, config.train.lr)
    run_job(config, run_dir, list(hydra_config.overrides.task))


if __name__ == "__main__":
    main()
