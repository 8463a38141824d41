"""The benchmark cases; each entry script in ``benchmarks/`` lists its own."""
