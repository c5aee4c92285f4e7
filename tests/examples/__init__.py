"""The example programs run as real processes."""
