"""The operator on a real API server, and the user journeys on the real node."""
