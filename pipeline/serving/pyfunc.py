"""The served model: what a registered Conduit version is once MLflow (or a server) loads it.

``ConduitLM`` is the MLflow pyfunc model: prompts in, generated text out. The register stage logs it
through ``pipeline.tracking`` (which owns every call to the tracking server and the registry) as code,
not as a pickled instance: MLflow "models from code" with ``MODEL_CODE`` (``pipeline/serving/model_code.py``)
as the model, plus this module's signature, input example and pinned requirements. The model's
``code_paths`` ship ``models/`` and ``pipeline/``, so MLflow imports this class by name from the
model's own copy of the code when it loads a version. This module and ``pipeline.tracking`` are the
only ones that import mlflow.
"""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd  # predict's type hint: MLflow reads it when the class is defined
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

MODEL_CODE = Path(__file__).with_name("model_code.py")  # what MLflow runs to load a version

# Generation parameters a request may set, and their defaults (the signature advertises the same).
DEFAULT_PARAMS: dict[str, Any] = {"max_new_tokens": 64, "temperature": 0.8, "top_p": 1.0}
PINNED_PACKAGES = ("torch", "sentencepiece", "safetensors", "numpy", "pandas")


class ConduitLM(mlflow.pyfunc.PythonModel):
    """The pyfunc wrapper that MLflow loads and serves: prompts in, generated text out.

    The work is done by ``pipeline.inference.generator.TextGenerator`` (torch + sentencepiece); this class
    only adapts MLflow's calling convention. A ``PromptError`` (the client's fault) becomes an
    ``MlflowException`` with INVALID_PARAMETER_VALUE, which the scoring server answers with a 400 that
    carries our message; any other exception is a server-side bug and propagates as is.
    """

    def load_context(self, context):  # noqa: D102  (MLflow's hook)
        from pipeline.inference.generator import TextGenerator

        self._generator = TextGenerator.from_files(
            context.artifacts["weights"], context.artifacts["tokenizer"]
        )

    # The DataFrame hint tells MLflow the input is the signature's table (its type hints then add no
    # validation of their own); without a hint MLflow warns in every process that imports this class.
    def predict(self, context, model_input: pd.DataFrame, params=None):  # noqa: D102  (MLflow's hook)
        from pipeline.inference.generator import PromptError, prompts_from_input

        p = {**DEFAULT_PARAMS, **(params or {})}
        try:
            prompts = prompts_from_input(model_input)
            texts = self._generator.generate(  # values as sent: 2.5 tokens or a NaN are PromptErrors
                prompts, max_new_tokens=p["max_new_tokens"], temperature=p["temperature"], top_p=p["top_p"],
            )
        except PromptError as e:
            raise MlflowException(str(e), error_code=INVALID_PARAMETER_VALUE) from e
        return pd.DataFrame({"text": texts})


def set_served_model() -> None:
    """Hand MLflow the model of the version being loaded (called by ``MODEL_CODE``)."""
    from mlflow.models import set_model

    set_model(ConduitLM())


def signature():
    """The model signature: a ``prompt`` column in, a ``text`` column out, the generation parameters."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

    return ModelSignature(
        inputs=Schema([ColSpec("string", "prompt")]),
        outputs=Schema([ColSpec("string", "text")]),
        params=ParamSchema([
            ParamSpec("max_new_tokens", "long", DEFAULT_PARAMS["max_new_tokens"]),
            ParamSpec("temperature", "double", DEFAULT_PARAMS["temperature"]),
            ParamSpec("top_p", "double", DEFAULT_PARAMS["top_p"]),
        ]),
    )


def input_example():
    """The request logged beside the model: one prompt and a short generation."""
    import pandas as pd

    return pd.DataFrame({"prompt": ["Once upon a time"]}), {"max_new_tokens": 16}


def pinned_requirements() -> list[str]:
    """``package==version`` of what serving imports, as installed here."""
    return [f"{p}=={version(p)}" for p in PINNED_PACKAGES]


def generator_from_model_dir(model_dir: str | Path):
    """The ``TextGenerator`` of a registered model downloaded to ``model_dir`` (its ``MLmodel`` names
    the weights and tokenizer files), without importing the model's own copy of the code: what a Ray
    Serve replica loads (``pipeline.serving.app``).

    Raises:
        FileNotFoundError: ``model_dir`` holds no ``MLmodel``.
        KeyError: the model is not a Conduit pyfunc (no ``weights`` or ``tokenizer`` artifact).
    """
    from mlflow.models import Model

    from pipeline.inference.generator import TextGenerator

    model_dir = Path(model_dir)
    if not (model_dir / "MLmodel").is_file():
        raise FileNotFoundError(f"{model_dir} holds no MLmodel file: not a downloaded MLflow model")
    artifacts = Model.load(str(model_dir)).flavors["python_function"].get("artifacts", {})
    missing = [k for k in ("weights", "tokenizer") if k not in artifacts]
    if missing:
        raise KeyError(f"the model in {model_dir} has no {missing} artifact(s); is it a Conduit model?")
    return TextGenerator.from_files(model_dir / artifacts["weights"]["path"],
                                    model_dir / artifacts["tokenizer"]["path"])
