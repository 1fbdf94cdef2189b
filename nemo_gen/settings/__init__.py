"""Every nemo_gen setting and its default — this package is the only place defaults live.

Sources, lowest to highest precedence: field defaults < a YAML file < ``NEMO_GEN_*`` environment
variables (``__`` nests: ``NEMO_GEN_FLEET__NUM_SHARDS=4``) < overrides (the CLI's
``--set fleet.num_shards=4``, or a dict of dotted keys). ``NemoGenSettings.load`` validates once
and turns every problem into one ``ConfigError`` that names the dotted field and the file.

The YAML file is read as NeMo-RL reads its recipes (``nemo_gen.config.loader``: OmegaConf,
``defaults:`` inheritance, interpolations, NeMo-RL's resolvers). The ``generation`` section holds
the keys of NeMo-RL's ``GenerationConfig``/``VllmConfig`` that nemo_gen acts on; NeMo-RL's others
are accepted only with values that ask for nothing missing, and listed in ``settings.not_used``.
Enumerated values are checked against what exists: the installed vLLM's dtypes, KV cache dtypes,
load formats, engine arguments and weight-transfer backends (``nemo_gen.config.vllm_choices``), and the
generation backends ``resolve_generation_class`` knows. ``to_generation_config()`` hands the
plain dict that NeMo-RL's functions (``configure_generation_config``) expect.

This module is the public import path (``from nemo_gen.settings import NemoGenSettings``); each
section lives in its own module: ``base`` (what sections share), ``generation`` (model, generation),
``fleet`` (fleet, refit, health), ``runtime`` (ray, prefect, run), ``server``, ``root``
(``NemoGenSettings``, its sources and errors) and ``describe`` (``nemo-gen config --describe``).
"""

from nemo_gen.settings.base import ENV_PREFIX, GPU_SHARE_HEADROOM, Section
from nemo_gen.settings.describe import describe_settings
from nemo_gen.settings.fleet import FleetSettings, HealthSettings, RefitSettings
from nemo_gen.settings.generation import GenerationSettings, LoraCfg, ModelSettings, VllmCfg
from nemo_gen.settings.root import NemoGenSettings, parse_override
from nemo_gen.settings.runtime import PrefectSettings, RaySettings, RunSettings
from nemo_gen.settings.server import ServerSettings, exposure_problem, is_loopback

__all__ = [
    "ENV_PREFIX",
    "GPU_SHARE_HEADROOM",
    "FleetSettings",
    "GenerationSettings",
    "HealthSettings",
    "LoraCfg",
    "ModelSettings",
    "NemoGenSettings",
    "PrefectSettings",
    "RaySettings",
    "RefitSettings",
    "RunSettings",
    "Section",
    "ServerSettings",
    "VllmCfg",
    "describe_settings",
    "exposure_problem",
    "is_loopback",
    "parse_override",
]
