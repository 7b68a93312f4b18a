"""Trainer-side adapters: turn a live training model into a source ModelLayout and local shards."""
