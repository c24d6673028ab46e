"""What the data stage raises at a user: torch-free, so the CLI catches them without importing torch."""


class DiskSpaceError(RuntimeError):
    """The output disk cannot hold what a stage is about to write (or ran out while writing)."""


class CorruptShardError(RuntimeError):
    """A shard whose bytes do not match the manifest (truncated, edited or bit-rotted)."""


class MissingDatasetError(FileNotFoundError):
    """A stage needs a dataset that is not there (or not finished)."""
