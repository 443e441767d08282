"""The CPU target workload of the benchmark (xla backend, f32 table).

    python -m bench.bench --config=configs/bench_targets.py --what=step \
        --num_devices=8

1M rows x 64 columns, 16k ids per batch drawn from a Zipf(1.05) truncated to
the table (FBGEMM's CPU TBE with exact row-wise Adagrad: 6.5 ms per step on
this workload). Plain python, returns a dict of `bench.bench` flags.
"""


def get_config() -> dict:
  return dict(vocab_rows=1_000_000, emb_width=64, tokens_per_batch=16_384,
              zipf=1.05, dtype=["float32"], backends=["xla"],
              baselines=["dense", "xla"], repeats=10, burst=5)
