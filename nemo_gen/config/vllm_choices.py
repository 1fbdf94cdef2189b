"""What the installed vLLM accepts, read from its own source without importing it.

Settings are validated where no engine runs (``nemo-gen config``, a Prefect worker rendering
a deployment, a trainer building its fleet's settings), and importing vLLM costs seconds and
pulls in torch. The enumerations below are vLLM's own literals and registries, parsed from the
installed package's files with ``ast``: the cache dtypes (``vllm/config/cache.py``
``CacheDType``), model dtypes (``vllm/config/model.py`` ``ModelDType``), load formats
(``vllm/model_executor/model_loader/__init__.py`` ``LoadFormats``), the weight-transfer
backends registered in ``vllm/distributed/weight_transfer/factory.py`` (plus nemo_gen's own,
registered by ``nemo_gen.vllm_ext.vllm_backend``), the tool-call and reasoning parsers registered
in ``vllm/tool_parsers/__init__.py`` and ``vllm/reasoning/__init__.py``, and the ``EngineArgs`` fields
(``vllm/engine/arg_utils.py``) that ``vllm_kwargs`` may name.

Every function returns ``None`` when vLLM is not installed here (a host that only renders
settings); the engine host validates the same settings again when it loads them.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path
from typing import Any

from nemo_gen.core.manifest import OWN_BACKENDS

#: nemo_gen's own weight-transfer backends (registered in vLLM by nemo_gen.vllm_ext.vllm_backend)
NEMO_GEN_BACKENDS = OWN_BACKENDS

#: ``generation.vllm_cfg.precision`` values nemo_gen adds to vLLM's dtypes: bf16 weights with
#: vLLM's fp8 quantization (NeMo-RL's meaning).
EXTRA_PRECISIONS = ("fp8",)


@functools.cache
def vllm_root() -> Path | None:
    """The installed ``vllm`` package directory (found, not imported), or None."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def _module(relpath: str) -> ast.Module | None:
    root = vllm_root()
    if root is None:
        return None
    try:
        return ast.parse((root / relpath).read_text())
    except (OSError, SyntaxError):
        return None


def _assigned(relpath: str, name: str, kind: type) -> Any:
    """The value of ``name = ...`` at the top level of ``relpath`` when it is an ``ast`` ``kind``."""
    tree = _module(relpath)
    if tree is None:
        return None
    for node in tree.body:
        targets = [node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets) and isinstance(node.value, kind):
            return node.value
    return None


def _strings(nodes: list[Any]) -> tuple[str, ...] | None:
    return tuple(e.value for e in nodes if isinstance(e, ast.Constant) and isinstance(e.value, str)) or None


def _literal(relpath: str, name: str) -> tuple[str, ...] | None:
    """The strings of ``name = Literal[...]`` at the top level of ``relpath``."""
    value = _assigned(relpath, name, ast.Subscript)
    if value is None:
        return None
    inner = value.slice
    return _strings(inner.elts if isinstance(inner, ast.Tuple) else [inner])


def _dict_keys(relpath: str, name: str) -> tuple[str, ...] | None:
    """The string keys of ``name = {...}`` at the top level of ``relpath``."""
    value = _assigned(relpath, name, ast.Dict)
    return None if value is None else _strings(value.keys)


@functools.cache
def kv_cache_dtypes() -> tuple[str, ...] | None:
    """vLLM's ``CacheDType``: what ``kv_cache_dtype`` may be."""
    return _literal("config/cache.py", "CacheDType")


@functools.cache
def model_dtypes() -> tuple[str, ...] | None:
    """vLLM's ``ModelDType``: what ``dtype`` may be."""
    return _literal("config/model.py", "ModelDType")


@functools.cache
def precisions() -> tuple[str, ...] | None:
    """``generation.vllm_cfg.precision`` values: vLLM's dtypes plus ``fp8``."""
    dtypes = model_dtypes()
    return None if dtypes is None else dtypes + EXTRA_PRECISIONS


@functools.cache
def load_formats() -> tuple[str, ...] | None:
    """vLLM's built-in ``LoadFormats``."""
    return _literal("model_executor/model_loader/__init__.py", "LoadFormats")


@functools.cache
def weight_transfer_backends() -> tuple[str, ...] | None:
    """Worker-side weight-transfer backends an engine can start with: the names vLLM's factory
    registers (``WeightTransferEngineFactory.register_engine("name", ...)``) and nemo_gen's."""
    tree = _module("distributed/weight_transfer/factory.py")
    if tree is None:
        return None
    names = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "register_engine"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "WeightTransferEngineFactory"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.append(node.args[0].value)
    if not names:
        return None
    return tuple(dict.fromkeys([*NEMO_GEN_BACKENDS, *names]))


@functools.cache
def tool_parsers() -> tuple[str, ...] | None:
    """The tool-call parsers vLLM registers (``ToolParserManager``): what ``server.tool_call_parser`` may be."""
    return _dict_keys("tool_parsers/__init__.py", "_TOOL_PARSERS_TO_REGISTER")


@functools.cache
def reasoning_parsers() -> tuple[str, ...] | None:
    """The reasoning parsers vLLM registers (``ReasoningParserManager``): what ``server.reasoning_parser`` may be."""
    return _dict_keys("reasoning/__init__.py", "_REASONING_PARSERS_TO_REGISTER")


@functools.cache
def engine_arg_names() -> frozenset[str] | None:
    """Keyword arguments ``vllm.LLM`` / ``AsyncEngineArgs`` take: the ``EngineArgs`` and
    ``AsyncEngineArgs`` dataclass fields (``LLM`` adds ``chat_template``)."""
    tree = _module("engine/arg_utils.py")
    if tree is None:
        return None
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in ("EngineArgs", "AsyncEngineArgs"):
            names |= {
                item.target.id
                for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            }
    return frozenset(names | {"chat_template"}) if names else None
