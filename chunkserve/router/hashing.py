"""Chained, process-independent hashes of a prompt's leading token chunks (DESIGN §3).

    h_k = xxh3_64(le64(h_{k-1}) ‖ le32(tokens of chunk k); seed),   h_0 = seed = xxh3_64(model name)

A cache salt (a tenant's namespace or a request's `cache_salt`, DESIGN §2) reseeds the chain:
seed = xxh3_64(salt; xxh3_64(model name)), so chunks of different salts never share a hash, on the
replica (its digest) or at the router (the ingress's hashes and the index built from them).

Only full chunks are hashed (a partial tail chunk is private on the replica, DESIGN §6), so a hash
names exactly one node of a replica's prefix tree, and holding h_k implies holding h_1..h_{k-1}.
The byte encoding is fixed (little-endian uint32 token ids, little-endian uint64 links) and
xxh3 is specified bit for bit, so every ingress, router and replica on every machine computes the
same list; Python's `hash()` is salted per process and would not.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

_LE = sys.byteorder == "little"
if array("I").itemsize != 4:  # C `unsigned int`: 4 bytes on every platform Ray and torch support
    raise ImportError("chunkserve.router.hashing needs a 4-byte array('I')")


def model_seed(model_name: str) -> int:
    """The chain's seed: prompts of different served models never share hashes."""
    return xxhash.xxh3_64_intdigest(model_name.encode("utf-8"))


def cache_seed(seed: str | int, salt: str | None) -> int:
    """The chain's seed for prompts under `salt` (None: the model's own seed, today's hashes)."""
    s = model_seed(seed) if isinstance(seed, str) else seed
    return s if salt is None else xxhash.xxh3_64_intdigest(salt.encode("utf-8", "surrogatepass"), s)


def _le32(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes, packed in C (no per-token Python work)."""
    packed = array("I", token_ids)
    if not _LE:
        packed.byteswap()
    return packed.tobytes()


def chunk_hashes(
    token_ids: Sequence[int], chunk_size: int, route_chunks: int, seed: str | int, *, after: int | None = None
) -> list[int]:
    """Chained hashes of the first `route_chunks` full chunks of `token_ids`.

    token_ids: the prompt's ids (any length; ids in [0, 2**32)); seed: the served model name (or
    its `model_seed`); after: continue a chain whose last hash this is (token_ids then start at
    its next chunk), so a prompt extending a hashed one hashes only its new chunks. Returns
    min(route_chunks, len(token_ids) // chunk_size) ints in [0, 2**64). A 2048-token prompt
    hashes in tens of microseconds: one C pack and one xxh3 call per chunk.
    """
    s = model_seed(seed) if isinstance(seed, str) else seed
    n = min(route_chunks, len(token_ids) // chunk_size)
    if n <= 0:
        return []
    data = memoryview(_le32(token_ids[: n * chunk_size]))
    step = 4 * chunk_size
    out = [0] * n
    h = s if after is None else after
    for k in range(n):
        h = xxhash.xxh3_64_intdigest(h.to_bytes(8, "little") + data[k * step : (k + 1) * step], s)
        out[k] = h
    return out
