"""Text from the Python standard library's own source, as bytes or as word-level tokens:
a language-modelling workload with no download, plus the settings shared by
``lm_torch.py`` and ``lm_keras.py``.

The corpus is the ``.py`` files under ``sysconfig.get_paths()["stdlib"]``, so it ships with
every Python. It depends on the Python version (3.11.7 and 3.12 ship different files):
runs are comparable only on the same version, and every summary records the version and
a digest of the corpus (``Corpus.digest``) to make that checkable.

How the corpus is built, deterministically:

* every ``.py`` file under the stdlib directory, as a sorted list of POSIX relative paths,
  skipping ``site-packages``/``dist-packages`` (installed packages, which differ between
  machines), test suites (any directory named ``test``, ``tests`` or ``idle_test``),
  ``encodings`` (generated codec tables), ``__pycache__``, files over ``MAX_FILE_BYTES`` (``pydoc_data/topics.py`` is 750 KB of
  prose, which would dominate) and files that are not valid UTF-8;
* files are visited in the order of the SHA-256 of their relative path (a fixed
  pseudo-random order, so a size cap samples the whole library rather than its first
  letters of the alphabet) and each goes to validation while validation holds less than
  ``val_fraction`` of the bytes so far, else to training; visiting stops at ``max_bytes``.
  Validation text therefore comes from files the model never trains on;
* files are joined with a NUL byte (``SEPARATOR``), which never occurs in source, so the
  model sees file boundaries.

Tokens are bytes (vocabulary 256): no vocabulary to build or ship, and identical on every
machine. Training batches: each rank draws its own random windows (generator seeded by
``(seed, rank)``). Validation: a fixed set of evenly spaced windows, the same on every rank.

Word-level tokens, for models with a large vocabulary (the speed benchmarks' 32000-token
TinyLM): :func:`build_vocab` splits the *training* text with ``TOKEN_PATTERN`` (identifiers,
digit runs, a newline with the indentation after it, other runs of spaces and tabs, and
every other character alone), keeps the ``vocab_size - 2`` most frequent tokens (ties in
string order) and reserves id 0 for the file separator and id 1 for ``<unk>``.
:func:`word_tokens` encodes both splits with it and caches the arrays on disk, so the many
processes of a benchmark do not each spend a second in the regular expression;
:func:`load_word_text` adds the size check a benchmark needs. :class:`TrainBatches` and
:func:`validation_windows` take the ``int32`` id arrays as they take the bytes. On Python
3.11.7's 4 MB corpus the training text has 1.14M such tokens of 26,454 distinct kinds, so a
32000-entry vocabulary holds all of them and 4.5% of the validation tokens are still
``<unk>`` (names that occur only in the held-out files); at 8192 entries, 6.4%.

``python examples/stdlib_text.py`` prints the corpus summary.
"""

import argparse
import collections
import hashlib
import json
import math
import os
import re
import sys
import tempfile
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

VOCAB_SIZE = 256
SEPARATOR = 0
# Installed packages differ between machines; test suites and the generated codec tables
# of encodings/ (about 100 near-identical charmaps) are not representative source.
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
                       "encodings"})
MAX_FILE_BYTES = 200_000
DEFAULT_MAX_BYTES = 4_000_000
DEFAULT_VAL_FRACTION = 0.1


@dataclass
class Corpus:
    """Training and validation bytes (``np.uint8``) and where they came from."""

    train: np.ndarray
    val: np.ndarray
    train_files: list = field(default_factory=list)
    val_files: list = field(default_factory=list)
    skipped_undecodable: list = field(default_factory=list)
    root: str = ""
    python_version: str = ""
    digest: str = ""

    def summary(self):
        return {"python_version": self.python_version, "root": self.root, "digest": self.digest,
                "train_bytes": int(self.train.size), "val_bytes": int(self.val.size),
                "train_files": len(self.train_files), "val_files": len(self.val_files),
                "skipped_undecodable": len(self.skipped_undecodable)}


def stdlib_root():
    """The directory of the running Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root=None):
    """Sorted relative POSIX paths of the eligible ``.py`` files under ``root``."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"standard library directory not found: {root}")
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        out.append(rel.as_posix())
    return sorted(out)


