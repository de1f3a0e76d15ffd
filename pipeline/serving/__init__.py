"""Serving and deployment: a registered model version answering requests, and the gates before it.

Its modules (imported by name; this package imports nothing on its own, so a Serve replica or an
MLflow scoring server loads only what it uses):

- ``pyfunc``: ``ConduitLM``, the MLflow pyfunc model a registered version is; ``model_code``: the file
  MLflow's "models from code" runs to load it.
- ``app``: the Ray Serve replica: one version behind the OpenAI completions API, requests continuously
  batched and streamed as they are generated; ``streaming``: a choice's text as its tokens arrive.
- ``openai_api``: request checking and the response and error bodies of that API;
  ``request_limits``: what a request may ask for, checked before any work (both servers use it).
- ``deploy``: deploy a version on Ray Serve, follow its alias on promotion, take it down.
- ``promotion``: may a version take the ``champion`` alias from the current one?
- ``listen``: where Conduit's servers listen (this machine only unless a setting says otherwise).
"""
