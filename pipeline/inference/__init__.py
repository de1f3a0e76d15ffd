"""Text in, text out with a trained model: what evaluate and both servers generate with.

- ``generator``: ``TextGenerator``, a model and its tokenizer: prompts checked, tokens sampled, text out.
- ``requests``: ``GenRequest``, one row, and what every batching path does with one (fit, pad).
- ``batched``: many requests at once, one left-padded batch through the KV-cached model.
- ``engine``: continuous batching: requests join a running batch at its next step and leave it when
  they end, each token handed over as it is made.
"""
