"""Example programs built on pallas_emb: `python -m examples.train --config=configs/tiny.py`."""
