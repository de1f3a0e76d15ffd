"""Sweeps: a Ray Tune search over pipeline configs that shares every cached stage (``jobs.sweep``).

``spec`` reads a sweep file and draws its trials; ``run`` runs them with Tune (ASHA on the validation
loss), nests them in MLflow under the sweep's run and registers the best.
"""
