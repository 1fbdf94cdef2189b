"""The pure refit bookkeeping: manifests, staging layout, buckets, versions, reports."""

from __future__ import annotations

import pytest

from nemo_gen.core.manifest import (
    ALIGN,
    RefitError,
    RefitReport,
    ShardRefit,
    TensorMeta,
    buckets,
    canonical_dtype,
    check_manifest,
    chunk_metas,
    layout,
    nccl_rank_offsets,
    next_version,
    split_draft,
)


def m(name, shape=(4, 4), dtype="float32"):
    return TensorMeta.of(name, shape, dtype)


EXPECTED = {x.name: x for x in (m("a"), m("b", (8,)), m("lm_head.weight", (2, 4)))}


def test_dtype_names_from_safetensors_and_torch_agree():
    assert canonical_dtype("F32") == canonical_dtype("torch.float32") == "float32"
    assert canonical_dtype("BF16") == "bfloat16"
    assert m("x", (3, 5), "BF16").nbytes == 30
    with pytest.raises(RefitError, match="unsupported dtype"):
        _ = m("x", (1,), "complex64").nbytes


def test_a_matching_manifest_passes_and_optional_names_may_be_absent():
    assert check_manifest(EXPECTED, list(EXPECTED.values())) is None
    # lm_head.weight absent: refused, unless the caller says it may be (a tied head)
    with pytest.raises(RefitError, match="missing tensors: lm_head.weight"):
        check_manifest(EXPECTED, [m("a"), m("b", (8,))])
    assert check_manifest(EXPECTED, [m("a"), m("b", (8,))], optional=["lm_head.weight"]) is None
    # optional means "may be absent", not "may be wrong"
    with pytest.raises(RefitError, match=r"lm_head.weight: shape \[4, 2\]"):
        check_manifest(EXPECTED, [m("a"), m("b", (8,)), m("lm_head.weight", (4, 2))], optional=["lm_head.weight"])


def test_every_problem_is_listed_in_one_error():
    offered = [m("a", (4, 5)), m("b", (8,), "float16"), m("b", (8,)), m("zzz")]
    with pytest.raises(RefitError) as err:
        check_manifest(EXPECTED, offered)
    text = str(err.value)
    assert text.startswith("refit refused, no weight was changed")
    assert "duplicate tensors: b" in text
    assert "unexpected tensors: zzz" in text
    assert "missing tensors: lm_head.weight" in text
    assert "a: shape [4, 5] but the model has [4, 4]" in text
    assert "b: dtype float16 but the model has float32" in text


def test_partial_manifests_skip_the_missing_check_only():
    check_manifest(EXPECTED, [m("a")], partial=True)
    with pytest.raises(RefitError, match="unexpected tensors: nope"):
        check_manifest(EXPECTED, [m("a"), m("nope")], partial=True)


def test_long_name_lists_are_truncated():
    offered = [m(f"x{i}") for i in range(20)]
    with pytest.raises(RefitError, match=r"\(\+12 more\)"):
        check_manifest({}, offered, partial=True)


def test_layout_aligns_every_tensor_and_packs_in_order():
    metas = [m("a", (3,)), m("b", (5, 5)), m("c", (1,), "int8")]
    placed, total = layout(metas)
    assert [p.name for p in placed] == ["a", "b", "c"]
    assert all(p.offset % ALIGN == 0 for p in placed)
    assert placed[1].offset >= placed[0].offset + 12
    assert total % ALIGN == 0 and total >= placed[2].offset + 1


def test_buckets_respect_the_size_and_keep_order():
    metas = [m(str(i), (16,)) for i in range(10)]  # 64 bytes each
    groups = buckets(metas, 200)
    assert [len(g) for g in groups] == [3, 3, 3, 1]
    assert [x.name for g in groups for x in g] == [str(i) for i in range(10)]
    assert buckets([m("big", (1000,))], 10) == [[m("big", (1000,))]]
    with pytest.raises(ValueError):
        buckets(metas, 0)


def test_split_draft_strips_the_prefix():
    policy, draft = split_draft([m("draft.lm_head.weight"), m("lm_head.weight"), m("draft.model.x")])
    assert [x.name for x in policy] == ["lm_head.weight"]
    assert [x.name for x in draft] == ["lm_head.weight", "model.x"]


def test_versions_default_to_next_and_never_go_back():
    assert next_version(None, None) == 0
    assert next_version(3, None) == 4
    assert next_version(3, 10) == 10
    with pytest.raises(RefitError, match="not newer"):
        next_version(3, 3)


def test_report_totals():
    r = RefitReport(version=2, bytes=2_000_000_000, tensors=5, stage_seconds=0.5, load_seconds=1.5,
                    shards=[ShardRefit(0, True, 1.0), ShardRefit(1, False, error="boom")])
    assert r.seconds == 2.0 and r.gb_per_s == 1.0
    assert not r.ok and [s.shard for s in r.failed] == [1]
    assert r.to_json()["shards"][1]["error"] == "boom"


# --------------------------------------------------------------------------------------------
# vLLM's weight-sync protocol: what a chunk carries, NCCL ranks across independent engines


def test_chunk_metas_reads_vllm_and_nemo_gen_update_infos_alike():
    vllm_style = {"names": ["a", "b"], "shapes": [[2, 3], [4]], "dtype_names": ["bfloat16", "int64"], "ipc_handles": []}
    ours = {"path": "/dev/shm/x", "total": 64, "entries": [["a", [2, 3], "float16", 0], ["b", [4], "int64", 64]]}
    want = [TensorMeta.of("a", (2, 3), "float32"), TensorMeta.of("b", (4,), "int64")]
    # floating dtypes are the engine's (its loaders cast); integer ones must match
    assert chunk_metas(vllm_style, "float32") == want
    assert chunk_metas(ours, "float32") == want
    assert chunk_metas({"names": ["a"], "shapes": [[1]]}, "bfloat16") == [TensorMeta.of("a", (1,), "bfloat16")]
    assert chunk_metas({"something": "else"}, "float32") is None  # another layout: passed on unchecked


def test_nccl_rank_offsets_put_each_engine_after_the_last():
    assert nccl_rank_offsets([1, 1, 1]) == [1, 2, 3]
    assert nccl_rank_offsets([2, 4, 2], first=1) == [1, 3, 7]  # world size 7 + 2 = 9
    assert nccl_rank_offsets([]) == []
    with pytest.raises(ValueError, match="0 workers"):
        nccl_rank_offsets([2, 0])
