"""Transports: how two endpoints exchange control frames and bulk KV bytes."""
