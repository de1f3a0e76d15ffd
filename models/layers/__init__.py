"""The parts every family shares: attention and its KV cache (`attention`), multi-head latent attention
(`mla`), mixture of experts (`moe`, `grouped_experts`), the feed-forward (`ffn`), norms (`norms`),
positions and RoPE scaling (`positions`), the output head and its chunked loss (`head`, `loss`), the
Transformer block (`block`), a forward's output record and the first step of weight init (`base`), and
next-token sampling (`sampling`). The table of attention kinds (`kinds`) sits beside them.

A layer takes what it needs (a config, sizes, or a module its caller built) and imports nothing above
this floor: never the family table, a family, or the attention-kind table. This ``__init__`` imports
nothing, so importing one layer does not import the others.
"""
