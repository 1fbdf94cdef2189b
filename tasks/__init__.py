"""Prefect tasks: one thin wrapper per pipeline step, each named after the library call it makes.

Side-effecting tasks use ``cache_policy=NO_CACHE``: a cached refit or launch would silently
skip the actor call. Blocking Ray calls carry their own timeouts (Prefect's ``timeout_seconds``
cannot interrupt ``ray.get``).
"""
