"""Conduit's orchestration and stages: raw text -> tokenizer -> tokens -> model -> metrics -> registry."""
