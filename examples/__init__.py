"""Example programs built on pallas_emb (`python -m examples.train --help`)."""
