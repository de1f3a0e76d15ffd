"""The models and steps the planner is checked on, shared by the tests (tests/pipeline/plan/) and the
benchmark (benchmarks/plan_validation.py), so that both check the same cases.

- ``ACTIVATION_CASES``: dense, MoE (the single-process step of an expert-parallel layer: with ep_size
  ranks each rank's experts see the k routed copies of every token, as here), MLA, Mamba, Mamba-2, hybrid
  and the encoder-decoder (its source as long as its target), each at two sizes; measured in fp32 and in bf16,
  with and without activation checkpointing (`pipeline.plan.measure`).
- ``COMM_DENSE``, ``COMM_MOE``: the 2-rank gloo step whose collectives are counted
  (`pipeline.plan.comm_probe`).
"""

from __future__ import annotations

from models.config import ModelConfig

_SMALL = ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, max_seq_len=256)
_LARGER = ModelConfig(vocab_size=1024, d_model=128, n_layers=4, n_heads=8, max_seq_len=256)


def _family_cases(base: ModelConfig, tag: str) -> dict[str, ModelConfig]:
    L = base.n_layers
    return {
        f"dense {tag}": base,
        f"moe {tag}": base.replace(num_experts=4, moe_top_k=2),
        f"mla {tag}": base.replace(attention="mla"),
        f"mamba {tag}": base.replace(arch="mamba", pos_encoding="none", n_heads=1),
        f"mamba2 {tag}": base.replace(arch="mamba2", pos_encoding="none", n_heads=1, ssm_chunk_size=32),
        f"hybrid {tag}": base.replace(arch="hybrid", hybrid_layers="MA" * (L // 2), ssm_chunk_size=32),
        f"encdec {tag}": base.replace(arch="encoder_decoder"),
    }


ACTIVATION_CASES: dict[str, ModelConfig] = {**_family_cases(_SMALL, "d64 L2"), **_family_cases(_LARGER, "d128 L4")}
ACTIVATION_BATCH, ACTIVATION_SEQ, ACTIVATION_CHUNK = 4, 128, 128

COMM_DENSE = ModelConfig(vocab_size=4096, d_model=32, n_layers=2, n_heads=4, num_kv_heads=2, max_seq_len=16)
COMM_MOE = COMM_DENSE.replace(num_experts=4, moe_top_k=2, moe_first_dense_layers=1)

# The torch.distributed function each planned kind of collective is made with (DeepSpeed 0.19 on gloo).
COLLECTIVE_FUNCTION = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor",
                       "reduce_scatter": "reduce_scatter_tensor", "all_to_all": "all_to_all_single"}
COMM_CASES = {"zero1": (1, 1), "zero2": (2, 1), "zero3": (3, 1), "ep2_zero1": (1, 2)}
COMM_SEQ, COMM_GLOBAL, COMM_MICRO = 8, 8, 2


def comm_setup(case: str, world: int = 2):
    """The planner's Setup of one probed case (`pipeline.plan.comm_probe` runs the same step)."""
    from pipeline.plan.memory import Setup

    stage, ep = COMM_CASES[case]
    return Setup(model=COMM_MOE if ep > 1 else COMM_DENSE, seq_len=COMM_SEQ, micro_batch=COMM_MICRO,
                 global_batch=COMM_GLOBAL, world=world, ep_size=ep, zero_stage=stage, precision="fp32",
                 offload_optimizer=False, offload_params=False, checkpointing=False, chunk_tokens=0,
                 zero={"stage": stage})


def planned_payloads(case: str, world: int = 2) -> dict[str, int]:
    """Payload bytes per rank and step by torch.distributed function, as planned."""
    from pipeline.plan.memory import model_shape
    from pipeline.plan.step import collectives

    setup = comm_setup(case, world)
    out: dict[str, int] = {}
    for c in collectives(setup, model_shape(setup.model, setup.ep_size)):
        name = COLLECTIVE_FUNCTION[c.kind]
        out[name] = out.get(name, 0) + c.payload
    return out


def measured_payloads(probe: dict, case: str) -> dict[str, float]:
    """Payload bytes per rank and step by function, the mean over the probe's ranks."""
    ranks = [r[case]["bytes"] for r in probe["ranks"]]
    names = {n for r in ranks for n in r}
    return {n: sum(r.get(n, 0) for r in ranks) / len(ranks) for n in names}

# The published runs compared in benchmarks/plan_validation.py: Llama 3 8B (Llama 3 report and model
# card: d 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336, vocabulary 128256) and DeepSeek-V3 (its
# report: d 7168, 61 layers, MLA with 128 heads, kv rank 512, q rank 1536, 128 + 64 query/key and 128
# value features per head; 3 dense layers of FFN 18432, then 1 shared + 256 routed experts of 2048,
# top 8 in 4 of 8 groups by a sigmoid router).
LLAMA3_8B = ModelConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, num_kv_heads=8, d_ff=14336,
                        max_seq_len=8192, rope_base=500000.0)
DEEPSEEK_V3 = ModelConfig(vocab_size=129280, d_model=7168, n_layers=61, n_heads=128, attention="mla",
                          kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
                          v_head_dim=128, d_ff=18432, num_experts=256, moe_top_k=8, moe_d_ff=2048,
                          moe_shared_experts=1, moe_first_dense_layers=3, moe_router="sigmoid", moe_n_group=8,
                          moe_topk_group=4, max_seq_len=4096)
