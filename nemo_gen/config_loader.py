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
- Which files may be read at all, while a caller says so (``files_only_under``: a deployment
  run's allowed paths): the file and every ``defaults:`` entry, checked before it is read.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import os
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from nemo_gen.errors import ConfigError

# --------------------------------------------------------------------------------------------
# NeMo-RL generation keys nemo_gen reads but does not use


def _any(value: Any) -> bool:
    return True


def _null(value: Any) -> bool:
    return value is None


def _off(value: Any) -> bool:
    return value is None or value is False or value == 0


@dataclass(frozen=True)
class ForeignKey:
    """A NeMo-RL key with no nemo_gen field: why, and which values ask for nothing missing."""

    reason: str
    accepts: Callable[[Any], bool] = _any
    accepted: str = "any value"


_HTTP = ("not supported yet: part of NeMo-RL's per-shard HTTP servers (nemo_gen serves the whole fleet through one "
         "OpenAI-compatible server: vllm_cfg.expose_http_server, server.*)")
_OTHER_BACKEND = "configures another NeMo-RL backend; nemo_gen implements backend=vllm"
_QUANT = ("NeMo-RL's ModelOpt quantization is not supported; vllm_cfg.precision=fp8 or "
          "vllm_kwargs.quantization select vLLM's own")

#: Dotted keys under nemo_gen's tree (``generation.…``) that NeMo-RL defines and nemo_gen does not.
NEMO_RL_KEYS: dict[str, ForeignKey] = {
    "generation.colocated": ForeignKey(
        "NeMo-RL's trainer/generation GPU sharing (engines sleep while the trainer runs); a nemo_gen "
        "fleet owns its devices, and a trainer on the engines' GPU refits them through "
        "refit.backend=nemo_gen_ipc"),
    "generation.port_range_low": ForeignKey("ports of NeMo-RL's per-worker servers; nemo_gen's engines open none"),
    "generation.port_range_high": ForeignKey("ports of NeMo-RL's per-worker servers; nemo_gen's engines open none"),
    "generation.use_async_rollouts": ForeignKey("SGLang's switch; with vLLM, vllm_cfg.async_engine decides"),
    "generation.refit_transport": ForeignKey(
        "NeMo-RL's refit transports (nixl, nccl_reshard, sparse deltas, plugins) are not supported; "
        "nemo_gen refits through refit.backend (nemo_gen_shm, nemo_gen_ipc, or vLLM's ipc / nccl)",
        _null, "null"),
    "generation.refit_cfg": ForeignKey("configures NeMo-RL's refit transports (refit_transport)"),
    "generation.quant_cfg": ForeignKey(_QUANT, _null, "null"),
    "generation.real_quant": ForeignKey(_QUANT, _off, "false or null"),
    "generation.real_quant_export_cpu_offload": ForeignKey("only read with real_quant"),
    "generation.real_quant_ignore": ForeignKey("only read with real_quant"),
    "generation.val_temperature": ForeignKey(
        "NeMo-RL's validation sampling: a trainer passes it per call (fleet.generate(..., "
        "temperature=...)); nemo-gen runs sample with temperature / top_p / top_k"),
    "generation.val_top_p": ForeignKey("NeMo-RL's validation sampling (see val_temperature)"),
    "generation.val_top_k": ForeignKey("NeMo-RL's validation sampling (see val_temperature)"),
    "generation.num_prompts_per_step": ForeignKey("NeMo-RL's eval batching; nemo-gen batches with run.batch_size"),
    "generation.mcore_generation_config": ForeignKey(_OTHER_BACKEND),
    "generation.sglang_cfg": ForeignKey(_OTHER_BACKEND),
    "generation.trtllm_cfg": ForeignKey(_OTHER_BACKEND),
    "generation.dynamo_cfg": ForeignKey(_OTHER_BACKEND),
    "generation.vllm_cfg.http_refit_api_key_env_var": ForeignKey(_HTTP, _null, "null"),
    "generation.vllm_cfg.http_refit_server_port": ForeignKey(_HTTP, _null, "null"),
    "generation.vllm_cfg.zmq_refit_server_port": ForeignKey(_HTTP, _null, "null"),
    "generation.vllm_cfg.http_server_serving_chat_kwargs": ForeignKey(_HTTP, _null, "null"),
    "generation.vllm_cfg.tool_parser_plugin": ForeignKey(_HTTP, _null, "null"),
    "generation.vllm_cfg.reasoning_parser_plugin": ForeignKey(_HTTP, _null, "null"),
    "generation.vllm_cfg.use_tqdm": ForeignKey("vLLM's own progress bars; nemo-gen shows its own progress"),
    "generation.vllm_cfg.is_mx": ForeignKey("MX-format weights are not supported", _off, "false or null"),
    "generation.vllm_cfg.enable_return_routed_experts": ForeignKey(
        "results do not carry MoE routing (routed experts); not supported", _off, "false or null"),
    "generation.vllm_cfg.num_first_layers_in_bf16": ForeignKey(
        "NeMo-RL's fp8 layer exclusions are not supported (precision=fp8 quantizes every layer)", _off, "0 or null"),
    "generation.vllm_cfg.num_last_layers_in_bf16": ForeignKey(
        "NeMo-RL's fp8 layer exclusions are not supported (precision=fp8 quantizes every layer)", _off, "0 or null"),
    "generation.vllm_cfg.video": ForeignKey("video inputs are not supported (prompts are text or token ids)", _null, "null"),
    "generation.vllm_cfg.reset_encoder_cache_after_weight_update": ForeignKey(
        "nemo_gen resets the encoder cache after every refit anyway (as vLLM's reload_weights does)"),
    "generation.vllm_cfg.cap_max_tokens_to_context": ForeignKey(
        "vLLM stops a request at max_model_len (finish_reason 'length'); false (fail instead) is not "
        "supported", lambda v: v is None or v is True, "true or null"),
}

#: NeMo-RL keys with another name in nemo_gen: the value moves to the nemo_gen field.
NEMO_RL_ALIASES: dict[str, str] = {
    "generation.worker_extension_cls_fqn": "generation.vllm_cfg.worker_extension_cls",
}

#: Top-level sections of NeMo-RL recipes (training and eval). One of them (or ``policy``) marks a
#: document as a recipe; in a recipe, every top-level key nemo_gen does not read is not used.
NEMO_RL_SECTIONS = frozenset({
    "policy", "grpo", "sft", "dpo", "rm", "distillation", "eval", "loss_fn", "checkpointing", "data",
    "env", "logger", "cluster", "tokenizer", "teacher", "async_rl", "reward_model", "profiler",
})

_SECTION_REASONS = {
    "cluster": "NeMo-RL's cluster shape; a nemo_gen fleet is sized by fleet.num_shards on the Ray "
               "cluster it finds (ray.address)",
    "eval": "NeMo-RL's scoring loop (metric, k); nemo-gen writes samples, scoring is the caller's",
    "data": "NeMo-RL's datasets; nemo-gen reads prompts from run.input (JSONL)",
    "tokenizer": "tokenizer options besides the name (chat template); nemo-gen sends prompts as given",
}

#: policy.* keys nemo_gen maps (the rest of policy is the trainer's).
_POLICY_MAPPED = ("generation", "model_name", "tokenizer", "max_total_sequence_length", "precision")


@dataclass(frozen=True)
class NotUsed:
    """A key from the settings sources that nemo_gen read and does not use, and why."""

    key: str
    value: Any
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "value": self.value, "reason": self.reason}


