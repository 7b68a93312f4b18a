"""refit's benchmarks (run through ``refit bench``)."""
