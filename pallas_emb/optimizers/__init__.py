"""The fused sparse optimizers, one module each.

Write your own: subclass `base.SparseOptimizer` in one small file (its
hyper-parameters, its state NamedTuple and `slots()`, and the per-row math
`row_update` / `column_update`); see BUILD.md, "Writing your own sparse
optimizer", and `sgd.py` for the smallest example.
"""

from pallas_emb.optimizers.adagrad import Adagrad
from pallas_emb.optimizers.adagrad import AdagradState
from pallas_emb.optimizers.adam import Adam
from pallas_emb.optimizers.adam import AdamState
from pallas_emb.optimizers.base import ELEMENT
from pallas_emb.optimizers.base import ROW
from pallas_emb.optimizers.base import Slot
from pallas_emb.optimizers.base import SparseOptimizer
from pallas_emb.optimizers.ftrl import Ftrl
from pallas_emb.optimizers.ftrl import FtrlState
from pallas_emb.optimizers.partial_rowwise_adam import PartialRowwiseAdam
from pallas_emb.optimizers.partial_rowwise_adam import PartialRowwiseAdamState
from pallas_emb.optimizers.rowwise_adagrad import RowwiseAdagrad
from pallas_emb.optimizers.rowwise_adagrad import RowwiseAdagradState
from pallas_emb.optimizers.sgd import Sgd
from pallas_emb.optimizers.sgd import SgdState

__all__ = [
    "Adagrad",
    "AdagradState",
    "Adam",
    "AdamState",
    "ELEMENT",
    "Ftrl",
    "FtrlState",
    "PartialRowwiseAdam",
    "PartialRowwiseAdamState",
    "ROW",
    "RowwiseAdagrad",
    "RowwiseAdagradState",
    "Sgd",
    "SgdState",
    "Slot",
    "SparseOptimizer",
]