def _path_key(rel):
    return hashlib.sha256(rel.encode("utf-8")).hexdigest()


def load_corpus(max_bytes=DEFAULT_MAX_BYTES, val_fraction=DEFAULT_VAL_FRACTION, root=None):
    """Build the corpus (see the module docstring); about 0.3 s for 4 MB.

    Parameters
    ----------
    max_bytes : int
        Stop adding files once training plus validation hold at least this many bytes.
    val_fraction : float
        Share of the bytes that goes to validation, in (0, 0.5].
    root : path, optional
        Directory to read instead of the running Python's standard library (tests).

    Returns
    -------
    Corpus
    """
    if not 0.0 < val_fraction <= 0.5:
        raise ValueError(f"val_fraction must be in (0, 0.5], got {val_fraction}")
    if max_bytes < 10_000:
        raise ValueError(f"max_bytes={max_bytes} is too small for a useful corpus (>= 10000)")
    root = Path(root) if root is not None else stdlib_root()
    files = sorted(source_files(root), key=_path_key)
    parts = {"train": [], "val": []}
    names = {"train": [], "val": []}
    sizes = {"train": 0, "val": 0}
    skipped = []
    for rel in files:
        if sizes["train"] + sizes["val"] >= max_bytes:
            break
        data = (root / rel).read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        if SEPARATOR in data or not data:
            continue  # would blur the file boundary (or add nothing)
        split = "val" if sizes["val"] < val_fraction * (sizes["train"] + sizes["val"]) else "train"
        parts[split].append(data)
        names[split].append(rel)
        sizes[split] += len(data)
    if not parts["train"] or not parts["val"]:
        raise ValueError(f"not enough eligible source files under {root} for a train/validation split")
    joined = {k: np.frombuffer(bytes([SEPARATOR]).join(v), dtype=np.uint8).copy() for k, v in parts.items()}
    h = hashlib.sha256()
    for k in ("train", "val"):
        h.update(k.encode())
        h.update(joined[k].tobytes())
    return Corpus(joined["train"], joined["val"], names["train"], names["val"], skipped, str(root),
                  ".".join(map(str, sys.version_info[:3])), h.hexdigest()[:16])


def _unit(data):
    return "bytes" if data.dtype == np.uint8 else "tokens"


def windows_at(data, offsets, context):
    """Inputs ``data[o:o+context]`` and next-byte targets ``data[o+1:o+context+1]``,
    as ``int64`` arrays of shape ``(len(offsets), context)``."""
    offsets = np.asarray(offsets, dtype=np.int64)
    idx = offsets[:, None] + np.arange(context + 1, dtype=np.int64)[None, :]
    chunk = data[idx].astype(np.int64)
    return chunk[:, :-1], chunk[:, 1:]


class TrainBatches:
    """Random training windows, different on every rank: the generator is seeded by
    ``(seed, rank)``, so a run is reproducible and ranks see different text.

    Parameters
    ----------
    data : np.ndarray of uint8 (bytes) or int32 (word ids, see :func:`word_tokens`)
    context : int
        Window length (the model's context).
    batch : int
        Windows per batch, per rank.
    seed, rank : int
    """

    def __init__(self, data, context, batch, seed, rank):
        if data.size < context + 2:
            raise ValueError(f"training text ({data.size} {_unit(data)}) is shorter than one window "
                             f"({context + 2} {_unit(data)} needed)")
        if batch < 1 or context < 1:
            raise ValueError(f"batch and context must be positive, got {batch}, {context}")
        self.data, self.context, self.batch = data, int(context), int(batch)
        self.rng = np.random.default_rng([int(seed), int(rank)])

    def next(self):
        offsets = self.rng.integers(0, self.data.size - self.context, size=self.batch)
        return windows_at(self.data, offsets, self.context)

    def take(self, steps):
        """``steps`` batches stacked: arrays of shape ``(steps * batch, context)``."""
        xs, ys = zip(*(self.next() for _ in range(steps))) if steps else ((), ())
        if not xs:
            empty = np.zeros((0, self.context), np.int64)
            return empty, empty
        return np.concatenate(xs), np.concatenate(ys)


