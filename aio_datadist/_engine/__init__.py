"""The engine: the one source of behaviour behind the blocking API and the async facade."""
