"""Configuration machinery around ``nemo_gen.settings`` (the one home of defaults): reading a
settings document (YAML, NeMo-RL's inheritance and resolvers), mapping NeMo-RL recipes and their
unused keys, the core policy objects built from settings, and vLLM's accepted choices."""
