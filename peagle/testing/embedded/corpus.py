"""The embedded target's corpus: the Python standard library's own source on this machine.

Files are split into train / held-out by a hash of their path (so adding or removing a
file never moves another one), and stdlib functions with a docstring become chat
examples: the user shows the signature and docstring, the assistant writes the function.
Nothing here needs the network or a dataset download.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = ["<|user|>", "<|assistant|>", "<|end|>", "<|mask|>", "<|pad|>"]
SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
USER_PROMPT = "Complete this Python function:\n```python\n{head}\n```"
MAX_USER_CHARS = 420  # ~120 tokens with the embedded tokenizer
MAX_ASSISTANT_CHARS = 840  # ~250 tokens
MIN_BODY_LINES = 2


@dataclass(frozen=True)
class SourceFile:
    relpath: str  # posix path relative to the stdlib root: stable across machines
    text: str


@dataclass(frozen=True)
class Corpus:
    train: list[SourceFile]
    heldout: list[SourceFile]

    def stats(self) -> dict:
        def size(files):
            return sum(len(f.text.encode()) for f in files)

        return {
            "train_files": len(self.train),
            "heldout_files": len(self.heldout),
            "train_bytes": size(self.train),
            "heldout_bytes": size(self.heldout),
        }


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_skipped(rel: Path) -> bool:
    return any(part in SKIPPED_DIRS or part.startswith("test") for part in rel.parts[:-1])


def list_stdlib_files(root: Path | None = None) -> list[Path]:
    """Every ``*.py`` of the stdlib in sorted order, without test suites or installed packages."""
    root = root or stdlib_root()
    return sorted(p for p in root.rglob("*.py") if not _is_skipped(p.relative_to(root)))


def _read_source(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    if any(tok in text for tok in SPECIAL_TOKENS):
        return None  # the special tokens (above all the mask token) must never occur in training text
    return text


def _hash_unit(key: str) -> float:
    """A stable pseudo-random number in [0, 1) for a string."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:12], 16) / 16**12


def is_heldout(relpath: str, heldout_fraction: float, seed: int) -> bool:
    return _hash_unit(f"split:{seed}:{relpath}") < heldout_fraction


def load_corpus(max_bytes: int, heldout_fraction: float, seed: int, root: Path | None = None) -> Corpus:
    """Split stdlib files by path hash, then cap each split in a stable hash order.

    The held-out split is capped at ``heldout_fraction`` of ``max_bytes`` so small test
    recipes stay small.
    """
    root = root or stdlib_root()
    train, heldout = [], []
    for path in list_stdlib_files(root):
        rel = path.relative_to(root).as_posix()
        (heldout if is_heldout(rel, heldout_fraction, seed) else train).append(rel)
    return Corpus(
        train=_take_until(root, train, max_bytes, seed),
        heldout=_take_until(root, heldout, max(1, int(max_bytes * heldout_fraction)), seed),
    )


def _take_until(root: Path, relpaths: list[str], max_bytes: int, seed: int) -> list[SourceFile]:
    """Files in a seed-dependent but stable order until ``max_bytes``; returned sorted by path."""
    chosen, total = [], 0
    for rel in sorted(relpaths, key=lambda r: _hash_unit(f"order:{seed}:{r}")):
        text = _read_source(root / rel)
        if not text or not text.strip():
            continue
        size = len(text.encode())
        if total + size > max_bytes:
            if total:
                continue
            text = text[: max_bytes]  # a tiny cap still gets one (truncated) file
            size = len(text.encode())
        chosen.append(SourceFile(rel, text))
        total += size
    return sorted(chosen, key=lambda f: f.relpath)


@dataclass(frozen=True)
class FunctionExample:
    id: str  # "<relpath>::<qualified name>"
    head: str  # def line(s) + docstring, dedented
    code: str  # the whole function, dedented

    def messages(self) -> list[dict]:
        return [
            {"role": "user", "content": USER_PROMPT.format(head=self.head)},
            {"role": "assistant", "content": f"```python\n{self.code}\n```"},
        ]


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function and method, in source order."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}{node.name}", node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")


def _docstring_end(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int | None:
    first = node.body[0]
    is_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
    return first.end_lineno if is_doc else None


def function_examples(source: SourceFile) -> list[FunctionExample]:
    """Functions with a docstring and a real body, small enough for the demo's sequence lengths."""
    try:
        tree = ast.parse(source.text)
    except SyntaxError:
        return []
    lines = source.text.splitlines()
    examples = []
    for name, node in _functions(tree):
        doc_end = _docstring_end(node)
        if doc_end is None or node.end_lineno - doc_end < MIN_BODY_LINES:
            continue
        head = textwrap.dedent("\n".join(lines[node.lineno - 1 : doc_end])).rstrip()
        code = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno])).rstrip()
        if len(USER_PROMPT.format(head=head)) > MAX_USER_CHARS or len(code) > MAX_ASSISTANT_CHARS:
            continue
        examples.append(FunctionExample(f"{source.relpath}::{name}", head, code))
    return examples


def chat_examples(files: list[SourceFile]) -> list[FunctionExample]:
    """All function examples of ``files``, deduplicated by code, in file order."""
    seen, out = set(), []
    for f in files:
        for ex in function_examples(f):
            if ex.code not in seen:
                seen.add(ex.code)
                out.append(ex)
    return out
