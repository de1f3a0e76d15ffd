"""Continuous batching: rows that join a running batch at different steps, leave it as they end, or are
cancelled, each get exactly what they get alone; tokens reach their callbacks at the step that made them;
the batch's KV slots stay within max_batch_tokens; static batching admits only into an empty engine."""

from __future__ import annotations

import pytest
import torch

from models import build_model
from models.layers.attention import KVCache
from pipeline.inference.requests import GenRequest
from models.generate import generate
from pipeline.inference.engine import (FINISH_CANCELLED, FINISH_EOS, FINISH_ERROR, FINISH_LENGTH, Engine,
                                         serve_dropless)

EOS = 3

MODELS = {
    "dense": lambda: build_model("debug_dense", max_seq_len=64),
    "alibi": lambda: build_model("debug_dense", max_seq_len=64, pos_encoding="alibi"),
    "moe": lambda: build_model("debug_moe", max_seq_len=64),
    "mla": lambda: build_model("cpu_mla_moe", max_seq_len=64, d_model=64, n_layers=2, moe_d_ff=64),
    "mamba": lambda: build_model("debug_mamba", max_seq_len=64),
    "mamba2": lambda: build_model("debug_mamba2", max_seq_len=64, ssm_n_groups=2),
    "hybrid": lambda: build_model("debug_hybrid", max_seq_len=64, ssm_n_groups=2, num_kv_heads=2),
    "learned": lambda: build_model("debug_dense", max_seq_len=64, pos_encoding="learned"),
    "sinusoidal": lambda: build_model("debug_dense", max_seq_len=64, pos_encoding="sinusoidal"),
    # dynamic NTK past the trained 16 positions: each row's frequencies from its own length
    "dynamic_ntk": lambda: build_model("debug_dense", max_seq_len=64, rope_scaling=4.0, rope_scaling_type="dynamic",
                                       rope_original_max_seq_len=16),
    # capacity for one slot per expert and token: a batch's rows and pads would crowd each other out
    "moe_capacity": lambda: build_model("debug_moe", max_seq_len=64, moe_capacity_factor=1.0),
}


def _alone(model, r: GenRequest) -> list[int]:
    """The row alone through ``models.generate``: an independent path (no engine, no batch, its own KV
    cache), seeded as the engine seeds the row; ends at the row's EOS, as the engine's rows do. A
    capacity-limited MoE routes dropless as the engine serves it."""
    serve_dropless(model)
    g = torch.Generator().manual_seed(r.seed)
    out = generate(model, torch.tensor([list(r.prompt_ids)]), r.max_new_tokens, temperature=r.temperature,
                   top_p=r.top_p, eos_id=EOS, generator=g)[0, len(r.prompt_ids):].tolist()
    return out[:out.index(EOS) + 1] if EOS in out else out


def _run_with_arrivals(engine: Engine, arrivals: dict[int, list[GenRequest]]):
    """Step the engine, submitting arrivals[k] before step k; returns the tickets in submission order
    and, per ticket, the step at which each of its tokens arrived."""
    tickets, seen = [], []
    step = 0
    while step <= max(arrivals) or engine.busy:
        for r in arrivals.get(step, []):
            arrived: list[tuple[int, int]] = []
            seen.append(arrived)
            tickets.append(engine.submit(r, on_token=lambda tok, a=arrived: a.append((engine.stats["steps"], tok))))
        engine.step()
        step += 1
    return tickets, seen


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_rows_joining_and_leaving_a_running_batch_get_what_they_get_alone(kind):
    torch.manual_seed(3)
    model = MODELS[kind]().eval()
    g = torch.Generator().manual_seed(0)

    def req(n: int, budget: int, **kw) -> GenRequest:
        return GenRequest(tuple(torch.randint(5, 500, (n,), generator=g).tolist()), budget, **kw)

    arrivals = {  # (prompt length, budget): a long prompt joins rows that have run for a while, and so on
        0: [req(3, 30), req(11, 4)],
        2: [req(20, 25)],
        5: [req(1, 6, temperature=1.0, top_p=0.9, seed=5), req(40, 20)],
        6: [req(7, 12, temperature=0.7, seed=9)],
        30: [req(2, 10)],  # after the batch has emptied
    }
    engine = Engine(model, EOS, max_rows=8)
    tickets, _ = _run_with_arrivals(engine, arrivals)
    for t in tickets:
        assert t.tokens == _alone(model, t.request), t.request
        assert t.finish in (FINISH_EOS, FINISH_LENGTH)
    assert engine.stats["largest"] == 5 and engine.stats["rows"] == 7
    assert [len(t.tokens) for t in tickets] == [30, 4, 25, 6, 20, 12, 10]  # no row ended at EOS: all ran long
    assert not engine.busy and engine._cache is None  # empty again: nothing held


