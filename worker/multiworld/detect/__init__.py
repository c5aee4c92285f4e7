"""Failure detection: the settings (`config`), the heartbeats and stall watch (`detector`), how
silence is measured (`silence`) and the verdict a judge writes (`verdicts`).
"""
