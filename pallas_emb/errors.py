"""The exceptions pallas_emb raises for a user's mistake.

Every one is a `pallas_emb.Error`, itself a `ValueError`, so callers can catch
the library's errors as a family or one kind at a time. Each message is one
sentence naming what was given and what was expected, then how to fix it.
"""


class Error(ValueError):
  """Base class of every error pallas_emb raises for a user's mistake."""


class ShardingError(Error):
  """A layout that breaks the sharding contract: mesh axes,
  token shards per rank, even division of tokens or columns, placements."""


class InputError(Error):
  """An argument of the wrong kind, shape or dtype (ids, tables, gradients,
  optimizer state, backend name)."""


class HyperParameterError(Error):
  """An optimizer hyper-parameter out of its range."""


class UniqueOverflowError(Error):
  """A batch had more distinct ids than its unique-token buffer holds."""


class IdOutOfRangeError(Error):
  """Token ids outside [-vocab_rows, vocab_rows) in checking mode."""


class PipelineMisuse(Error):
  """A pipeline state consumed in a way its step does not allow."""


class CheckpointError(Error):
  """A checkpoint that is missing, incomplete, or does not fit the target."""
