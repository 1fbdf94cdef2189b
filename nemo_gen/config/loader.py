"""Reading settings files the way NeMo-RL reads its recipes (OmegaConf), and the NeMo-RL keys
nemo_gen reads but does not use.

- ``defaults:`` inheritance, as NeMo-RL's ``load_config_with_inheritance``: a path or a list of
  paths, each relative to the file that names it; parents merge in order and the file itself
  merges last; a section marked ``_override_: true`` replaces the inherited one.
- ``${...}`` interpolations, with the resolvers NeMo-RL registers (``add``, ``sub``, ``mul``,
  ``div``, ``max``), resolved after ``--set`` overrides are applied to the document, so an
  override of ``policy.max_total_sequence_length`` reaches every key that refers to it.
- A NeMo-RL recipe (a document with ``policy`` or another of NeMo-RL's sections): its
  generation block (``policy.generation``, or ``generation`` in an eval config) becomes
  nemo_gen's ``generation``; ``policy.model_name``, ``policy.tokenizer.name`` (an eval config's
  ``tokenizer.name``), ``policy.max_total_sequence_length`` and ``policy.precision`` fill the
  nemo_gen fields they mean; every other key (the trainer's, other backends') is set aside as
  ``NotUsed`` — shown by ``nemo-gen config``, never dropped silently.
- NeMo-RL's generation keys that nemo_gen does not implement (``NEMO_RL_KEYS``): a value that
  asks for nothing nemo_gen lacks (null, false, what nemo_gen does anyway) is set aside as
  ``NotUsed`` with the reason; any other value is refused, naming the key.
- Which files may be read at all, while a caller says so (``config_document.files_only_under``: a
  deployment run's allowed paths): the file and every ``defaults:`` entry, checked before it is read.

The reading itself (YAML, inheritance, resolvers) is ``nemo_gen.config.document``'s; the NeMo-RL keys
and their reasons are ``nemo_gen.config.nemo_rl_keys``'s.
"""

from __future__ import annotations

import copy
import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from nemo_gen.config.document import load_document, register_resolvers, resolved
from nemo_gen.errors import ConfigError
from nemo_gen.config.nemo_rl_keys import (
    NEMO_RL_ALIASES,
    NEMO_RL_KEYS,
    NEMO_RL_SECTIONS,
    POLICY_MAPPED,
    SECTION_REASONS,
    NotUsed,
)


# --------------------------------------------------------------------------------------------
# from a document and overrides to what the settings model reads


@dataclass
class Prepared:
    """What ``NemoGenSettings.load`` feeds pydantic: the file's part (lowest precedence after
    the defaults), the overrides' part (highest), and what was set aside."""

    file_data: dict[str, Any] = field(default_factory=dict)
    override_data: dict[str, Any] = field(default_factory=dict)
    not_used: list[NotUsed] = field(default_factory=list)
    recipe: bool = False


def is_recipe(keys: Iterable[str]) -> bool:
    return any(k in NEMO_RL_SECTIONS for k in keys)


def prepare(
    path: str | os.PathLike | None,
    pairs: list[tuple[str, Any]],
    known: Mapping[str, Iterable[str]],
) -> Prepared:
    """Read ``path`` (if any), apply the override ``pairs`` to it, resolve, and split it into
    nemo_gen's settings and the keys nemo_gen does not use. ``known``: the settings schema's
    field names by scope (``""`` for the top level, ``"generation"``, ``"generation.vllm_cfg"``)."""
    known = {scope: set(names) for scope, names in known.items()}
    sections = known[""]
    out = Prepared()
    source = str(path) if path is not None else "overrides"
    doc = None
    if path is not None:
        register_resolvers()
        doc = load_document(path)
        out.recipe = is_recipe(doc.keys())
    gen_at = _generation_source(doc, source) if out.recipe else "generation"
    if doc is not None:
        _apply_overrides(doc, pairs, gen_at, sections, out.recipe)

    # The overrides' part: nemo_gen keys (a recipe's own keys were applied to the document).
    # An interpolation in an override is resolved in the document.
    override_pairs = []
    for key, value in pairs:
        if out.recipe and key.split(".", 1)[0] not in sections:
            continue
        if doc is not None and isinstance(value, str) and "${" in value:
            value = resolved(doc, _doc_key(key, gen_at), f"--set {key}")
        override_pairs.append((key, value))
    out.override_data = _nested(override_pairs)

    if doc is not None:
        if out.recipe:
            out.file_data = _recipe_to_settings(doc, gen_at, sections, source, out)
        else:
            out.file_data = resolved(doc, "", source)
    out.file_data = _split_foreign(out.file_data, out.not_used, gen_at if out.recipe else "generation",
                                   known, lenient=out.recipe, source=source)
    out.override_data = _split_foreign(out.override_data, out.not_used, "generation", known,
                                       lenient=False, source="overrides")
    return out


