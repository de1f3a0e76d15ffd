"""The planner against figures published for real runs (benchmarks/plan_validation.py compares their GPU-hours,
with no target, since neither run published its MFU for the layout Conduit plans).

- The shapes: the parameter counts of the configs the benchmark plans are the published models'.
- The compute: Llama 3 405B's published pre-training budget, 3.8e25 FLOPs for 15.6T tokens, against the
  planner's FLOPs per token for its published shape. Meta's figure is 6 N D (6 x 405.85e9 x 15.6e12 =
  3.80e25; with the attention of its 8K context it would read 4.1e25), so the planner's FLOPs are taken at a
  1-token context, where the attention term (12 L H K per token, 1e-5 of the rest) vanishes; the attention
  term and the forward's share are checked against counted matmuls in test_measured_step.py.
"""

from __future__ import annotations

import pytest

from models.accounting import flops_per_token, param_counts
from models.config import ModelConfig
from pipeline.plan.validation import DEEPSEEK_V3, LLAMA3_8B

# Llama 3 405B, "The Llama 3 Herd of Models" (Llama Team, AI @ Meta, 2024), Table 3: 126 layers, model
# dimension 16,384, FFN dimension 53,248, 128 attention heads, 8 key/value heads; vocabulary 128,256 (its
# tokenizer, as the 8B's); RoPE base 500,000; untied output head.
LLAMA3_405B = ModelConfig(vocab_size=128256, d_model=16384, n_layers=126, n_heads=128, num_kv_heads=8, d_ff=53248,
                          max_seq_len=8192, rope_base=500000.0)
# The same report, section 1 ("Scale"): "our flagship language model was pre-trained using 3.8 x 10^25
# FLOPs ... a flagship model with 405B trainable parameters on 15.6T text tokens".
LLAMA3_405B_FLOPS, LLAMA3_405B_TOKENS = 3.8e25, 15.6e12


def test_the_shapes_are_the_published_models():
    llama, v3, big = param_counts(LLAMA3_8B), param_counts(DEEPSEEK_V3), param_counts(LLAMA3_405B)
    assert llama["total"] == 8_030_261_248  # Llama 3 8B's parameter count (its safetensors hold 8.03B)
    assert v3["total"] == pytest.approx(671e9, rel=0.001)  # "671B total parameters"
    assert v3["active"] == pytest.approx(37e9, rel=0.02)  # "37B activated for each token"
    assert big["total"] == pytest.approx(405e9, rel=0.005)  # "405B" (the name; 405.85B, 406B on its model page)


def test_llama3_405b_training_flops_are_its_published_budget():
    """The planned FLOPs of Llama 3 405B's 15.6T tokens within the rounding of the published 3.8e25.

    Tolerance: the published figures have two (3.8e25) and three (15.6T) significant digits, so the true
    budget lies in [3.75e25, 3.85e25) and the true tokens in [15.55T, 15.65T): the planned FLOPs of 15.6T
    tokens must lie in that budget widened by the tokens' rounding (about +-1.6% in all). Counting 8N, or
    leaving out one of the three feed-forward matrices (27% of N), fails by far; the output head (0.5%)
    alone would not.
    """
    per_token = flops_per_token(LLAMA3_405B, 1)["total"]  # at T = 1 the attention term is 1e-5 of this
    planned = per_token * LLAMA3_405B_TOKENS
    low = 3.75e25 * LLAMA3_405B_TOKENS / 15.65e12
    high = 3.85e25 * LLAMA3_405B_TOKENS / 15.55e12
    assert low <= planned < high, f"{planned:.3e} FLOPs planned; published {LLAMA3_405B_FLOPS:.2e}"
