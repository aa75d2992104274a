"""weight_fingerprint: deterministic, order-free, catches changes at sampled positions, and its documented blind spots."""

from __future__ import annotations

import time

import pytest
import torch

from rlpost.models.fingerprint import (
    DEFAULT_SAMPLES_PER_TENSOR,
    FingerprintBuilder,
    FingerprintMismatch,
    sample_indices,
    tensor_digest,
    tensor_digests,
    weight_fingerprint,
)


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(384, 64, generator=g),
        "layer.0.mlp.weight": torch.randn(128, 64, generator=g),
        "layer.0.norm.weight": torch.randn(64, generator=g),
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 3),
    }


def test_equal_weights_equal_fingerprints_in_any_order() -> None:
    a, b = _weights(), _weights()
    fp = weight_fingerprint(a)
    assert fp == weight_fingerprint(b)
    assert fp == weight_fingerprint(list(reversed(list(b.items()))))
    assert len(fp) == 32 and int(fp, 16) >= 0
    assert fp != weight_fingerprint(_weights(seed=1))


def test_one_element_changed_at_a_sampled_index_is_seen() -> None:
    w = _weights()
    base = weight_fingerprint(w)
    name = "embed.weight"
    idx = sample_indices(w[name].numel(), name)
    for flat in (int(idx[0]), int(idx[len(idx) // 2]), int(idx[-1])):
        changed = {k: v.clone() for k, v in w.items()}
        changed[name].view(-1)[flat] += 1e-6  # one ulp-scale change of one element
        assert weight_fingerprint(changed) != base


def test_small_tensors_are_covered_completely() -> None:
    w = _weights()
    base = weight_fingerprint(w)
    for i in range(w["layer.0.norm.weight"].numel()):
        changed = dict(w)
        t = w["layer.0.norm.weight"].clone()
        t[i] = -t[i]
        changed["layer.0.norm.weight"] = t
        assert weight_fingerprint(changed) != base


def test_shape_and_name_are_part_of_it() -> None:
    w = _weights()
    base = weight_fingerprint(w)
    reshaped = dict(w, **{"layer.0.mlp.weight": w["layer.0.mlp.weight"].reshape(64, 128)})
    assert weight_fingerprint(reshaped) != base
    renamed = {("x." + k if k == "scalar" else k): v for k, v in w.items()}
    assert weight_fingerprint(renamed) != base
    missing = {k: v for k, v in w.items() if k != "scalar"}
    assert weight_fingerprint(missing) != base


def test_blind_spot_unsampled_element_and_dtype_upcast() -> None:
    """Documented limits: a change at an unsampled element, and an exact upcast, are invisible."""
    w = _weights()
    base = weight_fingerprint(w)
    name = "embed.weight"
    sampled = set(sample_indices(w[name].numel(), name).tolist())
    unsampled = next(i for i in range(w[name].numel()) if i not in sampled)
    changed = {k: v.clone() for k, v in w.items()}
    changed[name].view(-1)[unsampled] += 1.0
    assert weight_fingerprint(changed) == base
    bf = {k: v.to(torch.bfloat16) for k, v in w.items()}
    assert weight_fingerprint(bf) == weight_fingerprint({k: v.float() for k, v in bf.items()})
    assert weight_fingerprint(bf) != base  # fp32 -> bf16 rounding is a real change


def test_fp32_round_trip_and_signed_zero() -> None:
    w = _weights()
    via_bytes = {
        k: torch.frombuffer(bytearray(v.numpy().tobytes()), dtype=torch.float32).reshape(v.shape)
        for k, v in w.items()
        if v.numel()
    }
    assert weight_fingerprint(via_bytes) == weight_fingerprint({k: v for k, v in w.items() if v.numel()})
    assert weight_fingerprint({"z": torch.tensor([0.0, 1.0])}) == weight_fingerprint({"z": torch.tensor([-0.0, 1.0])})


def test_non_contiguous_tensor_matches_its_contiguous_copy() -> None:
    t = torch.randn(300, 200, generator=torch.Generator().manual_seed(3))
    view = t.t()  # non-contiguous
    assert not view.is_contiguous()
    assert weight_fingerprint({"w": view}) == weight_fingerprint({"w": view.contiguous()})
    sl = t[::3, 5:150]
    assert weight_fingerprint({"w": sl}) == weight_fingerprint({"w": sl.contiguous()})


def test_cheap_on_large_tensors() -> None:
    big = torch.zeros(4096, 4096)  # 16.8M elements
    idx = sample_indices(big.numel(), "big")
    assert len(idx) <= DEFAULT_SAMPLES_PER_TENSOR
    start = time.perf_counter()
    for _ in range(20):
        weight_fingerprint({"big": big})
    per_call = (time.perf_counter() - start) / 20
    full_sum = time.perf_counter()
    big.sum()
    full_sum = time.perf_counter() - full_sum
    assert per_call < 0.05, per_call  # far below reading 64 MiB; sampling only
    assert len(idx) < big.numel() // 10000


def test_builder_streaming_and_mismatch_type() -> None:
    w = _weights()
    b = FingerprintBuilder()
    for k in ["scalar", "embed.weight", "empty", "layer.0.norm.weight", "layer.0.mlp.weight"]:
        b.add(k, w[k])
    assert b.hexdigest() == weight_fingerprint(w)
    assert b.names == sorted(w)
    assert issubclass(FingerprintMismatch, RuntimeError)
    with pytest.raises(FingerprintMismatch):
        raise FingerprintMismatch("x")


def test_check_fingerprints_names_each_disagreeing_process() -> None:
    import pytest

    from rlpost.models.fingerprint import FingerprintMismatch, check_fingerprints

    assert check_fingerprints(["a", "a"], None) == "a"
    assert check_fingerprints(["b", "b"], "b", who="worker") == "b"
    with pytest.raises(FingerprintMismatch, match=r"replica 1 loaded weights with fingerprint x, replica 0's is a"):
        check_fingerprints(["a", "x"], None)
    with pytest.raises(FingerprintMismatch, match=r"worker 0 .* worker 1 .* the sender's is s"):
        check_fingerprints(["a", "b"], "s", who="worker")


def test_digests_in_one_pass_equal_one_by_one() -> None:
    """tensor_digests (what refits use) gives tensor_digest's bytes for every tensor: mixed dtypes, empty, scalar,
    non-contiguous, tiny and sampled tensors, -0.0 and NaN; and so the builder's two ways agree."""
    g = torch.Generator().manual_seed(3)
    big = torch.randn(300, 40, generator=g)
    big[0, 0], big[-1, -1] = -0.0, float("nan")
    named = [
        ("a.weight", big),
        ("b.bias", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("c.empty", torch.empty(0, 3)),
        ("d.scalar", torch.tensor(-0.0)),
        ("e.t", torch.randn(50, 60, generator=g).t()),
        ("f.half", torch.randn(3, 3, generator=g).half()),
    ]
    batched = tensor_digests(named)
    assert list(batched) == [n for n, _ in named]
    for n, t in named:
        assert batched[n] == tensor_digest(n, t), n
    one, many = FingerprintBuilder(), FingerprintBuilder()
    for n, t in named:
        one.add(n, t)
    many.add_all(named)
    assert one.hexdigest() == many.hexdigest() == weight_fingerprint(named)
    assert tensor_digests([]) == {}
