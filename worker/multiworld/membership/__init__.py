"""Which worlds this process holds, joins and waits for: `Holdings` (the shared state and its
transitions), the joins, the live table, the waits, the status it reports, and start-up from the
environment. `multiworld.manager.WorldManager` is made of these parts.
"""
