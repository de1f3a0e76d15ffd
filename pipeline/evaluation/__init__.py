"""What the evaluate stage measures: held-out text metrics, LAMBADA, word-order sensitivity, pictures.

Each module takes a model (``models.Transformer``) and a sentencepiece processor and returns plain
numbers or matplotlib figures; none of them talks to MLflow (the evaluate stage logs what they return).
"""