def _doc_key(key: str, gen_at: str) -> str:
    """Where nemo_gen's dotted ``key`` lives in the document (``generation.…`` may sit under
    ``policy.generation`` in a recipe)."""
    if key == "generation" or key.startswith("generation."):
        return gen_at + key[len("generation"):]
    return key


def _generation_source(doc, source: str) -> str:
    """Where a recipe keeps its generation block."""
    from omegaconf import DictConfig

    policy = doc.get("policy")
    has_policy_gen = isinstance(policy, DictConfig) and "generation" in policy
    if has_policy_gen and "generation" in doc:
        raise ConfigError(
            f"{source}: both generation and policy.generation are set; keep one (NeMo-RL reads "
            "policy.generation in training recipes, generation in eval configs)", field="generation")
    return "policy.generation" if has_policy_gen else "generation"


def _apply_overrides(doc, pairs, gen_at: str, sections: set[str], recipe: bool) -> None:
    """Put the overrides into the document before it is resolved, so interpolations see them.
    A value OmegaConf cannot hold (an arbitrary object from a dict override) stays out of the
    document; it still reaches the settings through the overrides' part."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for key, value in pairs:
        ours = key.split(".", 1)[0] in sections
        if not recipe and not ours:
            continue  # an unknown key: the settings model names it
        try:
            OmegaConf.update(doc, _doc_key(key, gen_at), copy.deepcopy(value), merge=True, force_add=True)
        except (OmegaConfBaseException, ValueError, TypeError) as exc:
            if not ours:
                raise ConfigError(f"cannot apply override {key}={value!r} to the recipe: {exc}", field=key) from None


def _recipe_to_settings(doc, gen_at: str, sections: set[str], source: str, out: Prepared) -> dict[str, Any]:
    """nemo_gen's settings from a NeMo-RL recipe; everything else goes to ``out.not_used``."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(doc, resolve=False)
    data: dict[str, Any] = {}
    for key, value in raw.items():
        key = str(key)
        if key in sections:
            if key != "generation" or gen_at == "generation":
                data[key] = resolved(doc, key, source)
        elif key == "policy":
            continue
        elif key == "tokenizer":
            rest = {k: v for k, v in value.items() if k != "name"} if isinstance(value, dict) else value
            if rest:
                out.not_used.append(NotUsed("tokenizer", _summary(rest), SECTION_REASONS["tokenizer"]))
        else:
            close = difflib.get_close_matches(key, sorted(sections), n=1, cutoff=0.8)
            if close and key not in NEMO_RL_SECTIONS:
                raise ConfigError(f"{source}: unknown section {key!r}; did you mean {close[0]!r}?", field=key)
            reason = SECTION_REASONS.get(key) or (
                f"NeMo-RL's {key} section (the trainer's)" if key in NEMO_RL_SECTIONS else "not a key nemo_gen knows")
            out.not_used.append(NotUsed(key, _summary(value), reason))
    policy = raw.get("policy")
    if isinstance(policy, dict):
        for key, value in policy.items():
            if key == "tokenizer" and isinstance(value, dict):
                rest = {k: v for k, v in value.items() if k != "name"}
                if rest:
                    out.not_used.append(NotUsed("policy.tokenizer", _summary(rest), SECTION_REASONS["tokenizer"]))
            elif key not in POLICY_MAPPED:
                out.not_used.append(NotUsed(f"policy.{key}", _summary(value), "NeMo-RL policy (trainer) setting"))
        if gen_at == "policy.generation":
            data["generation"] = resolved(doc, "policy.generation", source)
    gen = data.setdefault("generation", {})
    if not isinstance(gen, dict):
        raise ConfigError(f"{source}: {gen_at} must be a mapping, got {type(gen).__name__}", field=gen_at)

    def mapped(dotted: str) -> Any:
        return resolved(doc, dotted, source) if OmegaConf.select(doc, dotted, throw_on_resolution_failure=False,
                                                                  default=None) is not None else None

    # NeMo-RL's GRPO setup copies policy.model_name into the generation config.
    model_name = mapped("policy.model_name")
    if model_name is not None:
        gen["model_name"] = model_name
    tok = mapped("policy.tokenizer.name")
    if tok is None:
        tok = mapped("tokenizer.name")
    if tok is not None and tok != gen.get("model_name"):
        data.setdefault("model", {}).setdefault("tokenizer", tok)
    vllm_cfg = gen.setdefault("vllm_cfg", {})
    if isinstance(vllm_cfg, dict):
        for policy_key, field_name in (("max_total_sequence_length", "max_model_len"), ("precision", "precision")):
            value = mapped(f"policy.{policy_key}")
            if value is not None:
                vllm_cfg.setdefault(field_name, value)
    return data


