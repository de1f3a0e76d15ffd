"""Perplexity of a diverged model: infinite, not an OverflowError that would end the evaluate stage before the
register stage could refuse the model by its loss."""

from __future__ import annotations

import math

from pipeline.evaluation import perplexity


def test_perplexity_is_exp_of_the_loss_and_infinite_where_that_overflows():
    assert perplexity(0.0) == 1.0 and perplexity(2.5) == math.exp(2.5)
    assert perplexity(709.0) == math.exp(709.0)  # the largest losses exp() still holds
    assert perplexity(710.0) == math.inf and perplexity(1e6) == math.inf  # math.exp raises OverflowError there
    assert perplexity(math.inf) == math.inf and math.isnan(perplexity(math.nan))
