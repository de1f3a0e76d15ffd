"""2 ranks == 1 rank, and exact resume, through DeepSpeed over gloo (one 2-process launch, and one
4-process launch for experts with replicas)."""

from __future__ import annotations

import json

import pytest

from tests.distributed import run_world

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    run_world("tests.pipeline.training.dist_checks", str(out), world_size=2, timeout=900)
    return out


@pytest.fixture(scope="module")
def results(world2):
    return json.loads((world2 / "results.json").read_text())


def test_canonical_checkpoint_resumes_on_another_world_size(world2):
    """Saved by 2 ranks (ZeRO-2, ZeRO-3, MoE with ep_size 2, and ZeRO-1 with each sequence split over the two);
    resumed by 1 rank under other ZeRO stages, ep_size 1 and whole sequences; the weights after 2 more steps
    equal 4 single-process steps."""
    assert json.loads((world2 / "results.json").read_text())["canonical_saved_world"] == 2
    run_world("tests.pipeline.training.dist_checks", "canonical-resume", str(world2), world_size=1, timeout=600)
    r = json.loads((world2 / "canonical_resume.json").read_text())
    one_rank = r.pop("one_rank_zero1")
    assert set(r) == {"zero2_to_zero1", "zero2_to_zero0", "zero3_to_zero1", "ep2_to_ep1_zero1", "sp2_to_sp1_zero1"}
    # ZeRO-1 over one rank partitions nothing: the engine runs stage 0 without the all-reduce (issue 18),
    # and still trains like plain torch, reports the clipping norm and resumes bit for bit.
    assert one_rank["engine_stage"] == 0 and one_rank["allreduce"] is False, one_rank
    assert one_rank["max_abs_diff"] < 1e-5, one_rank
    assert len(one_rank["grad_norms"]) == len(one_rank["reference_grad_norms"]) == 4
    for got, ref in zip(one_rank["grad_norms"], one_rank["reference_grad_norms"]):
        assert abs(got - ref) < 1e-5 * ref, one_rank
    # optimizer.grad_clip 0: nothing is clipped, and grad_norm is still the gradients' norm (it read 0).
    noclip = one_rank.pop("noclip")
    assert noclip["max_abs_diff"] < 1e-5, noclip
    assert len(noclip["grad_norms"]) == len(noclip["reference_grad_norms"]) == 4
    for got, ref in zip(noclip["grad_norms"], noclip["reference_grad_norms"]):
        assert ref > 0 and abs(got - ref) < 1e-5 * ref, noclip
    assert one_rank["resume"] == {"step_restored": 2, "losses_equal": True, "weights_identical": True}, one_rank
    for case, v in r.items():
        assert v["world_size"] == 1 and v["step"] == 2, (case, v)
        assert v["max_abs_diff"] < 1e-5, (case, v)


def test_canonical_checkpoint_resumes_on_another_layout_of_the_same_world(results):
    """2 ranks: ZeRO-2 -> ZeRO-3 (weights partitioned on load), MoE ep_size 1 -> 2 (experts split), and
    V3's router ep_size 2 -> 1 with ZeRO 2 -> 1: the whole state after 2 more steps, its score biases
    (buffers) included, equals 4 single-process steps (before canonical.pt carried buffers, the biases
    restarted at 0 and this case was off by the biases' size)."""
    r = results["canonical_same_world"]
    assert set(r) == {"zero2_to_zero3", "ep1_to_ep2_zero1", "v3_ep2_to_ep1_zero1"}
    for case, v in r.items():
        assert v["world_size"] == 2 and v["step"] == 2, (case, v)
        assert v["max_abs_diff"] < 1e-5, (case, v)


@pytest.mark.parametrize("case", [
    "dense_zero0", "dense_zero1", "dense_zero2", "dense_zero3", "dense_zero2_offload", "dense_zero3_offload_all",
    "dense_zero1_activation_ckpt", "moe_zero1", "moe_zero2", "dense_zero1_amp_bf16", "dense_zero1_compile",
    "dense_zero1_compile_activation_ckpt", "dense_zero1_label_smoothing", "dense_zero1_plain_loss", "mla_zero3", "mla_moe_shared_zero2", "mamba_zero1", "mamba_zero3",
    "mamba_zero2_activation_ckpt", "moe_v3_bias_zero1", "moe_v3_bias_zero2", "mamba2_zero1", "mamba2_zero3",
    "mamba2_zero1_activation_ckpt", "hybrid_moe_zero1", "hybrid_zero3", "hybrid_zero1_activation_ckpt",
    # sequence parallelism: the two ranks split every sequence (DeepSpeed-Ulysses) instead of the batch
    "sp2_zero1", "sp2_zero2", "sp2_zero3", "sp2_zero1_activation_ckpt", "sp2_moe_zero1", "sp2_moe_v3_sequence_aux_zero2",
    "sp2_mla_zero3", "sp2_mla_moe_shared_zero2",
])
def test_two_ranks_match_one_process(results, case):
    r = results[case]
    assert r["moved"] > 1e-3  # the steps really changed the weights, so equality means something
    assert r["max_abs_diff"] < 1e-5, r  # the score biases included (they are in the state dict)
    if "v3_bias" in case or "v3_sequence" in case:  # two steps, one bias step of 0.01 each (not one per micro-batch): whole steps, <= 2
        biases = [b for layer in r["score_bias"] for b in layer]
        assert len(r["score_bias"]) == 2 and any(b != 0 for b in biases), r
        assert all(round(abs(b) / 0.01) in (0, 1, 2) and abs(b) == pytest.approx(round(abs(b) / 0.01) * 0.01)
                   for b in biases), r


