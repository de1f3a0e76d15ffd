"""The registered model's code: MLflow "models from code" runs this file when it loads a version.

The register stage logs this file, not a pickled object, as the pyfunc model (``python_model=`` its
path). Loading a version (``mlflow.pyfunc.load_model``, ``mlflow models serve``) puts the model's own
copy of ``models/`` and ``pipeline/`` (its ``code_paths``) on ``sys.path`` and runs this file, which
imports Conduit's serving module by name and hands MLflow a fresh ``ConduitLM``; ``load_context`` then
reads the weights and tokenizer. Nothing is unpickled, so a version loads with any Python and
cloudpickle, and reading it never runs code other than Conduit's own.
"""

from pipeline.serving import pyfunc

pyfunc.set_served_model()