def validation_windows(data, context, count):
    """``count`` evenly spaced windows over the validation text: fixed, no randomness,
    identical on every rank and every run."""
    if count < 1:
        raise ValueError(f"need at least one validation window, got {count}")
    last = data.size - context - 1
    if last < 0:
        raise ValueError(f"validation text ({data.size} {_unit(data)}) is shorter than one window "
                         f"({context + 1} {_unit(data)} needed)")
    offsets = np.linspace(0, last, count).round().astype(np.int64)
    return windows_at(data, offsets, context)


def decode(tokens):
    """Bytes back to text (invalid UTF-8 replaced), for printing samples."""
    return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


# --- word-level tokens ------------------------------------------------------------------------
# One token per match, and every character is matched by some alternative (the last one takes
# any single character, DOTALL), so joining the tokens gives the text back exactly:
#   [^\W\d]\w*   an identifier or word (Unicode letters allowed, as in Python names)
#   \d+          a run of digits ("3.14" is "3", ".", "14": numbers share their pieces)
#   \n[ \t]*     a newline with the indentation of the next line: one token per depth
#   [ \t]+       any other run of spaces and tabs
#   .            anything else alone: operators, brackets, quotes, the NUL separator, \r ...
TOKEN_PATTERN = re.compile(r"[^\W\d]\w*|\d+|\n[ \t]*|[ \t]+|.", re.DOTALL)
# Bump when TOKEN_PATTERN or the vocabulary rule changes: it is part of the cache key.
TOKENIZER_VERSION = 1
UNK = 1
UNK_TEXT = "<unk>"
_SEPARATOR_TEXT = chr(SEPARATOR)


def _text(text_or_bytes):
    if isinstance(text_or_bytes, str):
        return text_or_bytes
    if isinstance(text_or_bytes, np.ndarray):
        text_or_bytes = text_or_bytes.astype(np.uint8, copy=False).tobytes()
    return bytes(text_or_bytes).decode("utf-8")


def split_tokens(text_or_bytes):
    """The token strings of ``TOKEN_PATTERN`` (``"".join`` of them is the text)."""
    return TOKEN_PATTERN.findall(_text(text_or_bytes))


class WordVocab:
    """A word-level vocabulary: id 0 the file separator, id 1 ``<unk>``, then the kept
    tokens from the most frequent down.

    ``size`` is the id space asked for (the model's embedding rows); when the training text
    has fewer distinct tokens, the ids from ``len(tokens)`` to ``size - 1`` are never
    produced. ``digest`` is a short SHA-256 of the size and the token list.
    """

    def __init__(self, tokens, size):
        tokens = list(tokens)
        if tokens[:2] != [_SEPARATOR_TEXT, UNK_TEXT]:
            raise ValueError("a WordVocab's first two tokens are the separator and <unk>")
        if len(tokens) > size:
            raise ValueError(f"{len(tokens)} tokens do not fit in a vocabulary of {size}")
        self.tokens, self.size = tokens, int(size)
        # "<unk>" in the text is a word like any other, not id 1: only index 2 onwards.
        self.index = {t: i for i, t in enumerate(tokens) if i >= 2}
        self.index[_SEPARATOR_TEXT] = SEPARATOR
        h = hashlib.sha256(json.dumps([self.size, tokens]).encode("utf-8"))
        self.digest = h.hexdigest()[:16]

    def __len__(self):
        return len(self.tokens)

    def encode(self, text_or_bytes):
        """Text (``str``, UTF-8 ``bytes`` or a ``uint8`` array) to ``int32`` ids."""
        get = self.index.get
        return np.fromiter((get(t, UNK) for t in split_tokens(text_or_bytes)), dtype=np.int32)

    def decode(self, ids):
        """Ids back to text; ``<unk>`` (and ids no token has) print as ``"<unk>"``."""
        n = len(self.tokens)
        out = []
        for i in np.asarray(ids, dtype=np.int64).ravel().tolist():
            if not 0 <= i < self.size:
                raise ValueError(f"id {i} is outside the vocabulary (0..{self.size - 1})")
            out.append(self.tokens[i] if i < n else UNK_TEXT)
        return "".join(out)

    def summary(self):
        return {"vocab_size": self.size, "vocab_used": len(self.tokens), "vocab_digest": self.digest,
                "tokenizer": f"word-v{TOKENIZER_VERSION}"}


