"""Everything that calls Ray: the cluster, placement, the shard actors and the fleet that routes
requests across them. Ray and vLLM exceptions are translated into ``nemo_gen.errors`` here."""
