"""Engine-side adapters: the destination layout and the live tensors refit writes into."""
