"""A chat turn's sampling constraint: the request's own, or the forced tool call's grammar.

``required`` and a named function (and tools made strict by ``server.tool_strict_level``) are
constrained by the parser's ``adjust_request`` (``adjusted``): vLLM's parser sets the request's
structured outputs (Hermes: a structural tag ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``),
which the engines decode under as the fleet's ``structured_outputs`` sampling key
(``constraint``). The one change to vLLM's grammar: runs of whitespace in it are bounded
(``server.tool_call_whitespace``), so even a random model closes its call. The HTTP chat routes
(``nemo_gen.server.tools``) and a library session (``nemo_gen.fleet.session``) constrain the same
way (``nemo_gen.chat``).
"""

from __future__ import annotations

import json
from typing import Any

from nemo_gen.chat.answers import ChatParsers
from nemo_gen.core.sampling import STRUCTURED, STRUCTURED_OPTIONS


def structured_of(req: Any) -> dict[str, Any] | None:
    """vLLM's request constraint (``structured_outputs``, ``response_format``) as the fleet's
    ``structured_outputs`` keyword."""
    so = req.extract_structured_outputs() if hasattr(req, "extract_structured_outputs") else req.structured_outputs
    if so is None:
        return None
    out = {k: v for k in STRUCTURED if (v := getattr(so, k, None)) not in (None, False)}
    if out:
        out.update({k: v for k in STRUCTURED_OPTIONS if (v := getattr(so, k, None)) not in (None, False)})
    return out or None


def adjusted(parsers: ChatParsers, req: Any) -> tuple[Any, bool]:
    """The request as vLLM's parser adjusts it (with a reasoning parser, or a tool choice other
    than ``none``), and whether the parser set its grammar (a forced or strict call). vLLM's
    ``VLLMValidationError`` / ``ValueError`` pass through."""
    asked = req.structured_outputs
    if parsers.parser_cls is not None and (parsers.reasoning_parser or req.tool_choice not in (None, "none")):
        req = parsers.parser(req.tools).adjust_request(req)
    return req, req.structured_outputs is not asked


def constraint(req: Any, constrained: bool, whitespace: int | None) -> dict[str, Any] | None:
    """The fleet's ``structured_outputs`` keyword: the request's own, or the forced call's
    grammar with its whitespace runs bounded to ``whitespace`` characters."""
    out = structured_of(req)
    if out and constrained and whitespace is not None and "structural_tag" in out:
        tag = json.loads(out["structural_tag"])
        _bound_whitespace(tag, whitespace)
        out["structural_tag"] = json.dumps(tag)
    return out


def _bound_whitespace(node: Any, most: int) -> None:
    """Every JSON content of a structural tag with unbounded whitespace bounded to ``most``
    consecutive characters (server.tool_call_whitespace)."""
    if isinstance(node, dict):
        if "max_whitespace_cnt" in node and node["max_whitespace_cnt"] is None:
            node["max_whitespace_cnt"] = most
        for value in node.values():
            _bound_whitespace(value, most)
    elif isinstance(node, list):
        for value in node:
            _bound_whitespace(value, most)
