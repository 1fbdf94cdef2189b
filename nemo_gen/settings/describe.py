"""The settings' own documentation (``nemo-gen config --describe``): ``describe_settings``
lists every setting's key, type, default and description, then NeMo-RL's keys read but not used.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel

from nemo_gen.errors import ConfigError
from nemo_gen.settings.root import NemoGenSettings


def _type_name(ann: Any) -> str:
    import types
    import typing

    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin in (list, dict, tuple):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    if ann is Any:
        return "any"
    if isinstance(ann, type):
        return "path" if issubclass(ann, os.PathLike) else ann.__name__
    return str(ann)


def describe_settings(prefix: str = "") -> list[dict[str, Any]]:
    """Every setting under ``prefix`` (a dotted key or section; empty: all): ``key``, ``type``,
    ``default``, ``description`` — then NeMo-RL's keys nemo_gen reads but does not use, with the
    values it accepts (``type`` "not used"). Raises ConfigError for an unknown prefix."""
    import json

    from nemo_gen.config.loader import NEMO_RL_KEYS, suggest

    rows: list[dict[str, Any]] = []

    def walk(model: type[BaseModel], at: str) -> None:
        for name, info in model.model_fields.items():
            key = f"{at}{name}"
            ann = info.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                rows.append({"key": key, "type": "section", "default": None, "description": info.description})
                walk(ann, f"{key}.")
                continue
            default = info.get_default(call_default_factory=True)
            rows.append({"key": key, "type": _type_name(ann),
                         "default": json.loads(json.dumps(default, default=str)),
                         "description": info.description})

    walk(NemoGenSettings, "")
    for key, spec in NEMO_RL_KEYS.items():
        rows.append({"key": key, "type": "not used", "default": None,
                     "description": f"NeMo-RL key, not used by nemo_gen: {spec.reason}. Accepted: {spec.accepted}."})
    if not prefix:
        return rows
    prefix = prefix.strip(".")
    chosen = [r for r in rows if r["key"] == prefix or r["key"].startswith(prefix + ".")]
    if not chosen:
        raise ConfigError(f"no such setting{suggest(prefix, [r['key'] for r in rows])}", field=prefix)
    return chosen
