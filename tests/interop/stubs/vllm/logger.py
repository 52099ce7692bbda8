"""`init_logger` as the P2P modules use it (kvpeer interop tests): a standard logger."""

import logging


def init_logger(name):
    return logging.getLogger(name)
