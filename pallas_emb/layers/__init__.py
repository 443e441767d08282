"""Framework layers: `pallas_emb.flax` (linen) and `pallas_emb.haiku`."""