# --------------------------------------------------------------------------------------------
# reading a document: YAML through OmegaConf, with NeMo-RL's inheritance and resolvers

_RESOLVERS: dict[str, Callable[..., Any]] = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "max": lambda a, b: max(a, b),
}


def register_resolvers() -> None:
    """NeMo-RL's resolvers, registered once (a process that imported NeMo-RL already has them)."""
    from omegaconf import OmegaConf

    register = getattr(OmegaConf, "register_resolver", None)  # omegaconf >= 2.4
    for name, fn in _RESOLVERS.items():
        if OmegaConf.has_resolver(name):
            continue
        if register is not None:
            register(name, fn, annotation_validation="off")
        else:  # pragma: no cover - omegaconf < 2.4
            OmegaConf.register_new_resolver(name, fn)


def _yaml_loader():
    try:
        from omegaconf._yaml import get_yaml_loader  # omegaconf >= 2.4
    except ImportError:  # pragma: no cover - omegaconf 2.1-2.3
        from omegaconf._utils import get_yaml_loader
    return get_yaml_loader()


def _read_mapping(path: Path) -> dict[str, Any]:
    import yaml

    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read settings file: {exc.strerror or exc}", field=str(path)) from None
    try:
        data = yaml.load(text, Loader=_yaml_loader())  # OmegaConf's loader: 1e-8 is a float
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}", field=str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"the top level must be a mapping, got {type(data).__name__}", field=str(path))
    return data


