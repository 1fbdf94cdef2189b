"""The driver side: the fleet facade and what it owns — membership, the ledger's I/O (watch,
probes, recovery, spares), routing, refit and weight sync, the fleet record — and the one seam to
Ray (``driver``). Ray exceptions are translated into ``nemo_gen.errors`` there. The shard actor's
own code is ``nemo_gen.shard``."""
