"""Memory: arenas from a device runtime, pools carved from them, and array views of caches."""
