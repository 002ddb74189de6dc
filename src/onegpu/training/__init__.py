"""Training backends, the exact loss, and the per-step measurement callback."""
