"""What a step shows: the status subresource (`status_writer`), Events (`events`), the status of
a refused spec or a failed step (`refusal`) and how a step's failure reads (`errors`).
"""
