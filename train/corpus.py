"""The code corpus: source files gathered, filtered, deduplicated and split.

By default the Python sources (``*.py``) of the packages installed for the
running interpreter (its site-packages). Whole files are held out for
validation by a hash of the file's name, so the split is the same on every
machine and does not move when other files come or go. Order is
deterministic: files sorted by name.
"""

from __future__ import annotations

import glob
import hashlib
import site
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.errors import InputError


@dataclass(frozen=True)
class Document:
    name: str  # path relative to the source root it was found under
    text: str


@dataclass(frozen=True)
class Limits:
    min_bytes: int = 200
    max_bytes: int = 200_000
    max_line_chars: int = 1000  # longer lines mark generated or minified files
    max_total_chars: int = 400_000_000


@dataclass
class Corpus:
    train: list[Document]
    val: list[Document]

    def describe(self) -> str:
        return (
            f"{len(self.train)} train files ({_mega_chars(self.train):.1f} M chars), "
            f"{len(self.val)} held-out files ({_mega_chars(self.val):.1f} M chars)"
        )


def _mega_chars(documents: list[Document]) -> float:
    return sum(len(d.text) for d in documents) / 1e6


def default_sources() -> list[str]:
    """The site-packages folders of the running interpreter."""
    paths = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()]
    return [p for p in dict.fromkeys(str(Path(p).resolve()) for p in paths) if Path(p).is_dir()]


def find_files(sources: list[str], pattern: str = "*.py") -> list[tuple[str, Path]]:
    """(name, path) of every file matching ``pattern`` under each source (a folder or a glob), by name."""
    found: dict[str, Path] = {}
    for source in sources:
        root = Path(source)
        if root.is_dir():
            for path in root.rglob(pattern):
                if path.is_file():
                    found.setdefault(str(path.relative_to(root)), path)
        else:
            matches = sorted(glob.glob(source, recursive=True))
            if not matches:
                raise InputError(f"corpus source {source!r} is neither a folder nor a glob matching any file")
            for match in matches:
                if Path(match).is_file():
                    found.setdefault(match, Path(match))
    return sorted(found.items())


def name_hash(name: str) -> float:
    """A stable pseudo-random number in [0, 1) from a file's name."""
    return int(hashlib.sha1(name.encode()).hexdigest()[:12], 16) / float(1 << 48)


def is_held_out(name: str, fraction: float) -> bool:
    return name_hash(name) < fraction


def acceptable(text: str, limits: Limits) -> bool:
    size = len(text.encode("utf-8", errors="replace"))
    if not limits.min_bytes <= size <= limits.max_bytes or "\x00" in text:
        return False
    return max(map(len, text.splitlines()), default=0) <= limits.max_line_chars


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def load_corpus(
    sources: list[str] | None = None,
    pattern: str = "*.py",
    val_fraction: float = 0.02,
    limits: Limits = Limits(),
    workers: int = 16,
) -> Corpus:
    """Read, filter, deduplicate (by content) and split the files of ``sources``.

    When the total exceeds ``limits.max_total_chars``, files are kept in the
    order of their name hash (a sample across packages, not the first few).
    """
    if not 0 < val_fraction < 1:
        raise InputError(f"val_fraction must be in (0, 1), got {val_fraction}")
    files = find_files(sources or default_sources(), pattern)
    with ThreadPoolExecutor(workers) as pool:
        texts = list(pool.map(_read, [path for _, path in files]))
    seen: set[bytes] = set()
    documents = []
    for (name, _), text in zip(files, texts):
        if text is None or not acceptable(text, limits):
            continue
        digest = hashlib.sha1(text.encode()).digest()
        if digest not in seen:
            seen.add(digest)
            documents.append(Document(name, text))
    total, kept = 0, []
    # A hash independent of the split's, so a cap keeps the held-out fraction.
    for document in sorted(documents, key=lambda d: name_hash("sample:" + d.name)):
        total += len(document.text)
        if total > limits.max_total_chars:
            break
        kept.append(document)
    kept.sort(key=lambda d: d.name)
    if not kept:
        raise InputError(f"no usable {pattern} files under {sources or default_sources()}")
    held = [d for d in kept if is_held_out(d.name, val_fraction)]
    return Corpus(train=[d for d in kept if not is_held_out(d.name, val_fraction)], val=held)