@pytest.mark.parametrize("kind", ["dense", "mla", "mamba", "mamba2", "hybrid"])
def test_short_rows_join_in_the_free_slot_of_a_running_batch_without_a_copy(kind):
    torch.manual_seed(3)
    model = MODELS[kind]().eval()
    arrivals = {0: [GenRequest((5, 6, 7, 8, 9), 40)], 3: [GenRequest((10, 11), 5)],
                9: [GenRequest((12, 13, 14), 6, temperature=1.0, seed=2)], 17: [GenRequest((15,), 4)]}
    engine = Engine(model, EOS, max_rows=8)
    tickets, seen = _run_with_arrivals(engine, arrivals)
    assert [t.tokens for t in tickets] == [_alone(model, t.request) for t in tickets]
    assert [s for s, _ in seen[2]][:2] == [9, 10]  # each joined at the step it arrived
    # the first row's batch was built with a free slot; each later row took it, and left it again
    assert engine.stats["joins"] == 4 and engine.stats["rebuilds"] == 1 and engine.stats["largest"] == 2


def test_tokens_arrive_at_the_step_that_made_them():
    torch.manual_seed(3)
    model = MODELS["dense"]().eval()
    engine = Engine(model, EOS)
    tickets, seen = _run_with_arrivals(engine, {0: [GenRequest((5, 6, 7), 8)], 3: [GenRequest((9,), 4)]})
    # the first token comes from the prompt's forward (before the step's decode), then one per step
    assert [s for s, _ in seen[0]] == list(range(8))
    assert [s for s, _ in seen[1]] == [3, 4, 5, 6]
    assert [tok for _, tok in seen[0]] == tickets[0].tokens and [tok for _, tok in seen[1]] == tickets[1].tokens


@pytest.mark.parametrize("kind", ["dense", "mamba2", "hybrid"])
def test_rows_that_ask_for_logprobs_get_the_models_log_softmax_of_each_token_they_made(kind):
    """In a batch that rows join and leave, each new token's recorded log-probability and top k are the
    model's log-softmax at its position, as one forward over the row's whole sequence computes them;
    a row that asks for none records none, and the tokens are what they are without asking."""
    from pipeline.inference.scoring import score_tokens

    torch.manual_seed(3)
    model = MODELS[kind]().eval()
    arrivals = {0: [GenRequest((5, 6, 7, 8, 9), 12, logprobs=3), GenRequest((10, 11), 6)],
                2: [GenRequest((12, 13, 14), 8, temperature=1.0, seed=2, logprobs=0)],
                4: [GenRequest((15,), 5, logprobs=5)]}
    engine = Engine(model, EOS, max_rows=8)
    tickets, _ = _run_with_arrivals(engine, arrivals)
    assert tickets[1].scores == []
    for t in tickets:
        assert t.tokens == _alone(model, GenRequest(t.request.prompt_ids, t.request.max_new_tokens,
                                                    t.request.temperature, t.request.top_p, t.request.seed))
    for t in (tickets[0], tickets[2], tickets[3]):
        made = [*t.tokens, *([EOS] if t.finish == FINISH_EOS else [])]
        assert len(t.scores) == len(made)
        full = [*t.request.prompt_ids, *made]
        k = t.request.logprobs
        expected = score_tokens(model, full, k)
        first = len(t.request.prompt_ids) - 1  # the position that predicts the first new token
        assert [lp for lp, _ in t.scores] == pytest.approx(expected.logprobs[first:], abs=1e-5)
        for (_, top), want in zip(t.scores, expected.top[first:]):
            assert len(top) == k and [i for i, _ in top] == [i for i, _ in want]
            assert [v for _, v in top] == pytest.approx([v for _, v in want], abs=1e-5)
        if t.request.temperature == 0:  # greedy: each token is the most likely, its value the top one
            assert all(top[0][0] == tok and top[0][1] == lp for (lp, top), tok in zip(t.scores, made))


def test_a_cancelled_row_stops_at_the_next_step_and_the_others_carry_on():
    torch.manual_seed(3)
    model = MODELS["dense"]().eval()
    engine = Engine(model, EOS)
    a, b = GenRequest((5, 6, 7), 40), GenRequest((8, 9), 30)
    ta = engine.submit(a, on_token=lambda tok: ta.cancel() if len(ta.tokens) == 5 else None)
    tb = engine.submit(b)
    done = []
    tc = engine.submit(GenRequest((10,), 5), on_done=lambda reason, err: done.append((reason, err)))
    tc.cancel()  # before it was admitted: it never runs
    engine.run_until_idle()
    assert ta.finish == FINISH_CANCELLED and len(ta.tokens) == 5  # cancelled in its 5th token's callback
    assert ta.tokens == _alone(model, a)[:5]
    assert tb.tokens == _alone(model, b) and tb.finish == FINISH_LENGTH
    assert tc.tokens == [] and done == [(FINISH_CANCELLED, None)]
    assert engine.stats["stopped"] == 2 and engine.stats["steps_after_cancel_max"] <= 1


