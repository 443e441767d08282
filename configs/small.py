"""Small synthetic run: ~1M examples, 100k-row tables; a minute or two on CPU."""

from examples.config import TrainConfig


def get_config() -> TrainConfig:
  return TrainConfig(
      data="synthetic",
      num_examples=1_000_000,
      num_users=100_000,
      num_items=50_000,
      signal_rank=8,
      noise_std=0.1,
      emb_width=32,
      init_scale=0.05,
      batch_size=4096,
      epochs=1,
      emb_lr=0.05,
      dense_lr=1e-2,
      log_every=50,
  )
