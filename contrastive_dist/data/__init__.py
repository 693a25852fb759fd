"""Drop-last-free data: a sampler for map-style datasets, shards and streams, and an empty-safe collate."""