def build_vocab(corpus, vocab_size):
    """The vocabulary of ``corpus``'s *training* text (validation never shapes it).

    Tokens of ``TOKEN_PATTERN`` are counted, the ``vocab_size - 2`` most frequent kept (equal
    counts in the order of the token strings, so the result does not depend on hashing or
    file order), after id 0 (the separator between files) and id 1 (``<unk>``).
    """
    if vocab_size < 3:
        raise ValueError(f"vocab_size must be at least 3 (separator, <unk>, one word), got {vocab_size}")
    counts = collections.Counter(split_tokens(corpus.train))
    counts.pop(_SEPARATOR_TEXT, None)
    kept = sorted(counts, key=lambda t: (-counts[t], t))[:vocab_size - 2]
    return WordVocab([_SEPARATOR_TEXT, UNK_TEXT] + kept, vocab_size)


def cache_dir():
    """``$HVD_QUANT_CACHE/text`` if that is set, else ``~/.cache/hvd_quant/text``."""
    base = os.environ.get("HVD_QUANT_CACHE")
    base = Path(base) if base else Path.home() / ".cache" / "hvd_quant"
    return base / "text"


def _cache_path(corpus, vocab_size):
    return cache_dir() / f"words-v{TOKENIZER_VERSION}-{corpus.digest}-{int(vocab_size)}.npz"


def _payload_digest(train, val, vocab_json):
    h = hashlib.sha256()
    for part in (train.tobytes(), val.tobytes(), vocab_json):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def _read_cache(path, corpus, vocab_size):
    """The cached (train, val, vocab), or None when absent, unreadable or not this corpus's."""
    try:
        with np.load(path, allow_pickle=False) as z:
            train, val = z["train"], z["val"]
            vocab_json = z["vocab"].tobytes()
            stored = bytes(z["check"].tobytes()).decode("ascii")
            meta = json.loads(bytes(z["meta"].tobytes()).decode("utf-8"))
    except Exception:
        return None
    if (meta.get("corpus_digest") != corpus.digest or meta.get("vocab_size") != int(vocab_size)
            or train.dtype != np.int32 or val.dtype != np.int32
            or stored != _payload_digest(train, val, vocab_json)):
        return None
    try:
        vocab = WordVocab(json.loads(vocab_json.decode("utf-8")), vocab_size)
    except (ValueError, UnicodeDecodeError):
        return None
    return train, val, vocab


def _write_cache(path, corpus, vocab_size, train, val, vocab):
    vocab_json = json.dumps(vocab.tokens).encode("utf-8")
    meta = json.dumps({"corpus_digest": corpus.digest, "vocab_size": int(vocab_size),
                       "vocab_digest": vocab.digest}).encode("utf-8")
    check = _payload_digest(train, val, vocab_json).encode("ascii")
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write to a private file, then rename: processes that start together never read half a file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the entry from other users of the cache
        with os.fdopen(fd, "wb") as f:
            np.savez(f, train=train, val=val, vocab=np.frombuffer(vocab_json, np.uint8),
                     meta=np.frombuffer(meta, np.uint8), check=np.frombuffer(check, np.uint8))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def word_tokens(corpus, vocab_size, cache=True):
    """Both splits of ``corpus`` as ``int32`` word ids, with the training vocabulary.

    Returns ``(train_ids, val_ids, vocab)``. The arrays are cached under :func:`cache_dir`,
    keyed by the corpus digest, the vocabulary size and ``TOKENIZER_VERSION``; an entry that
    cannot be read or whose checksum does not match is rebuilt (about 2 s for 4 MB).
    """
    path = _cache_path(corpus, vocab_size)
    if cache:
        hit = _read_cache(path, corpus, vocab_size)
        if hit is not None:
            return hit
    vocab = build_vocab(corpus, vocab_size)
    train, val = vocab.encode(corpus.train), vocab.encode(corpus.val)
    if cache:
        try:
            _write_cache(path, corpus, vocab_size, train, val, vocab)
        except OSError as e:  # a read-only home must not stop a run
            print(f"stdlib_text: cannot cache word tokens at {path}: {e}", file=sys.stderr)
    return train, val, vocab


