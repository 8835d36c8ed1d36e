"""`grail-train`: the Hydra entrypoint (also `scripts/offline_trainer/run_offline_grpo.py`).

The typed schema (`grail.config.Config`) is registered with Hydra's ConfigStore and named first in
`conf/offline_grpo.yaml`'s defaults, so an unknown key or a wrong type fails at composition time
naming the key; `grail.config.validate` then rejects impossible combinations before any model loads.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from grail.config import Config, ConfigError, validate

ConfigStore.instance().store(name="offline_grpo_schema", node=Config)

_PACKAGED_CONF = Path(__file__).resolve().parents[1] / "conf"  # inside a built wheel
_SOURCE_CONF = Path(__file__).resolve().parents[2] / "conf"  # in a checkout (editable install)
CONF_DIR = str(_PACKAGED_CONF if _PACKAGED_CONF.is_dir() else _SOURCE_CONF)

log = logging.getLogger("grail.train")


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    # SLURM and process managers stop jobs with SIGTERM; raising SystemExit runs the cleanup
    # (context managers stop the inference server) that a bare SIGTERM would skip.
    raise SystemExit(128 + signum)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="offline_grpo")
def main(cfg: DictConfig) -> None:
    config: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    try:
        validate(config)
    except ConfigError as exc:
        log.error("invalid configuration: %s", exc)
        sys.exit(2)
    # Imported here so that `--help` and config errors answer before torch and transformers load.
    from grail.train.loop import run

    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    run(config, Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    main()
