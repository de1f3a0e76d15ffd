"""Near-duplicate removal (pipeline.data.near_dedup) against brute-force Jaccard, and through the shard stage."""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.config import ConfigError, load_config
from pipeline.data import near_dedup
from pipeline.config.data_filters import NearDedupSection
from pipeline.runner import make_plan, resolve
from pipeline.stages import STAGES
from pipeline.store.contracts import shard_files


def stories(data_root, n: int) -> list[str]:
    text = (data_root / "tinystories" / "validation_head.txt").read_text(encoding="utf-8")
    paras = [p.strip() for p in text.split("\n\n") if len(p.split()) >= 60]
    return list(dict.fromkeys(paras))[:n]


def edit(text: str, rng: random.Random, rate: float) -> str:
    """A near-copy: about ``rate`` of the words swapped with a neighbour or replaced, and a short tail cut."""
    words = text.split()
    for _ in range(max(1, int(rate * len(words)))):
        i = rng.randrange(len(words) - 1)
        if rng.random() < 0.5:
            words[i], words[i + 1] = words[i + 1], words[i]
        else:
            words[i] = rng.choice(["tree", "blue", "quickly", "ball", "sun"])
    return " ".join(words[: len(words) - rng.randrange(0, 3)])


def planted(data_root, n_docs=120, n_copies=40, seed=0) -> list[str]:
    rng = random.Random(seed)
    docs = stories(data_root, n_docs)
    out = list(docs)
    for _ in range(n_copies):
        out.insert(rng.randrange(len(out) + 1), edit(rng.choice(docs), rng, rng.choice([0.01, 0.03, 0.1, 0.3])))
    return out


def components(nodes, edges) -> list[set[int]]:
    """The connected components of a graph, by brute force: every node its own group, then, for each edge,
    the groups of its two ends merged."""
    groups = [{v} for v in nodes]
    for a, b in edges:
        ga, gb = (next(g for g in groups if v in g) for v in (a, b))
        if ga is not gb:
            ga |= gb
            groups = [g for g in groups if g is not gb]
    return groups


def brute_force_removed(texts: list[str], n: int, threshold: float) -> set[int]:
    """Connected components of the pairs with exact Jaccard >= threshold; all but the first removed."""
    sets = [set(near_dedup.shingles(t, n)) for t in texts]
    edges = [(a, b) for a, b in itertools.combinations(range(len(texts)), 2)
             if len(sets[a] & sets[b]) / len(sets[a] | sets[b]) >= threshold]
    return {m for group in components(range(len(texts)), edges) for m in sorted(group)[1:]}


def minhash_removed(texts: list[str], nd: NearDedupSection, partitions: int = 3) -> set[int]:
    sigs = near_dedup.signatures(texts, nd)
    parts = near_dedup.partition(near_dedup.band_keys(sigs, nd), 0, np.arange(len(texts)), partitions)
    pairs = near_dedup.candidates(*parts)
    joined, _ = near_dedup.verify(pairs, exact(texts, nd), nd.threshold)
    remove, _ = near_dedup.resolve(joined, set())
    return remove


def exact(texts: list[str], nd: NearDedupSection, inputs: list[list[str]] | None = None):
    inputs = inputs or [texts]
    return lambda a, ra, b, rb: near_dedup.similarities([inputs[a][r] for r in ra], [inputs[b][r] for r in rb],
                                                        nd.ngram)


def test_minhash_finds_what_brute_force_jaccard_finds(data_root):
    texts = planted(data_root)
    nd = NearDedupSection(enabled=True)
    truth = brute_force_removed(texts, nd.ngram, nd.threshold)
    got = minhash_removed(texts, nd)
    assert len(truth) >= 10  # the planted copies at low edit rates are above 0.8
    recall = len(got & truth) / len(truth)
    precision = len(got & truth) / max(len(got), 1)
    assert recall >= 0.95 and precision >= 0.99, (recall, precision, sorted(truth - got), sorted(got - truth))
    # Heavily edited copies (30% of words) are far below 0.8 and stay.
    assert len(got) < 40


