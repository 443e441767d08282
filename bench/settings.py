"""Module constants set from the command line (a benchmark's `--set`)."""

from __future__ import annotations

import ast
import importlib


def apply_settings(settings):
  """Sets each `module.NAME=value` (a Python literal) of `settings`."""
  for setting in settings:
    target, value = setting.split("=", 1)
    module, name = target.rsplit(".", 1)
    setattr(importlib.import_module(module), name, ast.literal_eval(value))