def _split_foreign(data: dict[str, Any], not_used: list[NotUsed], gen_at: str, known: Mapping[str, set[str]],
                   lenient: bool, source: str) -> dict[str, Any]:
    """Take NeMo-RL-only keys out of ``data['generation']``: inert values to ``not_used``, others
    refused. ``lenient`` (a recipe): keys nemo_gen does not know at all are not used too."""
    gen = data.get("generation")
    if not isinstance(gen, dict):
        return data
    problems = []
    for alias, target in NEMO_RL_ALIASES.items():
        key = alias.rsplit(".", 1)[1]
        if key in gen:
            value = gen.pop(key)
            t_scope, t_key = target.removeprefix("generation.").rsplit(".", 1)
            holder = gen.setdefault(t_scope, {})
            if isinstance(holder, dict):
                if holder.get(t_key) not in (None, value):
                    problems.append((alias, f"{alias} and {target} are both set and differ"))
                holder[t_key] = value
    for scope in ("generation", "generation.vllm_cfg", "generation.colocated"):
        holder = gen if scope == "generation" else gen.get(scope.removeprefix("generation."))
        if not isinstance(holder, dict):
            continue
        shown = gen_at + scope[len("generation"):]
        for key in list(holder):
            dotted = f"{scope}.{key}"
            spec = NEMO_RL_KEYS.get(dotted)
            if spec is None:
                if lenient and key not in known.get(scope, ()):
                    not_used.append(NotUsed(f"{shown}.{key}", _summary(holder.pop(key)),
                                            "not a generation key nemo_gen knows"))
                continue
            value = holder.pop(key)
            if spec.accepts(value):
                for sub, sub_value in _children(value):
                    not_used.append(NotUsed(f"{shown}.{key}{sub}", sub_value, spec.reason))
            else:
                problems.append((dotted, f"{dotted}={_show(value)} is not supported by nemo_gen: {spec.reason} "
                                         f"(accepted: {spec.accepted})"))
    if problems:
        err = ConfigError(f"invalid settings (from {source}): " + "; ".join(msg for _, msg in problems))
        err.field = problems[0][0]
        err.fields = [f for f, _ in problems]  # type: ignore[attr-defined]
        raise err
    return data


def _show(value: Any) -> str:
    """A value as the user wrote it (YAML/JSON spelling: true, null)."""
    import json

    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return repr(value)


def _children(value: Any) -> list[tuple[str, Any]]:
    """A mapping's keys one level down (``refit_cfg.nixl``), anything else as itself."""
    if isinstance(value, dict) and value:
        return [(f".{k}", _summary(v)) for k, v in value.items()]
    return [("", _summary(value))]


def _summary(value: Any) -> Any:
    """A value for display: mappings and long lists abbreviated."""
    if isinstance(value, dict):
        small = len(value) <= 3 and not any(isinstance(v, (dict, list)) for v in value.values())
        return value if small else f"{{{len(value)} keys}}"
    if isinstance(value, list) and len(value) > 8:
        return f"[{len(value)} items]"
    return value


def _nested(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for key, value in pairs:
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError("set both as a value and as a section", field=key)
            node = child
        _merge(node, parts[-1], copy.deepcopy(value), key)
    return nested


def _merge(node: dict[str, Any], key: str, value: Any, dotted: str) -> None:
    """Set ``node[key]``, merging into a section already there (never mutating the caller's)."""
    existing = node.get(key)
    if isinstance(existing, dict) and isinstance(value, dict):
        for k, v in value.items():
            _merge(existing, k, v, f"{dotted}.{k}")
    elif isinstance(existing, dict) or (key in node and isinstance(value, dict)):
        raise ConfigError("set both as a value and as a section", field=dotted)
    else:
        node[key] = value


def suggest(name: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``choices``, or ``""``."""
    close = difflib.get_close_matches(name, sorted(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def flat_items(data: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            yield from flat_items(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value
