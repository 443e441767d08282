"""Large synthetic workload for benchmarks / GPU hosts: ~40M table rows.

Do not run it as is on a laptop; a smoke test overrides the sizes:

    python -m examples.train --config=configs/large.py \
        --num_examples=65536 --num_users=100000 --num_items=100000 \
        --num_steps=4 --batch_size=8192
"""

from examples.config import TrainConfig


def get_config() -> TrainConfig:
  return TrainConfig(
      data="synthetic",
      num_examples=50_000_000,
      num_users=30_000_000,
      num_items=10_000_000,
      signal_rank=16,
      zipf_exponent=1.05,
      noise_std=0.1,
      emb_width=128,
      table_dtype="bfloat16",
      init_scale=0.05,
      batch_size=65_536,
      epochs=1,
      emb_lr=0.05,
      dense_lr=1e-3,
      log_every=100,
      eval_every=0,
  )
