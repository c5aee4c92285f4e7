"""The MultiWorld controller: spec, planner, and its two platforms (Kubernetes and local)."""
