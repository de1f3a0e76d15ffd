"""Conduit's tokenizer: a sentencepiece model with fixed special ids, and its Hugging Face form.

- ``spm``: training and loading the sentencepiece model; the special ids (PAD, UNK, BOS, EOS).
- ``hf_fast``: the same model as a Hugging Face fast tokenizer (``tokenizer.json``), id for id.
"""
