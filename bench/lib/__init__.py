"""What the benchmarks share, so that none imports another: ``setup`` (the quiet environment,
the repository root, the ``LocalCpu`` one-cluster set-up, argument checks), ``noise`` (the
``ForeignCpu`` guard against other people's work on a shared machine), ``stats`` (spread, medians,
paired ratios, verdicts against a target) and ``result`` (the one result schema and its writer)."""