@pytest.mark.parametrize("case", ["ep2_zero1", "ep2_zero2", "ep2_capacity_zero1", "ep2_mla_zero1", "ep2_v3_bias_zero1"])
def test_expert_parallel_matches_one_process(results, case):
    r = results[case]
    assert r["moved"] > 1e-3
    assert r["max_abs_diff"] < 1e-5, r
    assert_grad_norms_match(r)
    if "capacity" in case:
        assert r["dropped_fraction"] > 0.05  # tokens were dropped, and the same ones as in one process
    else:
        assert r["dropped_fraction"] == 0.0


def test_expert_parallel_with_zero3_is_refused_clearly(results):
    assert "train.zero_stage=3 with parallel.ep_size > 1 is not supported" in results["ep_zero3_refused"]


@pytest.mark.parametrize("case", ["resume", "resume_ep2", "resume_mla_ep2", "resume_v3_bias"])
def test_resume_is_bit_exact(results, case):
    r = results[case]
    assert r["step_restored"] == 2
    assert r["losses_equal"] is True
    assert r["weights_identical"] is True


def test_deepspeed_never_builds_its_inference_all_reduce_op(results):
    """DeepSpeed's CPU backend compiles a shared-memory all-reduce op for inference (40-70 s on a
    machine's first run) and loads it in every process; training never calls it, and build_engine
    keeps it from being built (``skip_inference_shm_op``)."""
    assert results["deepspeed_backend"] == {"kind": "TorchBackend", "shm_op": "None"}


def test_expert_load_is_summed_over_ranks(results):
    r = results["expert_counts"]
    assert r["distributed"] == r["reference"]  # exact integer counts, every layer and expert
    assert r["micro_batches"] == 4  # 2 ranks x 2 accumulation steps
    assert abs(r["load_shares_sum"] - 1.0) < 1e-12


def test_label_smoothing_is_what_the_engine_trains_on(results):
    """Same data and start as dense_zero1, another loss: the reported losses differ from the first step on
    (the weights' match with the smoothed single-process reference is in test_two_ranks_match_one_process)."""
    plain, smoothed = results["dense_zero1"]["losses"], results["dense_zero1_label_smoothing"]["losses"]
    assert all(s != p for s, p in zip(smoothed, plain)), (smoothed, plain)


def assert_grad_norms_match(r: dict) -> None:
    """The global gradient norm DeepSpeed clipped with, each step, is the single process's."""
    assert len(r["grad_norms"]) == len(r["reference_grad_norms"]) == 2
    for got, ref in zip(r["grad_norms"], r["reference_grad_norms"]):
        assert abs(got - ref) < 1e-5 * ref, r


@pytest.fixture(scope="module")
def ep_replicas(tmp_path_factory):
    """One 4-process world, ep_size 2: two replicas of every expert (dist_checks.ep_replicas)."""
    out = tmp_path_factory.mktemp("ep_replicas")
    run_world("tests.pipeline.training.dist_checks", "ep-replicas", str(out), world_size=4, timeout=900)
    return json.loads((out / "ep_replicas.json").read_text())


@pytest.mark.parametrize("case", ["ep2_zero1", "ep2_zero2", "ep2_capacity_zero1", "ep2_capacity_zero2"])
def test_replicated_experts_match_one_process(ep_replicas, case):
    """4 ranks, ep_size 2: expert gradients reduced over the expert-data-parallel groups, dense ones
    over all ranks; the weights after 2 steps are one process's, and so is the gradient norm that
    clipping used (each expert's gradient counted once, not once per replica)."""
    r = ep_replicas[case]
    assert ep_replicas["world_size"] == 4
    assert r["moved"] > 1e-3
    assert r["max_abs_diff"] < 1e-5, r
    assert_grad_norms_match(r)
    if "capacity" in case:
        assert r["dropped_fraction"] > 0.05
    else:
        assert r["dropped_fraction"] == 0.0


def test_replicated_experts_resume_bit_exact(ep_replicas):
    r = ep_replicas["resume_ep2"]
    assert r["step_restored"] == 2 and r["losses_equal"] is True and r["weights_identical"] is True


@pytest.mark.parametrize("case", ["ep2_to_ep1_zero1", "ep2_to_ep4_zero2"])
def test_replicated_experts_canonical_checkpoint_resumes_on_ep_1_and_4(ep_replicas, case):
    """Saved by 4 ranks with ep_size 2 (ZeRO-2); continued by 4 ranks with every expert on every rank
    (ep_size 1) and with one expert per rank (ep_size 4): 2 more steps equal 4 single-process steps."""
    r = ep_replicas["canonical"][case]
    assert r["world_size"] == 4 and r["step"] == 2, r
    assert r["max_abs_diff"] < 1e-5, r


def test_encoder_decoder_two_ranks_match_one_process(world2):
    """Span corruption is a function of the seed, the step and each block, so 2 ranks that split the
    global batch train the encoder-decoder exactly as one process does (in the 2-process launch)."""
    r = json.loads((world2 / "encdec" / "encdec.json").read_text())
    assert r["world_size"] == 2
    for case in ("encdec_zero1", "encdec_zero3"):
        assert r[case]["moved"] > 1e-3, r[case]
        assert r[case]["max_abs_diff"] < 1e-5, r[case]
