"""The ways of moving bytes beside a link's own route, one package each: ``samehost``,
``ucx`` and ``hccl``. The engine knows the listed ones (``catalog.PROVIDERS``) only through
``provider.RouteProvider``."""
