"""The vocabulary as enums (nemo_gen/core/modes.py and the wire's one ``FailureKind``): a spelling
is parsed at the edge (settings, HTTP, a caller's argument) with an error naming the key; inside,
the members travel; each member says why it exists in a comment."""

from __future__ import annotations

import ast
import enum
import inspect
import textwrap

import pytest

from nemo_gen.settings import policies
from nemo_gen.core import modes, retry, wire
from nemo_gen.core.modes import RecoveryAction, RefitMode, WeightTarget, parse
from nemo_gen.errors import ConfigError, EngineCrashError, RequestTimeout, ShardBusy, ShardDiedError
from nemo_gen.settings import NemoGenSettings

VOCABULARY = (RefitMode, WeightTarget, RecoveryAction, wire.FailureKind)


def test_there_is_one_failure_kind_and_kind_of_answers_its_members():
    assert retry.FailureKind is wire.FailureKind
    assert retry.kind_of(ShardDiedError(0, "gone")) is wire.FailureKind.DEAD
    assert retry.kind_of(ShardBusy(0, "full")) is wire.FailureKind.BUSY
    assert retry.kind_of(RequestTimeout("late", shard=0)) is wire.FailureKind.SLOW
    assert retry.kind_of(ValueError("x")) is wire.FailureKind.DATA
    assert retry.http_status_kind(503) is wire.FailureKind.BUSY
    assert retry.failure(EngineCrashError(0, "exit 1")).kind is retry.kind_of(EngineCrashError(0, "exit 1"))


@pytest.mark.parametrize("kind", VOCABULARY, ids=lambda k: k.__name__)
def test_every_member_has_a_comment_saying_why(kind: type[enum.Enum]):
    source = textwrap.dedent(inspect.getsource(kind))
    lines = source.splitlines()
    members = [n for n in ast.parse(source).body[0].body if isinstance(n, ast.Assign)]
    assert {m.targets[0].id for m in members} == {m.name for m in kind}
    bare = [m.targets[0].id for m in members if "#" not in lines[m.lineno - 1]]
    assert bare == [], f"{kind.__name__}: members without a comment: {bare}"


@pytest.mark.parametrize("kind", VOCABULARY, ids=lambda k: k.__name__)
def test_the_public_spellings_read_as_before(kind: type[enum.Enum]):
    # StrEnum: a report, a JSON body or a log line shows the value, never "Kind.MEMBER"
    for member in kind:
        assert str(member) == member.value and f"{member}" == member.value
    assert [m.value for m in RefitMode] == ["drain", "abort", "keep"]
    assert [m.value for m in WeightTarget] == ["policy", "draft"]
    assert [m.value for m in RecoveryAction] == ["none", "caught-up", "promoted-spare", "restarted", "restarted-stale"]


def test_parse_takes_a_member_or_its_spelling_and_names_the_key_otherwise():
    assert parse(RefitMode, "keep", "refit.in_flight") is RefitMode.KEEP
    assert parse(RefitMode, RefitMode.ABORT, "refit.in_flight") is RefitMode.ABORT
    with pytest.raises(ValueError, match=r"in_flight: must be one of \['drain', 'abort', 'keep'\], got 'later'"):
        parse(RefitMode, "later", "in_flight")
    with pytest.raises(ValueError, match="target"):
        parse(WeightTarget, None, "target")


def test_refit_in_flight_is_the_enum_inside_and_a_bad_spelling_is_refused_by_key():
    settings = NemoGenSettings.load(overrides={"refit.in_flight": "keep"})
    assert settings.refit.in_flight is RefitMode.KEEP
    assert NemoGenSettings.load().refit.in_flight is RefitMode.DRAIN
    with pytest.raises(ConfigError) as info:
        NemoGenSettings.load(overrides={"refit.in_flight": "later"})
    assert info.value.field == "refit.in_flight" or "refit.in_flight" in str(info.value)
    # a caller's argument (the CLI's --in-flight, a flow's parameter) is parsed where it enters
    assert policies.in_flight(settings, "abort").mode is RefitMode.ABORT
    assert policies.in_flight(settings).mode is RefitMode.KEEP
    with pytest.raises(ConfigError) as info:
        policies.in_flight(settings, "later")
    assert info.value.field == "refit.in_flight" and "got 'later'" in str(info.value)


def test_the_wire_carries_members_whatever_spelling_built_it():
    assert wire.InFlight("keep").mode is RefitMode.KEEP and wire.InFlight(RefitMode.DRAIN).drain
    apply = wire.SyncApply(wire.InFlight("drain"), {}, "draft", 3)
    assert apply.target is WeightTarget.DRAFT
    with pytest.raises(ValueError):
        wire.InFlight("later")


def test_the_module_says_what_it_owns():
    assert modes.__doc__ and "RefitMode" in modes.__doc__
