"""Next-item prediction on MovieLens-1M: SASRec or HSTU over a sparse-trained
table.

    python -m examples.train --config=configs/movielens_1m.py --seed=42
    python -m examples.train --config=configs/movielens_1m_hstu.py --seed=42

model.py (the SASRec encoder and the sampled softmax), hstu.py (the HSTU
encoder), data.py (windows and batches), evaluate.py (full ranking),
run.py (build, train, report); configs/movielens_1m.py says how the setup
compares with the HSTU repository's.
"""
