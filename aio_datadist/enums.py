"""The documented enumerations: roles, placements, memory types and registration status."""

from __future__ import annotations

from enum import Enum, IntEnum

__all__ = ("LLMRole", "Placement", "RegisterMemStatus", "Memtype", "MemType")


class LLMRole(IntEnum):
    """Role label of an endpoint: prefill (``PROMPT``), decode (``DECODER``) or both (``MIX``)."""

    PROMPT = 1
    DECODER = 2
    MIX = 3

    def __str__(self) -> str:
        return f"LLMRole.{self.name}"


class Placement(IntEnum):
    """Where a cache's memory lives: host memory or accelerator (device) memory."""

    HOST = 0
    DEVICE = 1

    def __str__(self) -> str:
        return f"Placement.{self.name}"


class RegisterMemStatus(Enum):
    """State of memory registration on a two-sided link, from ``query_register_mem_status``."""

    OK = 0
    PREPARING = 1
    FAILED = 2


class Memtype(Enum):
    """Kind of memory named by a ``MemInfo``."""

    MEM_TYPE_DEVICE = 0
    MEM_TYPE_HOST = 1


MemType = Memtype
