"""Near-duplicate removal across the whole corpus: MinHash, locality-sensitive hashing by band, and
connected components of the verified candidate pairs; the first document of each cluster (in input
order) is kept.

1. Signatures, where each input is read (its Ray task): a document's text, lower-cased with
   everything but letters and digits made a space, is cut into word ``ngram``-grams (shingles); its
   MinHash signature is ``bands * rows`` minimums of seeded universal hashes over the shingles' hashes
   (datasketch's ``MinHash``: 112 = 14 x 8, FineWeb's choice, by default). A band's key is a 64-bit hash
   of its ``rows`` values, so two documents of Jaccard similarity s share some band key with
   probability 1 - (1 - s^rows)^bands (0.9996 at s = 0.8 with 14 x 8, 0.05 at s = 0.5).
2. The keys are split by value into ``partitions`` parts in the same task; part p of every input goes
   to one join task (a shuffle: no process holds every key). Within a part, documents with equal
   (band, key) are candidates: each is linked to the group's first.
3. Candidates are verified: a pair is joined only when the exact Jaccard similarity of their shingle
   sets is at least ``threshold`` (the signature's estimate has a standard error of about 0.04 at 0.8
   with 112 permutations, which would miss about a fifth of the pairs just above the bar). One task
   per pair of inputs holding candidates reads those two inputs' documents; the stage's process
   receives only the similarities.
4. The clusters are the connected components of the joined pairs (scipy's ``csgraph``); a cluster keeps its
   member with the smallest global index (input, row), so the result depends on the corpus and its order
   alone.

datasketch's ``MinHashLSH`` keeps its whole index in one process; the banding and the join are done
here so that the index is spread over tasks.
"""

from __future__ import annotations

import re

import numpy as np
import xxhash

_NON_WORD = re.compile(r"[^\w]+|_+")
ROW_BITS = 32  # a global index is input << ROW_BITS | row
EDGE_DTYPE = np.dtype([("band", np.int32), ("key", np.uint64), ("gidx", np.int64)])


def shingles(text: str, n: int) -> list[bytes]:
    """The word n-grams of ``text`` after lower-casing and replacing non-word characters by spaces (a
    text of fewer than n words is one shingle)."""
    words = _NON_WORD.sub(" ", text.lower()).split()
    if len(words) <= n:
        return [" ".join(words).encode()]
    return [" ".join(words[i:i + n]).encode() for i in range(len(words) - n + 1)]


def _hash32(b: bytes) -> int:
    return xxhash.xxh32_intdigest(b)


def signatures(texts, nd) -> np.ndarray:
    """``[len(texts), bands * rows]`` uint64 MinHash signatures (datasketch's, seeded by ``nd.seed``)."""
    from datasketch import MinHash

    perms = nd.bands * nd.rows
    out = np.empty((len(texts), perms), dtype=np.uint64)
    proto = MinHash(num_perm=perms, seed=nd.seed, hashfunc=_hash32)  # the permutations, made once
    for i, text in enumerate(texts):
        m = MinHash(num_perm=perms, seed=nd.seed, hashfunc=_hash32, permutations=proto.permutations,
                    scheme=proto.scheme)
        m.update_batch(shingles(text, nd.ngram))
        out[i] = m.hashvalues
    return out


def band_keys(sigs: np.ndarray, nd) -> np.ndarray:
    """``[n, bands]`` uint64: each band's rows hashed to one key."""
    keys = np.empty((len(sigs), nd.bands), dtype=np.uint64)
    for i, sig in enumerate(sigs):
        for b in range(nd.bands):
            keys[i, b] = xxhash.xxh64_intdigest(sig[b * nd.rows:(b + 1) * nd.rows].tobytes(), seed=b)
    return keys


def partition(keys: np.ndarray, input_index: int, rows: np.ndarray, partitions: int) -> list[np.ndarray]:
    """One input's band keys of ``rows`` as ``partitions`` arrays of (band, key, global index), split by key."""
    n, bands = keys.shape
    flat = np.empty(len(rows) * bands, dtype=EDGE_DTYPE)
    flat["band"] = np.tile(np.arange(bands, dtype=np.int32), len(rows))
    flat["key"] = keys[rows].reshape(-1)
    flat["gidx"] = np.repeat((np.int64(input_index) << ROW_BITS) | rows.astype(np.int64), bands)
    which = (flat["key"] % np.uint64(partitions)).astype(np.int64)
    return [flat[which == p] for p in range(partitions)]


