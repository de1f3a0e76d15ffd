"""The doors a user walks through: run, submit/status/logs/stop, promote, serve. Thin: parse, then call pipeline."""
