"""The YAML dialect of Conduit's configs: PyYAML's safe loader with two fixes.

- Numbers: PyYAML follows YAML 1.1, where a float needs a dot, so ``3e-4`` and ``1e4`` are strings.
  YAML 1.2 (and every person writing a learning rate) reads them as numbers; so does this loader.
- Duplicate keys: PyYAML keeps the last of two equal keys in one mapping (two ``train:`` blocks), so
  half a config vanishes without a word. This loader refuses them, naming both lines.

Kept free of ``pipeline.config`` (it raises YAML errors; the config loader names the file).
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from typing import Any

import yaml

# YAML 1.2's core-schema float, plus YAML 1.1's forms PyYAML already reads (``1_000.5``, ``.inf``).
_FLOAT_1_2 = re.compile(r"""^(?:
     [-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
    |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)


class DuplicateKeyError(yaml.YAMLError):
    """One mapping names the same key twice; the message names the key and both lines."""


class ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that reads ``3e-4`` as a float and refuses duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # ``<<: *base`` may be overridden by design
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                continue  # PyYAML's own construct_mapping refuses it, naming the place
            line = key_node.start_mark.line + 1
            if key in first_line:
                raise DuplicateKeyError(
                    f"key {key!r} is given twice in one mapping (lines {first_line[key]} and {line}); "
                    "YAML would keep only the last, so merge them into one"
                )
            first_line[key] = line
        return super().construct_mapping(node, deep=deep)


ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_1_2, list("-+0123456789."))


def load_yaml(text: str) -> Any:
    """Parse one YAML document in Conduit's dialect (see the module docstring).

    Args:
        text: the YAML text (a config file, or the value of an ``a.b=c`` override).

    Returns:
        The parsed value (None for an empty document).

    Raises:
        DuplicateKeyError: a mapping names a key twice.
        yaml.YAMLError: the text is not valid YAML.
    """
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 - ConfigLoader is a SafeLoader
