"""Command line of examples.train: config file and flags -> a checked config."""

from __future__ import annotations

import dataclasses

from absl import flags

from examples.config import ConfigError
from examples.config import FeaturesConfig
from examples.config import load_config
from examples.config import PROGRAM
from examples.config import TrainConfig
from examples.models import IMPLICIT_TABLES


def config_path_from_argv(argv: list[str]) -> str | None:
  """The value of --config in argv (before flags are defined), or None."""
  for i, arg in enumerate(argv[1:], start=1):
    if arg == "--":
      break
    if arg.startswith("--config="):
      return arg.split("=", 1)[1]
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1]
  return None


def define_flags(defaults: TrainConfig,
                 flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """One flag per field of `defaults`'s class, defaulting to its values."""
  flags.DEFINE_string(
      "config", None, "Config file: a python file with get_config() -> "
      "examples.config.TrainConfig, e.g. configs/tiny.py. Its values are "
      "the defaults of the flags below.", flag_values=flag_values)
  for field in dataclasses.fields(defaults):
    value = getattr(defaults, field.name)
    help_text = field.metadata.get("help", field.name)
    define = (flags.DEFINE_boolean if isinstance(value, bool) else
              flags.DEFINE_integer if isinstance(value, int) else
              flags.DEFINE_float if isinstance(value, float) else
              flags.DEFINE_string)
    define(field.name, value, help_text, flag_values=flag_values)


def config_from_flags(flag_values: flags.FlagValues = flags.FLAGS,
                      config_class: type[TrainConfig] = TrainConfig
                      ) -> TrainConfig:
  return config_class(**{f.name: flag_values[f.name].value
                         for f in dataclasses.fields(config_class)})


def parse_config(argv: list[str]) -> TrainConfig:
  """The config `python -m examples.train <argv[1:]>` would run."""
  path = config_path_from_argv(argv)
  flag_values = flags.FlagValues()
  defaults = load_config(path) if path else TrainConfig()
  define_flags(defaults, flag_values)
  rest = flag_values(argv)
  if len(rest) > 1:
    raise ConfigError(f"{PROGRAM}: unexpected arguments {rest[1:]}.")
  return config_from_flags(flag_values, type(defaults))


def check_config(config: TrainConfig) -> None:
  if config.data not in ("synthetic", "movielens"):
    raise ConfigError(f"{PROGRAM}: --data={config.data!r}; expected "
                      "'synthetic' or 'movielens'.")
  if config.table_dtype not in ("float32", "bfloat16"):
    raise ConfigError(f"{PROGRAM}: --table_dtype={config.table_dtype!r};"
                      " expected 'float32' or 'bfloat16'.")
  if config.emb_width < 2:
    raise ConfigError(f"{PROGRAM}: --emb_width={config.emb_width} must "
                      "be >= 2 (factors + the bias column).")
  for name in ("batch_size", "log_every"):
    if getattr(config, name) < 1:
      raise ConfigError(f"{PROGRAM}: --{name}="
                        f"{getattr(config, name)} must be >= 1.")
  for name in ("epochs", "num_steps", "eval_every", "num_unique"):
    if getattr(config, name) < 0:
      raise ConfigError(f"{PROGRAM}: --{name}="
                        f"{getattr(config, name)} must be >= 0.")
  if config.epochs == 0 and config.num_steps == 0:
    raise ConfigError(f"{PROGRAM}: --epochs=0 and --num_steps=0: "
                      "nothing to train.")
  if isinstance(config, FeaturesConfig):
    _check_features_config(config)


def _check_features_config(config: FeaturesConfig) -> None:
  if config.data != "movielens":
    raise ConfigError(f"{PROGRAM}: the feature model reads MovieLens side "
                      f"features; --data={config.data!r} must be 'movielens'.")
  if config.implicit_table not in IMPLICIT_TABLES:
    raise ConfigError(f"{PROGRAM}: --implicit_table={config.implicit_table!r}"
                      f"; expected one of {sorted(IMPLICIT_TABLES)}.")
  if not 0 <= config.validation_fraction < 1:
    raise ConfigError(f"{PROGRAM}: --validation_fraction="
                      f"{config.validation_fraction} must be in [0, 1).")
  for name in ("side_width", "eval_batch_size", "zip_prefix_len",
               "year_bucket", "title_buckets"):
    if getattr(config, name) < 1:
      raise ConfigError(f"{PROGRAM}: --{name}={getattr(config, name)} must "
                        "be >= 1.")
  if config.implicit_max_len < 0:
    raise ConfigError(f"{PROGRAM}: --implicit_max_len="
                      f"{config.implicit_max_len} must be >= 0.")