@dataclass
class WordText:
    """What :func:`load_word_text` returns: the corpus, its ids and the vocabulary."""

    corpus: Corpus
    train: np.ndarray
    val: np.ndarray
    vocab: WordVocab

    def summary(self):
        """For benchmark summaries: data source, corpus and vocabulary digests, sizes."""
        out = {"data": "stdlib", "corpus_digest": self.corpus.digest, "python_version":
               self.corpus.python_version, "train_tokens": int(self.train.size),
               "val_tokens": int(self.val.size),
               "val_unk_fraction": float(np.mean(self.val == UNK)) if self.val.size else 0.0}
        out.update(self.vocab.summary())
        return out


def load_word_text_once_per_host(first_on_host, barrier, vocab_size, context, batch, **kwargs):
    """:func:`load_word_text` in a job of several processes per host: the first process on
    each host (``first_on_host``) builds the token cache, the others read it after
    ``barrier()`` (every process calls it), rather than every rank encoding the same
    megabytes at once on a shared machine."""
    if first_on_host:
        text = load_word_text(vocab_size, context, batch, **kwargs)
    barrier()
    if not first_on_host:
        text = load_word_text(vocab_size, context, batch, **kwargs)
    return text


def add_data_arguments(parser, random_means, scope=""):
    """The speed benchmarks' data options: ``--data stdlib|random`` (``random_means``: what
    the random tokens are in that benchmark), ``--corpus-bytes``, ``--val-windows``;
    ``scope`` prefixes their help (e.g. "model cases: ")."""
    parser.add_argument("--data", choices=("stdlib", "random"), default="stdlib",
                        help=f"{scope}word tokens of the stdlib's source, a new batch every step "
                             f"(default), or {random_means}")
    parser.add_argument("--corpus-bytes", type=int, default=DEFAULT_MAX_BYTES,
                        help=f"{scope}--data stdlib: bytes of stdlib source to read")
    parser.add_argument("--val-windows", type=int, default=32,
                        help=f"{scope}held-out windows the loss is measured on")


def load_word_text(vocab_size, context, batch, max_bytes=DEFAULT_MAX_BYTES,
                   val_fraction=DEFAULT_VAL_FRACTION, root=None, cache=True):
    """The stdlib corpus as word ids, checked to be large enough for ``batch`` windows of
    ``context`` tokens; the one call a benchmark needs.

    Raises ``FileNotFoundError`` or ``ValueError`` naming the directory looked in, the bytes
    found there and the tokens needed when the corpus is missing or too small.
    """
    where = Path(root) if root is not None else stdlib_root()
    need = int(context) + int(batch) + 1  # ``batch`` distinct windows of context + 1 tokens
    hint = "(raise --corpus-bytes, or lower --seq/--context or --batch)"
    try:
        corpus = load_corpus(max_bytes, val_fraction, root=root)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"no Python standard library source at {where}: 0 bytes found, "
                                f"{need} tokens needed for context {context} x batch {batch}") from e
    except ValueError as e:
        found = sum((where / rel).stat().st_size for rel in source_files(where)) if where.is_dir() else 0
        raise ValueError(f"standard library source at {where}: {found} bytes of eligible .py files "
                         f"found, not enough for a train/validation split with {need} tokens of "
                         f"training text (context {context} x batch {batch}) {hint}: {e}") from e
    train, val, vocab = word_tokens(corpus, vocab_size, cache=cache)
    if train.size < need or val.size < int(context) + 1:
        raise ValueError(f"standard library source at {where} (max_bytes={max_bytes}): "
                         f"{corpus.train.size} training bytes -> {train.size} tokens and "
                         f"{corpus.val.size} validation bytes -> {val.size} tokens; needed "
                         f"{need} training tokens (context {context} + batch {batch} + 1) and "
                         f"{int(context) + 1} validation tokens {hint}")
    return WordText(corpus, train, val, vocab)


