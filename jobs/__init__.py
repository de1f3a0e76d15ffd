"""The doors a user walks through: run, (later) submit, promote, serve. Thin: parse, then call pipeline."""
