"""The Triton backend: Pallas kernels for GPUs (`backend="triton"`, or
"pallas" on a GPU; "interpret" runs them through Pallas' interpreter)."""
