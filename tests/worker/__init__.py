"""The worker library with real member processes."""