def test_the_result_does_not_depend_on_how_keys_are_partitioned_or_inputs_split(data_root):
    texts = planted(data_root, 60, 20, seed=3)
    nd = NearDedupSection(enabled=True)
    one = minhash_removed(texts, nd, partitions=1)
    assert one == minhash_removed(texts, nd, partitions=7)
    # The same corpus as two inputs: global indices differ, the removed documents are the same ones.
    half = len(texts) // 2
    sig = [near_dedup.signatures(texts[:half], nd), near_dedup.signatures(texts[half:], nd)]
    parts = [near_dedup.partition(near_dedup.band_keys(s, nd), i, np.arange(len(s)), 4) for i, s in enumerate(sig)]
    pairs = np.unique(np.concatenate([near_dedup.candidates(*[p[k] for p in parts]) for k in range(4)]), axis=0)
    joined, _ = near_dedup.verify(pairs, exact(texts, nd, [texts[:half], texts[half:]]), nd.threshold)
    remove, _ = near_dedup.resolve(joined, set())
    as_positions = {i * half + r for i, r in map(near_dedup.split_gidx, remove)}
    assert as_positions == one


def test_the_first_of_a_cluster_is_kept_and_exact_duplicates_are_not_counted_again():
    base = " ".join(f"word{i}" for i in range(80))
    near = base.replace("word40", "other")
    texts = ["unrelated text " * 20, base, base, near]
    nd = NearDedupSection(enabled=True)
    sigs = near_dedup.signatures(texts, nd)
    pairs = near_dedup.candidates(*near_dedup.partition(near_dedup.band_keys(sigs, nd), 0, np.arange(4), 2))
    joined, sim = near_dedup.verify(pairs, exact(texts, nd), nd.threshold)
    remove, clusters = near_dedup.resolve(joined, excluded={2})  # 2 is an exact copy of 1, removed before
    assert remove == {3} and clusters == [[1, 3]]
    assert near_dedup.jaccard(base, near, 5) == pytest.approx(71 / 81)  # 5 of 76 shingles changed


@pytest.mark.parametrize("seed", range(4))
def test_the_clusters_are_the_connected_components_of_the_joined_pairs(seed):
    """``resolve`` against brute force on a random graph of documents of three inputs (global indices), with
    repeated and self pairs and excluded members (which still link the rest of their cluster); the result
    does not depend on the order of the pairs or of a pair's two ends."""
    rng = np.random.default_rng(seed)
    docs = np.array([(i << near_dedup.ROW_BITS) | int(r) for i in range(3)
                     for r in rng.choice(10_000, 50, replace=False)], dtype=np.int64)
    pairs = docs[rng.integers(0, len(docs), size=(90, 2))]
    excluded = set(rng.choice(docs, 12, replace=False).tolist())
    groups = components(sorted(set(pairs.reshape(-1).tolist())), pairs.tolist())
    expected = sorted(sorted(g - excluded) for g in groups if len(g - excluded) >= 2)
    assert len(expected) >= 5 and max(map(len, expected)) >= 4  # a graph with clusters worth the name
    assert any(len(g - excluded) < len(g) for g in groups if len(g - excluded) >= 2)  # exclusion exercised
    remove, clusters = near_dedup.resolve(pairs, excluded)
    assert clusters == expected
    assert remove == {m for c in expected for m in c[1:]}
    shuffled = pairs[rng.permutation(len(pairs))]
    flip = rng.random(len(pairs)) < 0.5
    shuffled[flip] = shuffled[flip][:, ::-1]
    assert near_dedup.resolve(shuffled, excluded) == (remove, clusters)


def test_signature_agreement_estimates_jaccard():
    rng = random.Random(1)
    vocab = [f"w{i}" for i in range(2000)]
    nd = NearDedupSection(enabled=True, bands=32, rows=8)  # 256 permutations: standard error <= 0.03
    for _ in range(10):
        a = [rng.choice(vocab) for _ in range(300)]
        b = list(a)
        for i in rng.sample(range(300), rng.randrange(5, 120)):
            b[i] = rng.choice(vocab)
        ta, tb = " ".join(a), " ".join(b)
        sigs = near_dedup.signatures([ta, tb], nd)
        assert np.mean(sigs[0] == sigs[1]) == pytest.approx(near_dedup.jaccard(ta, tb, 5), abs=0.1)


def shard_cfg(tmp_path, data_root, *overrides):
    return resolve(load_config(None, [f"run.workdir={tmp_path / 'work'}", f"data.data_root={tmp_path}",
                                      "data.train_paths=[a.txt, b.txt]", "data.validation_fraction=0.2",
                                      *overrides]))


class Tracker:
    def __init__(self):
        self.metrics, self.figures = {}, []

    def log_metrics(self, m, step=None):
        self.metrics.update(m)

    def set_tags(self, tags):
        pass

    def log_figure(self, fig, name):
        self.figures.append(name)


