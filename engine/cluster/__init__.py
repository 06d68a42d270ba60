"""Cluster pipeline: a target model split by layer ranges across LAN workers over ZeroMQ.

``wire`` is the protocol (no sockets), ``transport`` the CURVE sockets, ``worker`` the
worker's server, ``head`` the :class:`~.head.PipelineTarget`, ``tail`` the head's output
layer, ``plan`` the split planner and ``transfer`` the slice distribution.
Nothing here imports :mod:`potluck.discovery`.
"""
