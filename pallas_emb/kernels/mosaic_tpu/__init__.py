"""The Mosaic TPU backend: Pallas kernels for TPUs (`backend="mosaic_tpu"`,
or "pallas" on a TPU; "mosaic_tpu_interpret" runs them through Pallas' TPU
interpreter on any platform).

Every kernel moves table rows by DMA: the ids of a block of rows are read
from SMEM, each row is one async copy between the table in HBM (left there,
`memory_space=pl.ANY`) and a VMEM tile, so a step's traffic is the rows a
batch uses and never a copy of the table. The arithmetic runs on whole
`[rows, width]` tiles.
"""
