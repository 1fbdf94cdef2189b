"""The direct load path's copy plan: a load that was only copies out of the incoming tensors into
parameters is recorded once and replayed as one batched copy on the next refit of the same
tensors; anything else is not replayed.

The subject is our recorder and replay, so the model here is a small torch module whose
``load_weights`` does what vLLM's loaders do (stacked q/k/v narrowed into one parameter, plain
copies, a transposed view); the real-engine check is tests/gpu (a CUDA engine refit three times
through ``nemo_gen_ipc``: recorded, replayed, replayed, tokens equal to a fresh engine)."""

from __future__ import annotations

import pytest
import torch

from nemo_gen.vllm_ext.direct_load import DirectLoad, ScratchPool


class Model(torch.nn.Module):
    """qkv stacked like vLLM's QKVParallelLinear; ``how`` picks a loader behaviour."""

    def __init__(self, how: str = "copies"):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(6, 4), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        self.proj = torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False)
        self.how = how

    def load_weights(self, weights):
        for name, w in weights:
            if name in ("q", "k", "v"):
                self.qkv.data.narrow(0, 2 * "qkv".index(name), 2).copy_(w)
            elif name == "norm":
                if self.how == "transforms":
                    self.norm.data.copy_(w * 2)  # a temporary: its bytes are not the trainer's
                elif self.how == "adds":
                    self.norm.data.add_(w)  # an in-place op that is not a copy
                else:
                    self.norm.data.copy_(w)
            elif name == "proj_t":  # stored transposed by the trainer, one row of padding
                self.proj.data.zero_()  # zeroed whole, then the rows copied over it
                self.proj.data[:3].copy_(w.t())


def sources(seed: float) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(int(seed))
    return [("q", torch.randn(2, 4, generator=g)), ("k", torch.randn(2, 4, generator=g)),
            ("v", torch.randn(2, 4, generator=g)), ("norm", torch.randn(4, generator=g)),
            ("proj_t", torch.randn(4, 3, generator=g))]


def expect(model: Model, weights) -> None:
    w = dict(weights)
    assert torch.equal(model.qkv, torch.cat([w["q"], w["k"], w["v"]]))
    assert torch.equal(model.norm, w["norm"])
    assert torch.equal(model.proj[:3], w["proj_t"].t()) and not model.proj[3].any()


def load(model: Model, weights, record=True):
    direct = DirectLoad(model, model_config=None, kinds={})
    return direct, direct.load(weights, ScratchPool(), record=record)


def test_a_load_of_copies_is_recorded_and_replays_new_values_in_place():
    model, weights = Model(), sources(0)
    direct, plan = load(model, weights)
    assert plan is not None and direct.plan_note == "recorded" and len(plan.dsts) == 5 and len(plan.fills) == 1
    expect(model, weights)
    with torch.no_grad():
        model.proj.data[3] = 7.0  # the padding is filled again on replay
    with torch.no_grad():  # the trainer's optimizer step: same tensors, new values
        for (_, t), (_, new) in zip(weights, sources(1)):
            t.copy_(new)
    assert plan.replays(weights, model)
    DirectLoad(model, model_config=None, kinds={}).replay(plan)
    expect(model, weights)


def test_a_plan_does_not_replay_other_tensors_or_moved_parameters():
    model, weights = Model(), sources(0)
    _, plan = load(model, weights)
    assert not plan.replays(sources(0), model)  # another list: other tensors, whatever their values
    assert not plan.replays(weights, Model())
    model.norm = torch.nn.Parameter(torch.zeros(4), requires_grad=False)  # a parameter got new storage
    assert not plan.replays(weights, model)


@pytest.mark.parametrize("how, why", [("transforms", "not from an incoming tensor into a parameter"),
                                      ("adds", "aten.add_")])
def test_a_load_that_is_not_only_copies_is_not_recorded(how, why):
    model, weights = Model(how), sources(0)
    direct, plan = load(model, weights)
    assert plan is None and direct.plan_note.startswith("not replayable") and why in direct.plan_note


def test_no_plan_unless_asked_or_for_a_one_pass_iterator():
    model, weights = Model(), sources(0)
    assert load(model, weights, record=False)[1] is None
    assert load(model, iter(weights))[1] is None  # a generator cannot be read again
    expect(model, weights)


def test_a_weight_load_given_the_plan_replays_it_without_classifying_the_model_again():
    """What the engine's backend does per refit (``_LoadingEngine``): the last plan goes to the
    next ``WeightLoad``, which checks once that the parameters did not move and then replays it
    for the very same source tensors — and records afresh for any other tensors or a moved one."""
    from nemo_gen.vllm_ext.worker_ext import WeightLoad

    model, weights = Model(), sources(0)
    _, plan = load(model, weights)
    with torch.no_grad():
        for (_, t), (_, new) in zip(weights, sources(2)):
            t.copy_(new)
    replaying = WeightLoad(model, None, None, ScratchPool(), plan=plan)
    assert replaying.plan is plan and replaying.direct.kinds is plan.kinds  # no classification
    assert replaying.replays(weights) and not replaying.replays(sources(2))
    replaying.begin()
    replaying.replay()
    replaying.finish()
    expect(model, weights)
    assert replaying.stats["path"] == "direct" and replaying.stats["plan"] == "replayed"
    model.norm = torch.nn.Parameter(torch.zeros(4), requires_grad=False)  # moved
    assert not plan.describes(model)  # so the next WeightLoad classifies the model afresh and records
