"""Which store shard holds a sequence: rendezvous (highest-random-weight) hashing of its id.

The same function as the server's ``kvstore/placement.h``, bit for bit (both are tested against
the same vectors), so a model server places a sequence on the shard where every worker looks for
it. A shard is known by its index in the fleet's list (a StatefulSet pod's ordinal).
"""

from __future__ import annotations

import re

__all__ = ["sequence_key", "shard_weight", "shard_of", "expand_shard_list"]

_MASK = (1 << 64) - 1
_MAX_SHARDS = 4096
_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")


def _mix64(x: int) -> int:
    """splitmix64's finaliser."""
    x &= _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def sequence_key(sequence_id: str) -> int:
    """FNV-1a (64-bit) of the id's UTF-8 bytes."""
    h = 0xCBF29CE484222325
    for c in sequence_id.encode():
        h = ((h ^ c) * 0x100000001B3) & _MASK
    return h


def shard_weight(key: int, shard: int) -> int:
    s = _mix64(key + 0x9E3779B97F4A7C15)
    h = _mix64(shard * 0xD6E8FEB86659FD93 + 1)
    return _mix64(s ^ h)


def shard_of(sequence_id: str, num_shards: int) -> int:
    """The shard in ``range(num_shards)`` with the largest weight (ties: the lowest index)."""
    if num_shards < 1:
        raise ValueError("num_shards must be at least 1")
    key = sequence_key(sequence_id)
    weights = [shard_weight(key, i) for i in range(num_shards)]
    return weights.index(max(weights))


def expand_shard_list(targets: str) -> list[str]:
    """Comma-separated addresses in shard order; one ``{A..B}`` in an item expands to B-A+1
    items (``kvsparse-store-{0..3}.kvsparse-store:50051``: a StatefulSet's four pods). ValueError
    for an empty item, a malformed range, a duplicate, or more than 4096 shards."""
    out: list[str] = []
    for raw in targets.split(","):
        item = raw.strip()
        if not item:
            raise ValueError(f"empty address in the store list {targets!r}")
        if "{" not in item:
            out.append(item)
        else:
            m = _RANGE.search(item)
            if m is None or "{" in item[m.end():] or "{" in item[: m.start()]:
                raise ValueError(f"store address {item!r}: a range must read {{FIRST..LAST}}")
            first, last = int(m.group(1)), int(m.group(2))
            if last < first:
                raise ValueError(f"store address {item!r}: a range must read {{FIRST..LAST}} with FIRST <= LAST")
            if last - first >= _MAX_SHARDS:
                raise ValueError(f"more than {_MAX_SHARDS} store shards")
            out.extend(f"{item[: m.start()]}{i}{item[m.end():]}" for i in range(first, last + 1))
        if len(out) > _MAX_SHARDS:
            raise ValueError(f"more than {_MAX_SHARDS} store shards")
    if len(set(out)) != len(out):
        raise ValueError(f"a store shard is listed twice in {targets!r}")
    return out
