"""Next-item prediction on MovieLens-1M: SASRec or HSTU over a sparse-trained
table.

    python -m examples.train --config=configs/movielens_1m.py --seed=42
    python -m examples.train --config=configs/movielens_1m_hstu.py --seed=42
    python -m examples.train --config=configs/movielens_1m_hstu_large.py \
        --seeds=11,12,13

model.py (the SASRec encoder and the sampled softmax), hstu.py (the HSTU
encoder), data.py (windows and batches), evaluate.py (full ranking),
timing.py (where the wall time goes, the compilation cache), run.py
(build, train each seed, report); configs/movielens_1m.py says how the
setup compares with the HSTU repository's.
"""
