"""Measuring tools on top of everything. They are `rtserver bench`, `rtserver loadtest`, `rtserver eval` and
their clients (docs/architecture.md). Nothing in rtserver imports them.
"""