# --- settings shared by lm_torch.py and lm_keras.py -------------------------------------------
OPTIMIZERS = ("adam", "sgdm", "onebit_adam", "zero_one_adam", "binsgdm")
BASELINES = ("adam", "sgdm")


def lm_arguments(description, argv=None):
    """The command line of both LM scripts (same names, same defaults)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adam",
                   help="adam/sgdm: fp32 allreduce baselines; the others: hvd_quant's 1-bit optimizers")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default per optimizer, see DEFAULT_LR)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=16, help="windows per rank per step")
    p.add_argument("--warmup", type=int, default=None,
                   help="linear warm-up steps from 0 to --lr (default: 25%% of --steps)")
    p.add_argument("--decay", choices=["cosine", "constant"], default="cosine",
                   help="after warm-up: cosine decay to --min-lr-ratio * lr, or constant")
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--beta", type=float, default=None,
                   help="momentum: Adam's beta1, SGD's momentum, BinSGDM's beta (default: 0.8 for "
                        "BinSGDM, its default since 2026-12-06; 0.9 for the others)")
    p.add_argument("--beta2", type=float, default=0.99,
                   help="Adam's beta2 (Adam family); 0.99 as for small character-level models, and "
                        "so that the variance the 1-bit methods freeze early is nearly settled")
    p.add_argument("--eps", type=float, default=1e-8,
                   help="Adam family: the denominator's epsilon (sqrt(v) + eps)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--freeze-step", type=int, default=None,
                   help="1-bit Adam: fp32 warm-up steps (default: the end of the LR warm-up)")
    p.add_argument("--var-freeze-step", type=int, default=None,
                   help="0/1 Adam: variance updates stop here (default: end of warm-up)")
    p.add_argument("--var-update-scaler", type=int, default=16)
    p.add_argument("--local-step-scaler", type=int, default=None,
                   help="0/1 Adam: local steps between doublings of the sync interval "
                        "(default: sized so that it reaches --local-step-clipper mid-run)")
    p.add_argument("--local-step-clipper", type=int, default=16)
    p.add_argument("--scales", choices=["tensor", "group"], default="tensor",
                   help="1-bit Adam and 0/1 Adam: one compression scale per tensor (as "
                        "DeepSpeed's step()), or one for the whole model (as DeepSpeed's fp16 "
                        "optimizer, which flattens it)")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--corpus-bytes", type=int, default=DEFAULT_MAX_BYTES)
    p.add_argument("--val-windows", type=int, default=256)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="rank 0 writes its summary here")
    args = p.parse_args(argv)
    return resolve_defaults(args, p)


# Peak learning rates tuned on the torch LM (2 ranks, 600 steps, batch 16 per rank).
DEFAULT_LR = {"adam": 3e-3, "sgdm": 0.3, "onebit_adam": 3e-3, "zero_one_adam": 3e-3, "binsgdm": 1e-3}

# Each optimizer's own default momentum: BinSGDM's one beta is hvd_quant's default
# (hvd_quant.optimizers.binsgdm.DEFAULT_BETA; this module imports nothing of hvd_quant).
DEFAULT_BETA = {"adam": 0.9, "sgdm": 0.9, "onebit_adam": 0.9, "zero_one_adam": 0.9, "binsgdm": 0.8}


def resolve_defaults(args, parser=None):
    """Fill the defaults that depend on other options, and check the combination."""
    def fail(msg):
        if parser is not None:
            parser.error(msg)
        raise ValueError(msg)

    if args.steps < 1 or args.batch < 1 or args.eval_every < 1:
        fail("--steps, --batch and --eval-every must be positive")
    if args.d_model % args.heads:
        fail(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
    if args.lr is None:
        args.lr = DEFAULT_LR[args.optimizer]
    if args.beta is None:
        args.beta = DEFAULT_BETA[args.optimizer]
    if args.warmup is None:
        # A quarter of the run. Measured under DeepSpeed's rule (no bias correction; today
        # bias_correction=False), whose early steps are up to 2x Adam's: with a 10% warm-up
        # that cost the 1-bit Adams 0.38 nats here (600 steps), with 25% nothing, and Adam
        # 0.01. Not measured again since bias correction became their default.
        args.warmup = max(1, args.steps // 4)
    if args.freeze_step is None:
        args.freeze_step = args.warmup
    if args.var_freeze_step is None:
        args.var_freeze_step = args.warmup
    if args.local_step_scaler is None:
        # Phase B has steps - var_freeze_step steps; H doubles log2(clipper) times, and it
        # should reach the clipper by about the middle of that phase.
        doublings = max(1, int(math.log2(max(2, args.local_step_clipper))))
        args.local_step_scaler = max(1, (args.steps - args.var_freeze_step) // (2 * doublings))
    return args


def lr_at(step, args):
    """Learning rate of step ``step`` (0-based): linear warm-up to ``args.lr`` over
    ``args.warmup`` steps, then constant or cosine decay to ``min_lr_ratio * lr``."""
    peak = args.lr
    if step < args.warmup:
        return peak * (step + 1) / args.warmup
    if args.decay == "constant":
        return peak
    span = max(1, args.steps - args.warmup)
    progress = min(1.0, (step - args.warmup) / span)
    low = args.min_lr_ratio * peak
    return low + 0.5 * (peak - low) * (1.0 + math.cos(math.pi * progress))


def schedule_summary(args):
    """The optimizer-specific options that apply to ``args.optimizer`` (for labels/JSON)."""
    out = {"lr": args.lr, "warmup": args.warmup, "decay": args.decay, "beta": args.beta}
    if args.optimizer in ("adam", "onebit_adam", "zero_one_adam"):
        out["beta2"] = args.beta2
        if getattr(args, "eps", 1e-8) != 1e-8:
            out["eps"] = args.eps
    if args.optimizer == "onebit_adam":
        out["freeze_step"] = args.freeze_step
    if args.optimizer in ("onebit_adam", "zero_one_adam") and args.scales != "tensor":
        out["scales"] = args.scales
    if args.optimizer == "zero_one_adam":
        out.update(var_freeze_step=args.var_freeze_step, var_update_scaler=args.var_update_scaler,
                   local_step_scaler=args.local_step_scaler, local_step_clipper=args.local_step_clipper)
    return out


def weights_digest(arrays):
    """Short SHA-256 of a list of arrays' bytes: equal digests mean identical weights."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


