"""A shared KV store per region (LMCache server / Mooncake Store-like), reached over the KV transport.

- ``store.BlockStore``: the blocks themselves (capacity, eviction by policy, checksums, a change log);
- ``server.StoreServer``: a transport endpoint around a ``BlockStore`` (engines push blocks to put them,
  pull them to get them), with optional replication to a second store;
- ``client.StoreTier``: the engine's side, a ``KVTier`` (``actors.engine.tiers.base``) at the bottom of the
  engine's chain GPU -> CPU -> disk -> store;
- ``actor.KVStoreActor``: the Ray actor that hosts one ``StoreServer`` (one per region).
"""