def test_the_shard_stage_removes_near_duplicates_across_inputs_and_counts_them(tmp_path, data_root):
    texts = planted(data_root, 80, 30, seed=5)
    half = len(texts) // 2
    (tmp_path / "a.txt").write_text("\n\n".join(texts[:half]) + "\n\n" + texts[0], encoding="utf-8")  # + an exact copy
    (tmp_path / "b.txt").write_text("\n\n".join(texts[half:]), encoding="utf-8")
    cfg = shard_cfg(tmp_path, data_root, "data.near_dedup.enabled=true")
    plan = {p.stage: p for p in make_plan(cfg)}
    tracker = Tracker()
    art = STAGES["shard"].execute(cfg, plan["shard"].hash, plan["shard"].path, {}, tracker)
    counts = art.manifest["counts"]
    expected = brute_force_removed(texts, 5, 0.8)
    assert counts["removed"]["duplicate"] == 1
    assert counts["removed"]["near_duplicate"] == len(expected) > 5
    kept = [t for s in ("train", "validation") for f in shard_files(art.path, s)
            for t in pq.read_table(f).column("text").to_pylist()]
    assert sorted(kept) == sorted(t for i, t in enumerate(texts) if i not in expected)
    nd = counts["near_dedup"]
    assert nd["clusters"] >= 1 and nd["largest_cluster"] >= 2
    assert sum(int(k) * v for k, v in nd["cluster_sizes"].items()) - nd["clusters"] == len(expected)
    sample = [json.loads(line) for line in (art.path / "near_duplicates.jsonl").read_text().splitlines()]
    assert len(sample) == min(20, nd["clusters"])
    assert all(row["jaccard"] >= 0.6 and row["kept"] != row["removed"] for row in sample)
    assert tracker.metrics["removed_near_duplicate"] == len(expected)
    assert tracker.metrics["near_dedup_clusters"] == nd["clusters"]
    assert tracker.figures == ["plots/near_duplicate_clusters.png"]
    # Off (the default), the same inputs keep every near-copy and the config's hash is the old one.
    off = shard_cfg(tmp_path, data_root)
    assert "near_dedup" not in json.dumps(STAGES["shard"].hash_config(off))


@pytest.mark.parametrize("override, pattern", [
    ("data.near_dedup.bands=0", r"data\.near_dedup\.bands=0 must be >= 1"),
    ("data.near_dedup.threshold=1.5", r"data\.near_dedup\.threshold=1\.5 must be in \[0, 1\]"),
    ("data.near_dedup.ngrams=3", r"unknown key data\.near_dedup\.'ngrams'; did you mean 'ngram'"),
])
def test_bad_near_dedup_settings_are_named(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, [override])


@pytest.mark.slow
def test_on_ray_the_shard_stage_filters_and_dedupes_as_it_does_in_process(tmp_path, data_root, ray_cluster,
                                                                           monkeypatch):
    """With Ray: signatures and key parts in the read tasks, a join task per partition, a verification
    task per pair of inputs; the shards and counts equal the in-process run's."""
    from pipeline.stages import shard

    texts = planted(data_root, 80, 30, seed=7)
    half = len(texts) // 2
    (tmp_path / "a.txt").write_text("\n\n".join(texts[:half] + ["Nur ein kurzer deutscher Satz über das Meer."]),
                                    encoding="utf-8")
    (tmp_path / "b.txt").write_text("\n\n".join(texts[half:]), encoding="utf-8")
    overrides = ["data.near_dedup.enabled=true", "data.quality.language.enabled=true",
                 "data.quality.gopher_repetition.enabled=true"]
    arts = {}
    for where in ("ray", "local"):
        if where == "local":
            monkeypatch.setattr(shard, "ray_running", lambda: False)
        cfg = resolve(load_config(None, [f"run.workdir={tmp_path / where}", f"data.data_root={tmp_path}",
                                         "data.train_paths=[a.txt, b.txt]", "data.validation_fraction=0.2",
                                         *overrides]))
        plan = {p.stage: p for p in make_plan(cfg)}
        arts[where] = STAGES["shard"].execute(cfg, plan["shard"].hash, plan["shard"].path, {}, Tracker())
    ray_counts, local_counts = (arts[w].manifest["counts"] for w in ("ray", "local"))
    assert ray_counts == local_counts
    assert ray_counts["removed"]["language"] == 1 and ray_counts["removed"]["near_duplicate"] > 5
    for split in ("train", "validation"):
        for a, b in zip(shard_files(arts["ray"].path, split), shard_files(arts["local"].path, split)):
            assert pq.read_table(a).equals(pq.read_table(b)), a.name
    assert (arts["ray"].path / "near_duplicates.jsonl").read_text() == \
        (arts["local"].path / "near_duplicates.jsonl").read_text()
