"""FBGEMM's large CPU case: 10M rows x 64, 64k Zipf(1.05) ids (37 ms).

    python -m bench.bench --config=configs/bench_10m.py --what=step

The dense baseline is off (a dense 10M-row step needs ~10 GiB and seconds).
Plain python, returns a dict of `bench.bench` flags.
"""


def get_config() -> dict:
  return dict(vocab_rows=10_000_000, emb_width=64, tokens_per_batch=65_536,
              zipf=1.05, dtype=["float32"], backends=["xla"],
              baselines=["xla"], repeats=10, burst=5)
