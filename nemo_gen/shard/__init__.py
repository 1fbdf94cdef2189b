"""The actor side: what runs inside a shard's Ray actor process — the actor shell, its vLLM engine
(start, generate, stream, the in-flight swap), the EngineCore start, and the direct control line's
server. Nothing here imports the driver side (``nemo_gen.fleet``)."""
