"""Incremental decoding with the KV cache equals the full forward."""

from __future__ import annotations

import pytest
import torch

from models.layers.attention import KVCache

POS = ["rope", "alibi", "sinusoidal", "learned", "none"]


@pytest.mark.parametrize("pos", POS)
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_token_by_token_equals_full_forward(make_model, pos, kv_heads):
    model = make_model(pos_encoding=pos, num_kv_heads=kv_heads)
    torch.manual_seed(0)
    x = torch.randint(0, 64, (2, 10))
    full = model(x).logits
    cache = model.new_kv_cache(2)
    steps = [model(x[:, :4], kv_cache=cache).logits]  # prompt in one go
    for t in range(4, 10):
        steps.append(model(x[:, t:t + 1], kv_cache=cache).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)
    assert cache.length == 10


def test_chunks_and_explicit_path_with_cache(make_model):
    model = make_model(num_kv_heads=2, pos_encoding="alibi")
    x = torch.randint(0, 64, (1, 12))
    full = model(x).logits
    cache = model.new_kv_cache(batch_size=1)
    out = []
    for sl in (slice(0, 5), slice(5, 8), slice(8, 12)):
        o = model(x[:, sl], kv_cache=cache, return_attention=True)
        assert o.kv_cache is cache
        assert o.attentions[0].shape == (1, 4, sl.stop - sl.start, sl.stop)
        out.append(o.logits)
    torch.testing.assert_close(torch.cat(out, dim=1), full, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("pos", POS)
def test_left_padded_batch_decodes_like_each_row_alone(make_model, pos):
    model = make_model(pos_encoding=pos, num_kv_heads=2)
    torch.manual_seed(1)
    long_row, short_row = torch.randint(0, 64, (1, 6)), torch.randint(0, 64, (1, 3))
    cont = torch.randint(0, 64, (2, 3))
    prompt = torch.cat([long_row, torch.cat([torch.zeros(1, 3, dtype=torch.long), short_row], 1)])
    mask = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]])
    cache = model.new_kv_cache(2)
    logits = [model(prompt, attention_mask_BT=mask, kv_cache=cache).logits[:, -1:]]
    for t in range(3):
        logits.append(model(cont[:, t:t + 1], kv_cache=cache).logits)
    batched = torch.cat(logits, dim=1)
    for row, alone in ((0, long_row), (1, short_row)):
        seq = torch.cat([alone, cont[row:row + 1]], dim=1)
        expected = model(seq).logits[:, alone.shape[1] - 1:]
        torch.testing.assert_close(batched[row:row + 1], expected, atol=1e-5, rtol=1e-4)


def test_moe_model_with_cache(make_model):
    model = make_model(num_experts=4, moe_top_k=2)
    x = torch.randint(0, 64, (2, 8))
    full = model(x).logits
    cache = model.new_kv_cache(2)
    inc = [model(x[:, :3], kv_cache=cache).logits] + [model(x[:, t:t + 1], kv_cache=cache).logits for t in range(3, 8)]
    torch.testing.assert_close(torch.cat(inc, 1), full, atol=1e-5, rtol=1e-4)


def test_cache_limits(make_model):
    model = make_model()
    cache = model.new_kv_cache(1, max_len=4)
    model(torch.zeros(1, 4, dtype=torch.long), kv_cache=cache)
    with pytest.raises(ValueError, match="overflow"):
        model(torch.zeros(1, 1, dtype=torch.long), kv_cache=cache)
    with pytest.raises(ValueError, match="batch size"):
        model(torch.zeros(2, 1, dtype=torch.long), kv_cache=model.new_kv_cache(1))
    # Slots may outnumber max_seq_len (rows that joined a batch later start at later slots); a row's
    # positions may not: pads take slots without positions, real tokens past max_seq_len are refused.
    big = model.new_kv_cache(2, max_len=40)
    mask_BT = torch.tensor([[0] * 8 + [1] * 24, [1] * 32])
    model(torch.zeros(2, 32, dtype=torch.long), attention_mask_BT=mask_BT, kv_cache=big)
    model(torch.zeros(2, 1, dtype=torch.long), attention_mask_BT=torch.tensor([[1], [0]]), kv_cache=big)
    assert big.length == 33 and big.next_pos_B.tolist() == [25, 32]
    with pytest.raises(ValueError, match="sequence length 32 cached \\+ 1 new exceeds max_seq_len 32"):
        model(torch.zeros(2, 1, dtype=torch.long), kv_cache=big)
