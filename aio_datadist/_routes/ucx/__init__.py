"""The UCX route: one-sided UCP RMA against a table of the peer's caches that it sends over
the link (``table``, ``board``), on a progress worker per engine and its lanes (``worker``,
``lanes``), attached to links whose two ends enable ``aio.Ucx`` (``links``)."""
