"""pallas_emb: sharded embedding tables for JAX recommenders."""

# First: glibc settings that only take effect before XLA:CPU starts threads.
from pallas_emb import cpu_malloc
cpu_malloc.at_import()


from pallas_emb.collection import EmbeddingCollection
from pallas_emb.dedup import FILL_VALUE
from pallas_emb.errors import CheckpointError
from pallas_emb.errors import Error
from pallas_emb.errors import HyperParameterError
from pallas_emb.errors import IdOutOfRangeError
from pallas_emb.errors import InputError
from pallas_emb.errors import PipelineMisuse
from pallas_emb.errors import ShardingError
from pallas_emb.errors import UniqueOverflowError
from pallas_emb.exchange import replicated_sharding
from pallas_emb.exchange import table_sharding
from pallas_emb.exchange import token_sharding
from pallas_emb.kernels import KernelConfig
from pallas_emb.stacking import CollectionPlan
from pallas_emb.planner import batch_stats
from pallas_emb.planner import FeatureStats
from pallas_emb.planner import plan
from pallas_emb.planner import plan_cost
from pallas_emb.planner import PlanCost
from pallas_emb.planner import PlanInfeasibleError
from pallas_emb.planner import PlanReport
from pallas_emb.planner import TablePlan
from pallas_emb.stacking import stack_tables
from pallas_emb.stacking import StackPlan
from pallas_emb.optimizers import Adagrad
from pallas_emb.optimizers import AdagradState
from pallas_emb.optimizers import Adam
from pallas_emb.optimizers import AdamState
from pallas_emb.optimizers import Ftrl
from pallas_emb.optimizers import FtrlState
from pallas_emb.optimizers import PartialRowwiseAdam
from pallas_emb.optimizers import PartialRowwiseAdamState
from pallas_emb.optimizers import RowwiseAdagrad
from pallas_emb.optimizers import RowwiseAdagradState
from pallas_emb.optimizers import Sgd
from pallas_emb.optimizers import SgdState
from pallas_emb.optimizers import SparseOptimizer
from pallas_emb.hashing import hash_ids
from pallas_emb.pipeline import PipelineState
from pallas_emb.pipeline import StepMetrics
from pallas_emb.pipeline import Trainer
from pallas_emb.ragged import pad_ragged
from pallas_emb.single_table import apply_gradients
from pallas_emb.single_table import count_out_of_range
from pallas_emb.single_table import dedup
from pallas_emb.single_table import DedupResult
from pallas_emb.single_table import default_num_unique
from pallas_emb.single_table import lookup
from pallas_emb.single_table import lookup_and_dedup
from pallas_emb.single_table import raise_if_out_of_range
from pallas_emb.single_table import raise_if_overflow
from pallas_emb.specs import Bag
from pallas_emb.specs import FeatureSpec
from pallas_emb.specs import PLACEMENTS
from pallas_emb.specs import TableSpec
from pallas_emb.row import RowRouting
from pallas_emb.stack import StackRouting
from pallas_emb.state import CollectionState
from pallas_emb.state import Routing
from pallas_emb.state import ServingState
from pallas_emb.state import StackState
from pallas_emb.update import UpdateStats
from pallas_emb.validation import BACKENDS
from pallas_emb.validation import check_single_shard_per_rank
from pallas_emb.validation import EmbeddingContext
from pallas_emb.validation import make_context
from pallas_emb.validation import single_shard_per_rank

__version__ = "0.1.0"

__all__ = [
    "Adagrad",
    "AdagradState",
    "Adam",
    "AdamState",
    "BACKENDS",
    "Bag",
    "CheckpointError",
    "CollectionPlan",
    "CollectionState",
    "DedupResult",
    "EmbeddingCollection",
    "EmbeddingContext",
    "Error",
    "FILL_VALUE",
    "FeatureSpec",
    "FeatureStats",
    "Ftrl",
    "FtrlState",
    "HyperParameterError",
    "IdOutOfRangeError",
    "InputError",
    "KernelConfig",
    "PLACEMENTS",
    "PartialRowwiseAdam",
    "PartialRowwiseAdamState",
    "PipelineMisuse",
    "PipelineState",
    "PlanCost",
    "PlanInfeasibleError",
    "PlanReport",
    "Routing",
    "ServingState",
    "RowRouting",
    "RowwiseAdagrad",
    "RowwiseAdagradState",
    "Sgd",
    "SgdState",
    "ShardingError",
    "SparseOptimizer",
    "StackPlan",
    "StackRouting",
    "StackState",
    "StepMetrics",
    "TablePlan",
    "TableSpec",
    "Trainer",
    "UniqueOverflowError",
    "UpdateStats",
    "apply_gradients",
    "batch_stats",
    "check_single_shard_per_rank",
    "count_out_of_range",
    "dedup",
    "default_num_unique",
    "hash_ids",
    "lookup",
    "lookup_and_dedup",
    "make_context",
    "pad_ragged",
    "plan",
    "plan_cost",
    "raise_if_out_of_range",
    "raise_if_overflow",
    "replicated_sharding",
    "single_shard_per_rank",
    "stack_tables",
    "table_sharding",
    "token_sharding",
]
