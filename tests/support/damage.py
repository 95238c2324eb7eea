"""Ways a checkpoint's files get damaged on disk (a write cut short, a flipped bit), for the
tests that check a damaged checkpoint is named and never loaded."""

from pathlib import Path


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def dcp_shard(checkpoint: Path) -> Path:
    """The trainer's one DCP shard file in a run checkpoint."""
    [shard] = (checkpoint / "trainer").glob("*.distcp")
    return shard