# The directories settings files may be read from, and what to say of a file outside them (unset:
# anywhere). Held per context, so one deployment run's limits never leak into another's thread.
_READABLE: ContextVar[tuple[tuple[Path, ...], str] | None] = ContextVar("nemo_gen_readable", default=None)


@contextlib.contextmanager
def files_only_under(roots: Sequence[Path], outside: str = "outside the allowed paths") -> Iterator[None]:
    """While in this block, a settings file (and each file its ``defaults:`` names) must resolve —
    symlinks and ``..`` followed — inside one of ``roots`` (real paths), or it is refused, naming
    it, before it is opened: neither its content nor whether it exists reaches an error message.
    ``outside``: how the refusal describes such a file."""
    token = _READABLE.set((tuple(Path(r) for r in roots), outside))
    try:
        yield
    finally:
        _READABLE.reset(token)


def _check_readable(path: Path, what: str, field: str) -> None:
    limits = _READABLE.get()
    if limits is None:
        return
    roots, outside = limits
    real = Path(os.path.realpath(path))
    if not any(real == root or root in real.parents for root in roots):
        raise ConfigError(f"{what} is {outside}", field=field)


def load_document(path: str | os.PathLike, _chain: tuple[Path, ...] = ()):
    """``path`` as an OmegaConf ``DictConfig``, its ``defaults:`` chain merged in (unresolved)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    p = Path(path)
    if not _chain:
        _check_readable(p, f"settings file {str(p)!r}", "config")
    real = p.resolve()
    if real in _chain:
        loop = " -> ".join(str(c) for c in (*_chain, real))
        raise ConfigError(f"defaults chain loops: {loop}", field=str(_chain[-1]))
    data = _read_mapping(p)
    defaults = data.pop("defaults", None)
    try:
        doc = OmegaConf.create(data)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot load: {exc}", field=str(p)) from None
    if defaults is None:
        return doc if _chain else _strip_markers(doc)
    if isinstance(defaults, (str, os.PathLike)):
        defaults = [defaults]
    if not isinstance(defaults, list) or not all(isinstance(d, (str, os.PathLike)) for d in defaults):
        raise ConfigError(f"defaults must be a path or a list of paths, got {defaults!r}", field=f"{p}: defaults")
    base = OmegaConf.create({})
    for entry in defaults:
        parent = Path(entry) if Path(entry).is_absolute() else p.parent / entry
        _check_readable(parent, f"defaults entry {str(entry)!r} ({parent})", f"{p}: defaults")
        if not parent.is_file():
            raise ConfigError(f"defaults entry {str(entry)!r}: no such file {parent}", field=f"{p}: defaults")
        base = _merge_with_override(base, load_document(parent, (*_chain, real)))
    merged = _merge_with_override(base, doc)
    return merged if _chain else _strip_markers(merged)


def _marker_paths(tree: Any, prefix: str = "") -> list[str]:
    """Dotted paths of the mappings in ``tree`` (a plain container) marked ``_override_: true``."""
    found = []
    if isinstance(tree, dict):
        for key, value in tree.items():
            if isinstance(value, dict):
                if value.get("_override_") is True:
                    found.append(f"{prefix}{key}")
                found += _marker_paths(value, f"{prefix}{key}.")
    return found


def _merge_with_override(base, override):
    """NeMo-RL's merge: a section marked ``_override_: true`` replaces the inherited one (NeMo-RL
    honours the marker on top-level sections; nemo_gen at any depth)."""
    from omegaconf import DictConfig, OmegaConf

    for dotted in _marker_paths(OmegaConf.to_container(override, resolve=False)):
        parent, _, key = dotted.rpartition(".")
        holder = OmegaConf.select(base, parent) if parent else base
        if isinstance(holder, DictConfig) and key in holder:
            del holder[key]
        marked = OmegaConf.select(override, dotted)
        del marked["_override_"]
    return OmegaConf.merge(base, override)


def _strip_markers(doc):
    """A marker with nothing inherited to replace is dropped (it is not a setting)."""
    from omegaconf import OmegaConf

    for dotted in _marker_paths(OmegaConf.to_container(doc, resolve=False)):
        del OmegaConf.select(doc, dotted)["_override_"]
    return doc


def _resolved(doc, dotted: str, source: str) -> Any:
    """The value at ``dotted`` as plain data, every interpolation resolved (None when absent)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        node = OmegaConf.select(doc, dotted, throw_on_missing=True) if dotted else doc
        if isinstance(node, (DictConfig, ListConfig)):
            return OmegaConf.to_container(node, resolve=True)
        return node
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or dotted
        msg = str(exc).splitlines()[0]
        raise ConfigError(f"{source}: cannot resolve {key}: {msg}", field=key) from None


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
            value = _resolved(doc, _doc_key(key, gen_at), f"--set {key}")
        override_pairs.append((key, value))
    out.override_data = _nested(override_pairs)

    if doc is not None:
        if out.recipe:
            out.file_data = _recipe_to_settings(doc, gen_at, sections, source, out)
        else:
            out.file_data = _resolved(doc, "", source)
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
                data[key] = _resolved(doc, key, source)
        elif key == "policy":
            continue
        elif key == "tokenizer":
            rest = {k: v for k, v in value.items() if k != "name"} if isinstance(value, dict) else value
            if rest:
                out.not_used.append(NotUsed("tokenizer", _summary(rest), _SECTION_REASONS["tokenizer"]))
        else:
            close = difflib.get_close_matches(key, sorted(sections), n=1, cutoff=0.8)
            if close and key not in NEMO_RL_SECTIONS:
                raise ConfigError(f"{source}: unknown section {key!r}; did you mean {close[0]!r}?", field=key)
            reason = _SECTION_REASONS.get(key) or (
                f"NeMo-RL's {key} section (the trainer's)" if key in NEMO_RL_SECTIONS else "not a key nemo_gen knows")
            out.not_used.append(NotUsed(key, _summary(value), reason))
    policy = raw.get("policy")
    if isinstance(policy, dict):
        for key, value in policy.items():
            if key == "tokenizer" and isinstance(value, dict):
                rest = {k: v for k, v in value.items() if k != "name"}
                if rest:
                    out.not_used.append(NotUsed("policy.tokenizer", _summary(rest), _SECTION_REASONS["tokenizer"]))
            elif key not in _POLICY_MAPPED:
                out.not_used.append(NotUsed(f"policy.{key}", _summary(value), "NeMo-RL policy (trainer) setting"))
        if gen_at == "policy.generation":
            data["generation"] = _resolved(doc, "policy.generation", source)
    gen = data.setdefault("generation", {})
    if not isinstance(gen, dict):
        raise ConfigError(f"{source}: {gen_at} must be a mapping, got {type(gen).__name__}", field=gen_at)

    def mapped(dotted: str) -> Any:
        return _resolved(doc, dotted, source) if OmegaConf.select(doc, dotted, throw_on_resolution_failure=False,
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
    for scope in ("generation", "generation.vllm_cfg"):
        holder = gen if scope == "generation" else gen.get("vllm_cfg")
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
