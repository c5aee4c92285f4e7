"""`multiworld run`: the local runner and its parts."""