def test_the_batch_stays_within_max_batch_tokens_and_the_queue_keeps_its_order():
    torch.manual_seed(3)
    model = MODELS["dense"]().eval()
    bound = 130
    engine = Engine(model, EOS, max_batch_tokens=bound)
    reqs = [GenRequest((5, 6), 40), GenRequest(tuple(range(5, 35)), 30), GenRequest((7,), 3)]
    tickets = [engine.submit(r) for r in reqs]
    admitted_at, peak = {}, 0
    step = 0
    while engine.busy:
        engine.step()
        for i, t in enumerate(tickets):
            if t.tokens and i not in admitted_at:
                admitted_at[i] = step
        if engine._cache is not None:
            peak = max(peak, len(engine._slots) * engine._cache.max_len)  # free rows included
        step += 1
    assert peak <= bound
    # The second (30 prompt + 30 new) fits beside the first (2 + 40) once 2 x (30 + the first's
    # remaining 39 - k) <= 130, at step 4; the third, small as it is, does not overtake it, and fits
    # only when the second has ended (step 32): 3 rows x 60+ slots would not.
    assert admitted_at == {0: 0, 1: 4, 2: 33}
    assert [t.tokens for t in tickets] == [_alone(model, r) for r in reqs]
    with pytest.raises(ValueError, match="max_batch_tokens=32 must be >= the model's max_seq_len \\(64\\)"):
        Engine(model, EOS, max_batch_tokens=32)


def test_static_batching_admits_only_into_an_empty_engine():
    torch.manual_seed(3)
    model = MODELS["dense"]().eval()
    engine = Engine(model, EOS, join_running=False)
    tickets, seen = _run_with_arrivals(engine, {0: [GenRequest((5, 6), 10)], 2: [GenRequest((7,), 3)]})
    assert seen[1][0][0] == 9  # joined only after the first row's last step
    assert [t.tokens for t in tickets] == [_alone(model, t.request) for t in tickets]


def test_a_failing_forward_ends_its_rows_with_the_error_and_the_engine_goes_on():
    torch.manual_seed(3)
    model = MODELS["dense"]().eval()
    engine = Engine(model, EOS)
    t = engine.submit(GenRequest((5, 6), 10))
    engine.step()
    real = model.forward
    model.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("out of memory"))
    errors = []
    t2 = engine.submit(GenRequest((7,), 3), on_done=lambda reason, err: errors.append((reason, str(err))))
    engine.step()
    model.forward = real
    assert t.finish == t2.finish == FINISH_ERROR and errors == [(FINISH_ERROR, "out of memory")]
    again = engine.submit(GenRequest((5, 6), 10))
    engine.run_until_idle()
    assert again.tokens == _alone(model, again.request)


def test_gather_rows_right_aligns_and_trims_what_no_row_uses():
    model = MODELS["dense"]().eval()
    a = model.new_kv_cache(2, max_len=10)
    model(torch.tensor([[0, 0, 5, 6], [0, 7, 8, 9]]), attention_mask_BT=torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]]),
          kv_cache=a)
    b = model.new_kv_cache(1, max_len=10)
    model(torch.tensor([[4, 5]]), kv_cache=b)
    out = KVCache.gather_rows([(a, torch.tensor([0])), (b, torch.tensor([0]))], spare=3)
    # row 0 of a used slots 2-3 of 4; b's row 0-1: two filled slots each, aligned; capacity 2 + 3
    assert out.length == 2 and out.max_len == 5 and out.next_pos_B.tolist() == [2, 2]
    assert out.key_mask_BS[:, :2].all() and torch.equal(out.k_BGSK[0][0, :, :2], a.k_BGSK[0][0, :, 2:4])
    assert torch.equal(out.v_BGSK[1][1, :, :2], b.v_BGSK[1][0, :, :2])
    wide = KVCache.gather_rows([(a, torch.tensor([1])), (b, torch.tensor([0]))])
    assert wide.length == 3 and wide.key_mask_BS.tolist() == [[True] * 3, [False, True, True]]
    assert wide.positions_BS[1, 1:].tolist() == [0, 1]


def test_requests_that_end_at_their_first_token_count_in_the_largest_batch():
    """What lm-evaluation-harness sends (max_tokens 1) never reaches a decode step; the status line's
    "largest batch" read 0 after a whole harness run."""
    model = MODELS["dense"]().eval()
    engine = Engine(model, EOS, max_rows=8)
    tickets = [engine.submit(GenRequest((5 + i, 17, 42), 1)) for i in range(3)]
    while engine.busy:
        engine.step()
    assert all(len(t.tokens) == 1 for t in tickets)
    assert engine.stats["largest"] == 3 and engine.stats["steps"] == 0  # no decode step at all
