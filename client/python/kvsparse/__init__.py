"""kvsparse: Python client of kvsparse-server, the KV-offloaded sparse decoding service.

    import kvsparse
    with kvsparse.Client("127.0.0.1:50051") as c:
        c.store.create_sequence("s1", kvsparse.ModelShape(32, 32, 8, 128, "bf16"),
                                kvsparse.Placement(signature_bits=32))
        c.store.append("s1", k, v)                    # [layers, tokens, Hkv, d]
        r = c.attention.decode(3, ["s1"], q, kvsparse.HashTopK(top_k_fraction=0.02))
        r.output, r.heads[0].rows_fetched

``kvsparse.torch.hf`` puts kvsparse under transformers' ``model.generate`` (needs torch and
transformers).
"""

from kvsparse.grpc.client import (
    AttentionClient,
    Client,
    Credentials,
    DecodeResult,
    DecodeStream,
    GatherResult,
    HeadStats,
    KvStoreClient,
    SequenceInfo,
    ShardedKvStoreClient,
    open_channel,
)
from kvsparse.errors import (
    Aborted,
    AlreadyExists,
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    KvSparseError,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    Unknown,
)
from kvsparse.grpc.local_server import LocalServer
from kvsparse.placement import shard_of
from kvsparse.methods import (
    FLAGSHIP,
    FLAGSHIP_TEXT,
    Dense,
    HashTopK,
    Method,
    ModelShape,
    Placement,
    Saap,
    Santa,
    TopK,
    VAttention,
    method_text,
    parse_method,
    placement_for,
)

__version__ = "0.1.0"

__all__ = [
    "Aborted",
    "AlreadyExists",
    "AttentionClient",
    "Cancelled",
    "Client",
    "Credentials",
    "DataLoss",
    "DeadlineExceeded",
    "DecodeResult",
    "DecodeStream",
    "Dense",
    "FailedPrecondition",
    "FLAGSHIP",
    "FLAGSHIP_TEXT",
    "GatherResult",
    "HashTopK",
    "HeadStats",
    "Internal",
    "InvalidArgument",
    "KvSparseError",
    "KvStoreClient",
    "LocalServer",
    "Method",
    "ModelShape",
    "NotFound",
    "OutOfRange",
    "PermissionDenied",
    "Placement",
    "ResourceExhausted",
    "Saap",
    "Santa",
    "SequenceInfo",
    "ShardedKvStoreClient",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "TopK",
    "Unknown",
    "VAttention",
    "method_text",
    "open_channel",
    "parse_method",
    "placement_for",
    "shard_of",
]
