"""nemo_gen's benchmarks as one tool: ``python -m bench NAME [flags]`` runs one (``python -m bench``
lists them with their targets; bench/README.md has the same table). Each benchmark is a module
here with a ``main(argv)``; what they share (set-up, noise guard, statistics, the result schema)
is in ``bench.lib``; the list is ``bench.registry``."""
