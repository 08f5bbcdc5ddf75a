"""The in-memory model of TierFS's file data path (POSIX bytes, published at
close), as docs/client.md states it.

* A file's committed contents are what readers see. After a step whose
  outcome the client cannot know (a commit that raised: it may have been
  applied) the model holds every possibility (``MFile.cands``) until a read
  tells them apart.
* ``open``: ``r`` and ``r+`` need the file; ``w``/``a`` create it; ``x``
  refuses an existing one; ``w`` writes the file anew: its handle starts
  empty, the old contents stay what readers see until its close replaces
  them (until stop 45 it truncated at open, visible at once). A file
  has at most one writer: another opens for writing with ``BusyError``,
  and truncate is refused while it is open.
* A writer's bytes are its own until ``close`` publishes them (the size and
  every chunk, at once); an ``r+``/``w+``/``a+`` handle reads its own
  writes. Any failure of a writer aborts its session: nothing of it becomes
  visible, the file keeps what it had when the writer opened (for ``w``
  too).
* A reader (``r``) that holds a file open while it is rewritten returns, per
  read call, the bytes of one version committed since it opened (the one at
  its open or a later one), never a mix; its size stays the one at open.
* ``truncate`` shrinks or grows; grown bytes read as zeros.
* ``rename`` replaces the destination; ``unlink`` forgets the name, and a
  file with no name left is gone (its readers may then fail cleanly; a
  writer of it cannot publish).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MFile", "MHandle", "Model", "apply_write", "resized"]


def apply_write(content: bytes, pos: int, data: bytes) -> bytes:
    """``content`` after writing ``data`` at ``pos`` (a gap reads as zeros)."""
    b = bytearray(content)
    if pos > len(b):
        b.extend(bytes(pos - len(b)))
    b[pos: pos + len(data)] = data
    return bytes(b)


def resized(content: bytes, size: int) -> bytes:
    return content[:size] if size <= len(content) else content + bytes(size - len(content))


@dataclass
class MFile:
    """One inode of the model."""

    name: str  # model id ("F3"), stable across renames
    cands: list[bytes]  # possible committed contents (normally one)
    versions: list[bytes] = field(default_factory=list)  # every content committed, in order
    writer: MHandle | None = None
    linked: bool = True

    def commit(self, contents: list[bytes]) -> None:
        self.cands = _uniq(contents)
        self.versions.extend(self.cands)


def _uniq(xs: list[bytes]) -> list[bytes]:
    out: list[bytes] = []
    for x in xs:
        if x not in out:
            out.append(x)
    return out


@dataclass
class MHandle:
    hid: str
    file: MFile
    mode: str
    readable: bool
    writable: bool
    append: bool
    pos: int = 0
    cands: list[bytes] = field(default_factory=list)  # writers: the handle's contents
    open_size: int = 0  # readers: the size at open (reads are clipped to it)
    first_version: int = 0  # readers: index into file.versions of the version at open
    failed: str = ""  # a writer whose session failed: nothing of it may become visible
    base: list[bytes] = field(default_factory=list)  # writers: the file's contents at open
    created: bool = False  # writers: the open created the file (an end without a commit removes it)

    def size(self) -> int:
        return len(self.cands[0]) if self.writable else self.open_size


@dataclass
class Model:
    files: dict[str, MFile] = field(default_factory=dict)  # path -> file
    handles: dict[str, MHandle] = field(default_factory=dict)
    _n: int = 0

    def new_file(self, path: str) -> MFile:
        self._n += 1
        f = MFile(f"F{self._n}", [b""], [b""])
        self.files[path] = f
        return f

    def unlink(self, path: str) -> None:
        f = self.files.pop(path)
        if f not in self.files.values():
            f.linked = False

    def rename(self, src: str, dst: str) -> None:
        f = self.files.pop(src)
        victim = self.files.get(dst)
        self.files[dst] = f
        if victim is not None and victim is not f and victim not in self.files.values():
            victim.linked = False