class LMReport:
    """Progress lines on rank 0 and the JSON summary of an LM run (both frameworks).

    Parameters
    ----------
    args : argparse.Namespace
        From :func:`lm_arguments`.
    framework : str
        ``"torch"`` or ``"keras"``.
    rank, size : int
    numel : int
        Trainable parameters (elements).
    corpus : Corpus
    allgather_object : callable
        Horovod's ``allgather_object`` of the framework: every rank's value, in rank order.
    """

    def __init__(self, args, framework, rank, size, numel, corpus, allgather_object):
        self.args, self.framework, self.rank, self.size = args, framework, rank, size
        self.numel, self.corpus, self.gather = numel, corpus, allgather_object
        self.label = f"{framework}/{args.optimizer} np={size}"
        self.history = []
        self.began = time.perf_counter()
        # What one fp32 ring allreduce of the parameters sends per rank.
        self.fp32_bytes_per_step = 2.0 * (size - 1) / size * 4 * numel
        self._print(f"{numel:,} parameters; corpus {corpus.digest} (Python {corpus.python_version}): "
                    f"{corpus.train.size:,} training bytes in {len(corpus.train_files)} files, "
                    f"{corpus.val.size:,} validation bytes in {len(corpus.val_files)} files, "
                    f"{args.val_windows} validation windows of {args.context}")
        self._print(f"{args.steps} steps x {args.batch} windows per rank; {schedule_summary(args)}")

    def _print(self, text):
        if self.rank == 0:
            print(f"[{self.label}] {text}", flush=True)

    def evaluation(self, step, lr, train_loss, val_loss, bytes_sent, comm_rounds, step_time):
        """Record one evaluation; ``train_loss`` and ``val_loss`` are this rank's, the row
        holds their means over ranks. Every rank must call it (it communicates)."""
        rows = self.gather([float(train_loss), float(val_loss), float(bytes_sent)])
        train, val, sent = (np.array(col, dtype=np.float64) for col in zip(*rows))
        row = {"step": step, "lr": lr, "train_loss": float(train.mean()), "val_loss": float(val.mean()),
               "val_loss_spread": float(val.max() - val.min()), "bytes_per_step": float(sent[0] / step),
               "comm_rounds": int(comm_rounds), "step_time_ms": 1000.0 * step_time}
        self.history.append(row)
        self._print(f"step {step:5d}/{self.args.steps}  lr {lr:.2e}  train {row['train_loss']:.4f}  "
                    f"val {row['val_loss']:.4f}  bytes/step/rank {row['bytes_per_step']:,.0f}  "
                    f"rounds {comm_rounds}  {row['step_time_ms']:.1f} ms/step")
        return row

    def finish(self, kind_counts, digest, skipped_steps=0):
        """Gather every rank's weight digest and bytes; rank 0 prints and writes JSON.
        ``skipped_steps``: steps the optimizer left out because values were not finite."""
        if not self.history:
            raise RuntimeError("finish() before any evaluation")
        last = self.history[-1]
        per_rank = self.gather([digest, last["bytes_per_step"] * last["step"]])
        digests = [d for d, _ in per_rank]
        a = self.args
        summary = {
            "framework": self.framework, "optimizer": a.optimizer, "ranks": self.size,
            "schedule": schedule_summary(a), "steps": a.steps, "batch_per_rank": a.batch,
            "seed": a.seed, "model": {"parameters": self.numel, "d_model": a.d_model, "heads": a.heads,
                                      "layers": a.layers, "context": a.context},
            "corpus": self.corpus.summary(), "val_windows": a.val_windows,
            "final_train_loss": last["train_loss"], "final_val_loss": last["val_loss"],
            "final_val_loss_spread": last["val_loss_spread"],
            "bytes_per_step": last["bytes_per_step"],
            "bytes_per_step_per_rank": [b / a.steps for _, b in per_rank],
            "fp32_allreduce_bytes_per_step": self.fp32_bytes_per_step,
            "comm_rounds": last["comm_rounds"], "step_kinds": kind_counts, "skipped_steps": int(skipped_steps),
            "step_time_ms": last["step_time_ms"], "wall_time_s": time.perf_counter() - self.began,
            "weights_digests": digests, "ranks_agree": len(set(digests)) == 1,
            "history": self.history,
        }
        if summary["bytes_per_step"] > 0:
            ratio = f"{self.fp32_bytes_per_step / summary['bytes_per_step']:.1f}x fewer than fp32 allreduce"
        else:
            ratio = "nothing sent"
        self._print(f"final val loss {last['val_loss']:.4f} (train {last['train_loss']:.4f}); "
                    f"{summary['bytes_per_step']:,.0f} bytes/step/rank ({ratio}); "
                    f"{summary['comm_rounds']} rounds in {a.steps} steps; kinds {kind_counts}; "
                    f"ranks {'agree' if summary['ranks_agree'] else 'differ'}"
                    + (f"; {int(skipped_steps)} steps skipped (not finite)" if skipped_steps else ""))
        if self.rank == 0 and a.json:
            with open(a.json, "w") as f:
                json.dump(summary, f, indent=1)
        return summary


def _main():
    p = argparse.ArgumentParser(description="Print the stdlib corpus summary.")
    p.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES)
    p.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION)
    p.add_argument("--vocab", type=int, default=None,
                   help="also build the word vocabulary of this size and print its coverage")
    args = p.parse_args()
    corpus = load_corpus(args.max_bytes, args.val_fraction)
    for key, value in corpus.summary().items():
        print(f"{key:20s} {value}")
    if args.vocab:
        train, val, vocab = word_tokens(corpus, args.vocab)
        for key, value in WordText(corpus, train, val, vocab).summary().items():
            print(f"{key:20s} {value}")
    print("first validation files:", ", ".join(corpus.val_files[:5]))
    print("sample:", repr(decode(corpus.val[:200])))


if __name__ == "__main__":
    _main()
