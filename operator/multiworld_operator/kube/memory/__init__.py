"""The planner's memory across operator restarts: its encoding (`planner_memory`), read once and
stored when changed (`memory_store`), in a ConfigMap written at the resourceVersion last seen
(`configmap_writer`).
"""
