"""Tensors in and out of the wire format (``kvsparse.v1.Tensor``: raw little-endian bytes with a
dtype and a shape).

Inputs may be numpy arrays (float32, float16, ``ml_dtypes.bfloat16``) or torch tensors
(float32, float16, bfloat16, on any device); outputs come back as the same kind as a reference
input (numpy, or torch on the reference's device). Conversions are whole-buffer copies, never
per-element Python loops.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Union, cast

import grpc
import ml_dtypes
import numpy as np

from kvsparse.errors import from_code
from kvsparse.v1 import tensor_pb2

if TYPE_CHECKING:
    import torch

ArrayLike = Union[np.ndarray, "torch.Tensor"]

_NP_BY_PROTO = {
    tensor_pb2.DTYPE_FP32: np.dtype(np.float32),
    tensor_pb2.DTYPE_FP16: np.dtype(np.float16),
    tensor_pb2.DTYPE_BF16: np.dtype(ml_dtypes.bfloat16),
}
_PROTO_BY_NAME = {
    "fp32": tensor_pb2.DTYPE_FP32,
    "float32": tensor_pb2.DTYPE_FP32,
    "fp16": tensor_pb2.DTYPE_FP16,
    "float16": tensor_pb2.DTYPE_FP16,
    "bf16": tensor_pb2.DTYPE_BF16,
    "bfloat16": tensor_pb2.DTYPE_BF16,
}
NAME_BY_PROTO = {tensor_pb2.DTYPE_FP32: "fp32", tensor_pb2.DTYPE_FP16: "fp16", tensor_pb2.DTYPE_BF16: "bf16"}


def _is_torch(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def proto_dtype(dtype: Any) -> tensor_pb2.DType:
    """The wire dtype of a name ("bf16", "fp16", "fp32"), a numpy dtype or a torch dtype."""
    name = str(dtype).replace("torch.", "")
    if name in _PROTO_BY_NAME:
        return _PROTO_BY_NAME[name]
    try:
        npd = np.dtype(dtype)
    except TypeError:
        npd = None
    for code, candidate in _NP_BY_PROTO.items():
        if npd == candidate:
            return code
    raise from_code(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"unsupported dtype {dtype}: kvsparse moves float32, float16 and bfloat16",
    )


def dtype_name(dtype: Any) -> str:
    """The name ("bf16", "fp16", "fp32") of a dtype as proto_dtype reads it (a name, a numpy or a
    torch dtype), as ModelShape and the op take it."""
    return NAME_BY_PROTO[proto_dtype(dtype)]


def torch_dtype(dtype: Any) -> Any:
    """The torch dtype of a name ("bf16", "fp16", "fp32") or any dtype proto_dtype reads."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name(dtype)]


def to_numpy(x: ArrayLike) -> np.ndarray:
    """A C-contiguous numpy array of x (torch tensors are copied to host memory)."""
    if _is_torch(x):
        import torch

        t = cast(torch.Tensor, x).detach()
        if t.dtype == torch.bfloat16:
            arr = t.contiguous().view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
        else:
            arr = t.contiguous().cpu().numpy()
    else:
        arr = np.asarray(x)
    proto_dtype(arr.dtype)  # refuses what the wire cannot carry
    return np.ascontiguousarray(arr)


def to_proto(x: ArrayLike, out: tensor_pb2.Tensor) -> None:
    """Fills ``out`` with x's dtype, shape and bytes (little-endian, as the host's)."""
    arr = to_numpy(x)
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        arr = arr.byteswap()
    out.dtype = proto_dtype(arr.dtype)
    del out.shape[:]
    out.shape.extend(int(s) for s in arr.shape)
    out.data = arr.tobytes()


def from_proto(t: tensor_pb2.Tensor, like: ArrayLike | None = None) -> ArrayLike:
    """The tensor as a numpy array, or as a torch tensor on like's device when like is one."""
    dtype = _NP_BY_PROTO.get(t.dtype)
    if dtype is None:
        raise from_code(grpc.StatusCode.INTERNAL, f"server sent a tensor of unknown dtype {t.dtype}")
    arr = np.frombuffer(t.data, dtype=dtype).reshape(tuple(t.shape)).copy()
    if like is not None and _is_torch(like):
        import torch

        if dtype == np.dtype(ml_dtypes.bfloat16):
            out = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        else:
            out = torch.from_numpy(arr)
        return out.to(like.device, non_blocking=False)
    return arr
