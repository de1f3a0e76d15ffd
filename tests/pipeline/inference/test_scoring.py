"""Token log-probabilities for the completions API's logprobs and echo, against a direct forward pass."""

from __future__ import annotations

import pytest
import torch

from models import PRESETS, build_model
from pipeline.inference.scoring import can_score, score_tokens


@pytest.mark.parametrize("preset", ["debug_dense", "debug_moe", "debug_mamba"])
def test_each_tokens_logprob_is_the_models_log_softmax_at_its_position(preset):
    torch.manual_seed(0)
    model = build_model(preset, max_seq_len=64).eval()
    ids = torch.randint(5, 500, (20,)).tolist()
    scores = score_tokens(model, ids, k=3)
    with torch.no_grad():  # each prefix alone: position t's distribution sees only ids[:t]
        for t in (1, 7, 19):
            logp = torch.log_softmax(model(torch.tensor([ids[:t]])).logits[0, -1].float(), dim=-1)
            assert scores.logprobs[t - 1] == pytest.approx(logp[ids[t]].item(), abs=1e-5)
            top = logp.topk(3)
            assert [a for a, _ in scores.top[t - 1]] == top.indices.tolist()
            assert [v for _, v in scores.top[t - 1]] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert len(scores.logprobs) == len(scores.top) == 19
    # A token that is its position's most likely one has exactly the first top entry's value (harnesses compare).
    best = [t for t in range(1, 20) if scores.top[t - 1][0][0] == ids[t]]
    greedy = ids[:1] + [scores.top[0][0][0]]
    assert score_tokens(model, greedy, k=1).logprobs[0] == score_tokens(model, greedy, k=1).top[0][0][1]
    assert all(scores.logprobs[t - 1] == scores.top[t - 1][0][1] for t in best)
    assert score_tokens(model, ids, k=0).top == [[] for _ in range(19)]


def test_what_cannot_be_scored_is_refused():
    model = build_model("debug_dense", max_seq_len=64).eval()
    with pytest.raises(ValueError, match="at least two tokens"):
        score_tokens(model, [5], k=1)
    seq2seq = [n for n, c in PRESETS.items() if c.arch == "encoder_decoder"]
    assert seq2seq and not can_score(build_model(seq2seq[0]))
    with pytest.raises(ValueError, match="cannot score"):
        score_tokens(build_model(seq2seq[0]), [5, 6], k=1)
