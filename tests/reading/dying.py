"""A stand-in loader worker that dies without a word, holding its pipe's writer end.

Its own module so that a spawned child imports nothing heavy (no lancedb).
"""

import os
from multiprocessing.connection import Connection


def exit_holding(conn: Connection, code: int) -> None:
    os._exit(code)
