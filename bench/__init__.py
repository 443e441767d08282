"""The benchmark programs: `python -m bench.bench --help` (run from the repo root)."""
