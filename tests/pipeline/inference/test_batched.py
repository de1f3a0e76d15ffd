"""Batched generation equals one-at-a-time generation, row by row (greedy and seeded sampling)."""

from __future__ import annotations

import pytest
import torch

from models import build_model
from models.generate import generate
from pipeline.inference.batched import generate_batch
from pipeline.inference.requests import GenRequest, check_fits

EOS = 3


@pytest.mark.parametrize("preset", ["debug_dense", "debug_moe", "debug_mamba"])
def test_each_row_of_a_padded_batch_equals_its_unbatched_output(preset):
    torch.manual_seed(1)
    model = build_model(preset, max_seq_len=64).eval()
    shapes = [(3, 20), (17, 5), (9, 30), (1, 12)]  # (prompt length, budget): unequal on purpose
    reqs = [GenRequest(tuple(torch.randint(5, 500, (n,)).tolist()), k) for n, k in shapes]
    batched = generate_batch(model, reqs, EOS)
    alone = [generate_batch(model, [r], EOS)[0] for r in reqs]
    assert batched == alone
    for r, got in zip(reqs, batched):  # and both equal models.generate's greedy continuation
        ref = generate(model, torch.tensor([r.prompt_ids]), r.max_new_tokens, temperature=0, eos_id=EOS)
        new = ref[0, len(r.prompt_ids):].tolist()
        assert got == new[:new.index(EOS)] if EOS in new else got == new
    assert [len(b) for b in batched] == [k for _, k in shapes]  # the seed is one whose untrained models rarely say EOS


def test_sampling_is_per_row_seeded_and_batch_independent():
    torch.manual_seed(1)
    model = build_model("debug_dense", max_seq_len=64).eval()
    reqs = [GenRequest((5, 6, 7, 8)[: i + 1], 10, temperature=1.0, top_p=0.9, seed=i) for i in range(4)]
    batched = generate_batch(model, reqs, EOS)
    assert batched == [generate_batch(model, [r], EOS)[0] for r in reqs]
    assert generate_batch(model, [GenRequest((5,), 10, 1.0, 0.9, seed=1)], EOS) != batched[0]


def test_a_row_ends_at_its_eos_and_the_others_carry_on_as_if_alone():
    torch.manual_seed(2)
    model = build_model("debug_dense", max_seq_len=64).eval()
    reqs = [GenRequest((5, 6), 12), GenRequest((9, 10, 11), 12)]
    free = generate_batch(model, reqs, eos_id=-1)  # no token is -1: both rows run to their budget
    stop = free[0][4]  # call the fifth token of row 0 the end of text
    assert stop not in free[0][:4]
    out = generate_batch(model, reqs, eos_id=stop)
    assert out[0] == free[0][:4]  # ended there, without the EOS itself
    assert out[1] == generate_batch(model, [reqs[1]], eos_id=stop)[0]


def test_requests_that_do_not_fit_are_refused_by_name():
    with pytest.raises(ValueError, match="exceeds the model's context of 16 tokens"):
        check_fits(GenRequest(tuple(range(5, 15)), 7), 16)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        check_fits(GenRequest((5,), 0), 16)
    with pytest.raises(ValueError, match="at least one request"):
        generate_batch(build_model("debug_dense"), [], EOS)


@pytest.mark.parametrize("preset", ["debug_dense", "debug_mamba"])
def test_a_long_prompt_and_a_long_budget_in_one_batch_both_run(preset):
    """Rows of 60 prompt + 2 new and 2 + 60 in a 64-token model: the batch spans 120 slots, each row's
    positions stay below 64 (this raised "KVCache max_len (120) exceeds max_seq_len (64)" before)."""
    torch.manual_seed(1)
    model = build_model(preset, max_seq_len=64).eval()
    reqs = [GenRequest(tuple(range(5, 65)), 2), GenRequest((5, 6), 60)]
    assert generate_batch(model, reqs, eos_id=-1) == [generate_batch(model, [r], eos_id=-1)[0] for r in reqs]
    assert [len(x) for x in generate_batch(model, reqs, eos_id=-1)] == [2, 60]
