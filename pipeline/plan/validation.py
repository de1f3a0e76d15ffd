"""The models and steps the planner is checked on, shared by the tests (tests/pipeline/plan/) and the
benchmark (benchmarks/plan_validation.py), so that both check the same cases.

- ``ACTIVATION_CASES``: dense, MoE (the single-process step of an expert-parallel layer: with ep_size
  ranks each rank's experts see the k routed copies of every token, as here), MLA, Mamba-2 and hybrid,
  each at two sizes; measured with and without activation checkpointing (`pipeline.plan.measure`).
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
        f"mamba2 {tag}": base.replace(arch="mamba2", pos_encoding="none", n_heads=1, ssm_chunk_size=32),
        f"hybrid {tag}": base.replace(arch="hybrid", hybrid_layers="MA" * (L // 2), ssm_chunk_size=32),
    }


ACTIVATION_CASES: dict[str, ModelConfig] = {**_family_cases(_SMALL, "d64 L2"), **_family_cases(_LARGER, "d128 L4")}
ACTIVATION_BATCH, ACTIVATION_SEQ, ACTIVATION_CHUNK = 4, 128, 128

COMM_DENSE = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, num_kv_heads=2, max_seq_len=16)
COMM_MOE = COMM_DENSE.replace(num_experts=4, moe_top_k=2, moe_first_dense_layers=1)
