"""Tiny synthetic run for CI: a few seconds on one CPU (8 simulated devices)."""

from examples.config import TrainConfig


def get_config() -> TrainConfig:
  return TrainConfig(
      data="synthetic",
      num_examples=16_384,
      num_users=500,
      num_items=300,
      signal_rank=4,
      noise_std=0.1,
      emb_width=16,
      init_scale=0.1,
      l2=0.05,
      batch_size=256,
      epochs=4,
      emb_lr=0.2,
      dense_lr=1e-2,
      log_every=20,
      eval_every=0,
  )
