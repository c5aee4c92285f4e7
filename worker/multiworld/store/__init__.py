"""The stores this library serves (a world's rank 0, a failure detector's beat store): torch's
TCPStore protocol (`protocol`), one store's keys and waits (`key_values`), the writes each kind of
store takes (`rules`), and the server on its own thread (`server`). No torch at import.
"""
