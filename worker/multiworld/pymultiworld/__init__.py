"""pymultiworld's API on this library: its `WorldManager` face (`compat`) and its world names
as DNS labels (`world_labels`). Its public module paths stay where pymultiworld has them:
`multiworld.manager` and `multiworld.communicator`.
"""
