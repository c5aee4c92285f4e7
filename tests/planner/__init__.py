"""The pure planner."""
