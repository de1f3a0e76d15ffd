"""What the evaluate stage measures: held-out text metrics, LAMBADA, word-order sensitivity, pictures.

Each module takes a model (``models.Transformer``) and a sentencepiece processor and returns plain
numbers or matplotlib figures; none of them talks to MLflow (the evaluate stage logs what they return).
"""

import math

# exp() of a loss above this overflows a float; such a loss (a diverged model's) has an infinite perplexity.
_MAX_EXP_ARG = math.log(1.7976931348623157e308)


def perplexity(nats: float) -> float:
    """``exp(nats)``, or infinity where that overflows a float (a diverged model's loss), so that its evaluation
    reports the loss instead of failing (the register stage then refuses the model by its loss)."""
    return math.inf if nats > _MAX_EXP_ARG else math.exp(nats)
