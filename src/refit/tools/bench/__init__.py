"""``refit bench``: scenarios, methods (refit and what users run today) and the timing harness."""
