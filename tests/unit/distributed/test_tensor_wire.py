"""CPU tensors in BatchedDataDicts cross processes as numpy buffers, and come back exactly as they left."""

from __future__ import annotations

import pickle

import pytest
import torch

from rlpost.distributed import tensor_wire
from rlpost.distributed.batched_data_dict import BatchedDataDict


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(4, 3, generator=g),
        "i64": torch.randint(0, 100, (4, 3), generator=g),
        "bool": torch.rand(4, generator=g) > 0.5,
        "bf16": torch.randn(4, 3, generator=g).to(torch.bfloat16),
        "f16": torch.randn(4, generator=g).half(),
        "transposed": torch.randn(3, 4, generator=g).t(),
        "scalar_rows": torch.tensor([-0.0, float("nan"), float("inf"), 1.0]),
        "empty": torch.zeros(4, 0),
    }


@pytest.mark.parametrize("protocol", [2, 5])
def test_batched_data_dict_round_trip_is_exact(protocol: int) -> None:
    data = BatchedDataDict({**_tensors(), "names": ["a", "b", "c", "d"]})
    data.micro_batch_kind, data.is_padding = "dynamic", True
    payload = pickle.dumps(data, protocol=protocol)
    assert b"_rebuild_tensor" not in payload and b"_load_from_bytes" not in payload  # no tensor pickled as a tensor
    back = pickle.loads(payload)
    assert type(back) is BatchedDataDict and back.micro_batch_kind == "dynamic" and back.is_padding
    assert back["names"] == ["a", "b", "c", "d"]
    for k, v in _tensors().items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
        assert torch.equal(back[k].view(torch.uint8) if v.dtype == torch.bool else back[k].nan_to_num(7.0),
                           v.view(torch.uint8) if v.dtype == torch.bool else v.nan_to_num(7.0)), k
        back[k].zero_()  # writable, and its own memory
    assert torch.equal(data["f32"], _tensors()["f32"])


def test_what_pack_leaves_to_pickle() -> None:
    w = torch.ones(2, requires_grad=True)
    assert tensor_wire.pack(w) is w  # the autograd flag must survive
    back = pickle.loads(pickle.dumps(BatchedDataDict({"w": w})))
    assert back["w"].requires_grad
    assert tensor_wire.pack([1, 2]) == [1, 2] and tensor_wire.unpack("x") == "x"
    packed = tensor_wire.pack(torch.arange(3))
    assert isinstance(packed, tensor_wire.WireTensor) and packed.viewed_from is None
    assert tensor_wire.pack(torch.zeros(2, dtype=torch.bfloat16)).viewed_from == "bfloat16"
