"""The weights' content digest (``nemo_gen.core.digest``): its definition, the comparison that
names the first differing tensor, the combined digest, the stamp per version span; and the torch
kernel (``nemo_gen.vllm_ext.digest``) held bit for bit to the plain-Python definition."""

from __future__ import annotations

import pytest
import torch

from nemo_gen.core import digest as d
from nemo_gen.vllm_ext.digest import staged_form, tensor_digest


@pytest.mark.parametrize("dtype,shape", [(torch.bfloat16, (7, 5)), (torch.float32, (3, 4)), (torch.int8, (13,)),
                                          (torch.float16, (1,)), (torch.int64, (2, 3)), (torch.float32, ())])
def test_the_kernel_is_the_definition(dtype, shape):
    g = torch.Generator().manual_seed(7)
    t = (torch.randn(shape, generator=g) * 100).to(dtype)
    assert tensor_digest(t) == d.reference_digest(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def test_chunks_the_fused_form_and_unaligned_views_give_the_same_bits(monkeypatch):
    from nemo_gen.vllm_ext import digest as kernel

    t = torch.randn(1001, dtype=torch.float32)
    whole = tensor_digest(t)
    assert whole == d.reference_digest(t.numpy().tobytes())
    monkeypatch.setattr(kernel, "_EAGER_CHUNK", 64)  # many steps over reused buffers, one sum
    monkeypatch.setattr(kernel._scratch, "by_device", {})
    assert tensor_digest(t) == whole
    words = t.view(torch.uint8)[:4000].view(torch.int64)
    # the form torch.compile fuses on CUDA, run eagerly here in two chunks: the same sum
    fused_form = (kernel._chunk_sum(words[:100], 0) + kernel._chunk_sum(words[100:], 100)).item() & d.MASK
    assert fused_form == kernel._eager_sum(words).item() & d.MASK
    raw = torch.zeros(4 * 1001 + 1, dtype=torch.uint8)
    raw[1:] = t.view(torch.uint8)
    assert tensor_digest(raw[1:]) == whole  # at byte offset 1 no word is aligned: copied once


def test_every_single_byte_flip_changes_the_digest():
    t = torch.randn(64, dtype=torch.bfloat16)
    base = tensor_digest(t)
    raw = t.view(torch.uint8)
    for i in range(raw.numel()):
        for bit in (0, 7):
            flipped = raw.clone()
            flipped[i] ^= 1 << bit
            assert tensor_digest(flipped.view(torch.bfloat16)) != base, (i, bit)


def test_order_length_and_position_count():
    a = torch.arange(8, dtype=torch.int32)
    assert tensor_digest(a) != tensor_digest(a.flip(0))  # a swap of elements
    assert tensor_digest(torch.zeros(4, dtype=torch.uint8)) != tensor_digest(torch.zeros(8, dtype=torch.uint8))
    assert tensor_digest(torch.zeros(0)) == d.reference_digest(b"")


def test_staged_form_casts_floats_only():
    assert staged_form(torch.ones(2), torch.bfloat16).dtype == torch.bfloat16
    assert staged_form(torch.ones(2, dtype=torch.int64), torch.bfloat16).dtype == torch.int64


def test_combine_is_order_free_and_names_count():
    one = d.combine([("a", 1), ("b", 2)])
    assert one == d.combine([("b", 2), ("a", 1)]) and one.startswith("wd1:") and len(one) == 4 + 32
    assert one != d.combine([("a", 2), ("b", 1)])
    assert one != d.combine([("a", 1), ("c", 2)])
    assert d.WeightDigest(("a", "b"), (1, 2)).digest == one


def test_first_mismatch_names_the_first_differing_tensor():
    names = ["embed", "layer.0", "layer.1"]
    assert d.first_mismatch(names, [1, 2, 3], [1, 2, 3]) is None
    msg = d.first_mismatch(names, [1, 2, 3], [1, 5, 6])
    assert "'layer.0'" in msg and "layer.1" not in msg and d.is_mismatch(msg)
    assert d.hex64(2) in msg and d.hex64(5) in msg
    assert "2 tensor digests" in d.first_mismatch(names, [1, 2], [1, 2, 3])
    assert not d.is_mismatch("ValueError: staging file too small") and not d.is_mismatch(None)


def test_span_digests_and_the_book():
    book = d.DigestBook(keep=2)
    book.record(1, "wd1:one")
    book.record(2, "wd1:two")
    assert d.span_digests([(1, 5), (2, 3), (None, 1), (9, 1)], book.of) == ["wd1:one", "wd1:two", None, None]
    book.record(3, "wd1:three")  # only the last two versions are kept
    assert book.of(1) is None and book.of(3) == "wd1:three"
    book.record(3, None)  # a version whose weights were not digested here: no claim
    assert book.of(3) is None


def test_a_weight_sync_update_is_checked_before_loading():
    from nemo_gen.vllm_ext.vllm_backend import check_digests, digest_fields

    named = [("a", torch.ones(3)), ("b", torch.zeros(2, 2))]
    fields = digest_fields(["a", "b"], {n: tensor_digest(t) for n, t in named})
    assert fields["digest"] == d.combine((n, tensor_digest(t)) for n, t in named)
    check_digests(iter(named), fields["digests"])  # the same bytes: nothing to say
    with pytest.raises(ValueError, match="weight digest mismatch at tensor 'b'"):
        check_digests([("a", torch.ones(3)), ("b", torch.eye(2))], fields["digests"])
    assert digest_fields(["a"], {}) == {}  # not digested: the update carries nothing


def test_a_layouts_short_form_keeps_the_new_digests():
    from nemo_gen.core.manifest import layout_only

    short = layout_only({"layout": "L3", "names": ["a"], "digests": [7], "digest": "wd1:x"})
    assert short == {"layout": "L3", "layout_only": True, "digests": [7], "digest": "wd1:x"}
