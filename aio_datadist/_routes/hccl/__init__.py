"""The HCCL communicator route: a rank-table domain's members bind their memory to its
communicator, and requests between them name rows the serving side moves one-sided
(``domain``, ``route``). The rank-table domains (``_engine.comm``) place the route on the
links of a domain as it forms, and take it away as it goes."""
