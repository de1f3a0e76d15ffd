"""Sampling: greedy is deterministic and matches argmax of the full forward; top-k/top-p supports."""

from __future__ import annotations

import pytest
import torch

from models.generate import generate, sample_next


def greedy_without_cache(model, ids, n):
    for _ in range(n):
        nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


@pytest.mark.parametrize("pos", ["rope", "learned", "alibi"])
def test_greedy_matches_argmax_loop_and_is_deterministic(make_model, pos):
    model = make_model(pos_encoding=pos, num_kv_heads=2, init_std=0.2)
    prompt = torch.randint(0, 64, (2, 5))
    a = generate(model, prompt, 8, temperature=0)
    b = generate(model, prompt, 8, temperature=0)
    assert a.shape == (2, 13) and torch.equal(a[:, :5], prompt)
    assert torch.equal(a, b)
    assert torch.equal(a, greedy_without_cache(model, prompt, 8))


def test_left_padded_prompts_generate_like_single_prompts(make_model):
    model = make_model(init_std=0.2)
    p0, p1 = torch.randint(0, 64, (1, 5)), torch.randint(0, 64, (1, 2))
    batch = torch.cat([p0, torch.cat([torch.zeros(1, 3, dtype=torch.long), p1], 1)])
    mask = torch.tensor([[1] * 5, [0, 0, 0, 1, 1]])
    out = generate(model, batch, 6, temperature=0, attention_mask_BT=mask)
    assert torch.equal(out[0:1, 5:], generate(model, p0, 6, temperature=0)[:, 5:])
    assert torch.equal(out[1:2, 5:], generate(model, p1, 6, temperature=0)[:, 2:])


def test_sampling_is_reproducible_with_a_generator(make_model):
    model = make_model(init_std=0.2)
    prompt = torch.randint(0, 64, (3, 4))
    a = generate(model, prompt, 10, temperature=1.0, generator=torch.Generator().manual_seed(7))
    b = generate(model, prompt, 10, temperature=1.0, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_top_k_restricts_the_support():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.5, -1.0, 2.9]]).repeat(2000, 1)
    draws = sample_next(logits, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(0))
    assert set(draws.tolist()) == {1, 3, 5}
    assert torch.equal(sample_next(logits[:1], temperature=5.0, top_k=1), torch.tensor([1]))


def test_top_p_restricts_the_support():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    logits = probs.log().unsqueeze(0).repeat(3000, 1)
    gen = torch.Generator().manual_seed(0)
    # 0.5 + 0.25 = 0.75 >= 0.7: the nucleus is {0, 1}.
    assert set(sample_next(logits, top_p=0.7, generator=gen).tolist()) == {0, 1}
    # 0.75 < 0.8 <= 0.9: {0, 1, 2}.
    assert set(sample_next(logits, top_p=0.8, generator=gen).tolist()) == {0, 1, 2}
    # Tiny p keeps only the most likely token.
    assert set(sample_next(logits, top_p=0.01, generator=gen).tolist()) == {0}


def test_eos_stops_rows_and_pads_with_eos(make_model):
    model = make_model(init_std=0.2)
    prompt = torch.randint(0, 64, (2, 3))
    free = generate(model, prompt, 10, temperature=0)
    eos = int(free[0, 5])  # row 0 emits this at its 3rd new token
    out = generate(model, prompt, 10, temperature=0, eos_id=eos)
    finished = []
    for row in out[:, 3:]:
        hits = (row == eos).nonzero()
        finished.append(len(hits) > 0)
        if finished[-1]:
            assert (row[hits[0].item():] == eos).all()  # once done, a row only repeats eos
    assert finished[0]
    # Until the eos, the rows are the unconstrained greedy continuation.
    first = (out[0, 3:] == eos).nonzero()[0].item()
    assert torch.equal(out[0, :3 + first + 1], free[0, :3 + first + 1])
    assert out.shape[1] == 13 or all(finished)
    # When every row ends, generation stops early.
    single = generate(model, prompt[:1], 10, temperature=0, eos_id=eos)
    assert single.shape[1] == 3 + first + 1 and single[0, -1] == eos


def test_generate_validates_arguments(make_model):
    model = make_model()
    prompt = torch.zeros(1, 30, dtype=torch.long)
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, prompt, 3)
    assert generate(model, prompt, 2, temperature=0).shape == (1, 32)
    assert torch.equal(generate(model, prompt, 0), prompt)
    for kw, word in ((dict(temperature=-1.0), "temperature"), (dict(top_k=0), "top_k"), (dict(top_p=0.0), "top_p")):
        with pytest.raises(ValueError, match=word):
            generate(model, prompt[:, :2], 1, **kw)


def test_generate_restores_training_mode(make_model):
    model = make_model().train()
    generate(model, torch.zeros(1, 2, dtype=torch.long), 2)
    assert model.training
