"""Communication bytes per step, planned, equal the bytes of the real collectives of a 2-rank gloo run of
the training engine (ZeRO 1, 2, 3 and expert parallelism 2 at ZeRO-1), by torch.distributed function.

One launch (`pipeline.plan.comm_probe`, through tests/distributed.py) runs all four cases. Each rank
counts the payload it hands to every collective of its second step; the all-to-alls' payloads depend
on where the router sent tokens, so the world's mean is compared (the planner assumes balanced
routing, which the mean satisfies exactly: every row sent is received once). The model has tensors both
above and below ZeRO-3's persistence threshold, so both of its all-gather rules are exercised.
"""

from __future__ import annotations

import json

import pytest

from pipeline.plan.validation import COMM_CASES, COMM_DENSE, measured_payloads, planned_payloads
from tests.distributed import run_world


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    out = tmp_path_factory.mktemp("comm") / "comm.json"
    run_world("pipeline.plan.comm_probe", str(out))
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("case", COMM_CASES)
def test_planned_bytes_equal_the_real_collectives(probe, case):
    assert probe["world"] == 2
    assert planned_payloads(case) == measured_payloads(probe, case)


def test_the_probe_model_exercises_both_zero3_gather_rules():
    sizes = [COMM_DENSE.vocab_size * COMM_DENSE.d_model, COMM_DENSE.d_model]
    assert max(sizes) >= 100_000 > min(sizes)  # the embedding is gathered per micro-batch, the norms kept whole
