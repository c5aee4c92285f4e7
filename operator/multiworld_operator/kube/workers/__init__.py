"""The operator's side of its workers: where the channel listens (`channel_settings`), which pod a
connection speaks for (`worker_identity`), what they said (`worker_inbox`), hosts lost with
their nodes (`lost_hosts`) and the key of every world's secret (`world_key`).
"""
