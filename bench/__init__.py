"""Benchmark scripts, results and topologies. The harness behind ``refit bench`` ships in the package
(``refit.tools.bench``); the scripts here import it."""
