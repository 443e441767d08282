"""Next-item prediction on MovieLens-1M: SASRec over a sparse-trained table.

    python -m examples.train --config=configs/movielens_1m.py --seed=42

model.py (the Flax encoder and the sampled softmax), data.py (windows and
batches), evaluate.py (full ranking), run.py (build, train, report);
configs/movielens_1m.py says how the setup compares with the HSTU
repository's.
"""