def candidates(*parts: np.ndarray) -> np.ndarray:
    """``[m, 2]`` int64 candidate pairs (first of a (band, key) group, another member), from one
    partition's keys of every input."""
    flat = np.concatenate(parts) if parts else np.empty(0, dtype=EDGE_DTYPE)
    if len(flat) == 0:
        return np.empty((0, 2), dtype=np.int64)
    order = np.lexsort((flat["gidx"], flat["key"], flat["band"]))
    s = flat[order]
    new_group = np.ones(len(s), dtype=bool)
    new_group[1:] = (s["band"][1:] != s["band"][:-1]) | (s["key"][1:] != s["key"][:-1])
    first = np.maximum.accumulate(np.where(new_group, np.arange(len(s)), 0))
    member = ~new_group
    pairs = np.stack([s["gidx"][first[member]], s["gidx"][member]], axis=1)
    pairs = pairs[pairs[:, 0] != pairs[:, 1]]
    return np.unique(pairs, axis=0) if len(pairs) else pairs


def split_gidx(g: int) -> tuple[int, int]:
    return g >> ROW_BITS, g & ((1 << ROW_BITS) - 1)


def similarities(texts_a: list[str], texts_b: list[str], n: int) -> np.ndarray:
    """The exact Jaccard similarity of each pair (texts_a[k], texts_b[k])."""
    return np.array([jaccard(a, b, n) for a, b in zip(texts_a, texts_b)], dtype=np.float64)


def by_input_pair(pairs: np.ndarray) -> dict[tuple[int, int], np.ndarray]:
    """The pairs grouped by the inputs their two documents are in (one verification task per group)."""
    ia, ib = pairs[:, 0] >> ROW_BITS, pairs[:, 1] >> ROW_BITS
    out = {}
    for a, b in sorted(set(zip(ia.tolist(), ib.tolist()))):
        out[(a, b)] = np.flatnonzero((ia == a) & (ib == b))
    return out


def verify(pairs: np.ndarray, similarity_of, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """The pairs whose shingle sets have an exact Jaccard similarity of at least ``threshold``, and every
    pair's similarity. ``similarity_of(input_a, rows_a, input_b, rows_b)`` gives the similarities of
    those rows' documents (a task that holds the two inputs' documents, with Ray)."""
    if len(pairs) == 0:
        return pairs, np.empty(0)
    sim = np.empty(len(pairs))
    mask = (1 << ROW_BITS) - 1
    for (a, b), idx in by_input_pair(pairs).items():
        sim[idx] = similarity_of(a, pairs[idx, 0] & mask, b, pairs[idx, 1] & mask)
    return pairs[sim >= threshold], sim


def resolve(pairs: np.ndarray, excluded: set[int]) -> tuple[set[int], list[list[int]]]:
    """Clusters of the joined pairs (``[m, 2]`` global indices): the connected components of the graph they
    are the edges of, less their ``excluded`` members (exact duplicates removed before, which still join
    what they link). Returns the global indices to remove (all but the smallest of each cluster) and every
    cluster of two or more documents, each in rising order, the clusters in order of their members."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    nodes, ends = np.unique(np.asarray(pairs, dtype=np.int64).reshape(-1), return_inverse=True)  # nodes: sorted
    ends = ends.reshape(-1, 2)
    graph = coo_matrix((np.ones(len(ends), dtype=np.int8), (ends[:, 0], ends[:, 1])), shape=(len(nodes), len(nodes)))
    _, component = connected_components(graph, directed=False)
    kept = ~np.isin(nodes, np.fromiter(excluded, dtype=np.int64, count=len(excluded)))
    nodes, component = nodes[kept], component[kept]
    order = np.argsort(component, kind="stable")  # each component's members stay in rising order
    starts = np.flatnonzero(np.diff(component[order], prepend=-1))
    clusters = sorted(members for members in (g.tolist() for g in np.split(nodes[order], starts[1:]))
                      if len(members) >= 2)
    return {m for members in clusters for m in members[1:]}, clusters


def jaccard(a: str, b: str, n: int) -> float:
    """The exact Jaccard similarity of two texts' shingle sets (for checks and samples)."""
    sa, sb = set(shingles(a, n)), set(shingles(b, n))
    return len(sa & sb) / max(len(sa | sb), 1)
