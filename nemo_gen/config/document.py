"""Reading one settings document: YAML through OmegaConf, with NeMo-RL's ``defaults:`` inheritance
(``_override_`` markers), its resolvers, interpolations resolved on demand (``resolved``), and which
files may be read at all while a caller says so (``files_only_under``). ``config_loader`` maps what
is read onto nemo_gen's settings.
"""

from __future__ import annotations

import contextlib
import os
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from nemo_gen.errors import ConfigError


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


def resolved(doc, dotted: str, source: str) -> Any:
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
