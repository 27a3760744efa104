"""One error hierarchy for everything Fuyou reports to a user.

Each error's message is one line that says what is wrong, names the path or value, and gives a
hint for the fix. The CLI prints ``str(err)`` without a traceback.
"""

from __future__ import annotations


class FuyouError(Exception):
    """Base class of every error Fuyou raises on purpose."""


class ConfigError(FuyouError, ValueError):
    """A configuration value is invalid (bad flag, bad size string, inconsistent options)."""


class DeviceMemoryError(FuyouError, MemoryError):
    """An allocation would exceed the device-memory capacity or budget."""


class HostMemoryError(FuyouError, MemoryError):
    """An allocation would exceed the host-memory (pinned buffer) budget."""


class StoreError(FuyouError):
    """Base class of SSD tensor-store errors."""


class StoreDirError(StoreError):
    """A store directory is missing, not a directory, unwritable, or belongs to another store."""


class StoreSpaceError(StoreError):
    """Not enough free space for the layout, or the disk filled up during a write."""


class DirectIOError(StoreError):
    """O_DIRECT was required (``direct='on'``) but the filesystem refuses it."""


class ChecksumError(StoreError):
    """Data read back from the store does not match the checksum written with it."""


class ManifestError(StoreError):
    """The store manifest is missing, unreadable, or inconsistent with the files on disk."""


class FuyouWarning(UserWarning):
    """Something works, but slower or less safely than asked (e.g. O_DIRECT fell back to buffered)."""
