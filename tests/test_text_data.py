"""The word-level tokens of ``examples/stdlib_text.py`` that the speed benchmarks train on:
a deterministic vocabulary from the training files only, exact round trips, the on-disk
cache (used, and rebuilt when damaged), the size check, and the per-rank batch streams.

Single process, a small corpus (300 KB of the running Python's standard library), a few
seconds in all; every test that caches points ``HVD_QUANT_CACHE`` at its own directory.
"""

import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

import stdlib_text as st  # noqa: E402

SMALL = 300_000  # bytes


@pytest.fixture(scope="module")
def corpus():
    return st.load_corpus(SMALL)


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HVD_QUANT_CACHE", str(tmp_path))
    return tmp_path / "text"


def test_pattern_splits_python_source_and_joins_back():
    text = "def f(x_1):\n    return x_1 + 42  # ok\n\n\tpass\r\n"
    tokens = st.split_tokens(text)
    assert "".join(tokens) == text
    assert tokens[:6] == ["def", " ", "f", "(", "x_1", ")"]
    assert "\n    " in tokens and "42" in tokens and "\n\t" in tokens and "\r" in tokens
    assert st.split_tokens("naïve = 3.14") == ["naïve", " ", "=", " ", "3", ".", "14"]


def test_vocab_is_deterministic_and_from_training_text_only(corpus):
    a, b = st.build_vocab(corpus, 2000), st.build_vocab(corpus, 2000)
    assert a.tokens == b.tokens and a.digest == b.digest and len(a.digest) == 16
    assert a.size == len(a) == 2000
    assert a.tokens[0] == chr(st.SEPARATOR) and a.tokens[1] == st.UNK_TEXT
    # Most frequent first, equal counts in string order.
    counts = {}
    for t in st.split_tokens(corpus.train):
        counts[t] = counts.get(t, 0) + 1
    kept = a.tokens[2:]
    keys = [(-counts[t], t) for t in kept]
    assert keys == sorted(keys)
    assert min(counts[t] for t in kept) >= max(c for t, c in counts.items() if t not in set(kept) | {"\0"})
    # A different size is a different vocabulary (and digest); a larger one than the text
    # has kinds of tokens keeps them all, and its spare ids are never produced.
    assert st.build_vocab(corpus, 1000).digest != a.digest
    big = st.build_vocab(corpus, 10**6)
    assert big.size == 10**6 and len(big) == len(set(counts) - {"\0"}) + 2
    with pytest.raises(ValueError, match="at least 3"):
        st.build_vocab(corpus, 2)


def test_round_trip_on_real_text_and_unknown_words(corpus):
    vocab = st.build_vocab(corpus, 10**6)  # every training token kept
    train_text = corpus.train[:50_000].tobytes().decode("utf-8", errors="ignore")
    train_text = train_text[:train_text.rindex("\n") + 1]  # no word cut in half (unknown)
    ids = vocab.encode(train_text)
    assert ids.dtype == np.int32 and not (ids == st.UNK).any()
    assert vocab.decode(ids) == train_text
    assert np.array_equal(vocab.encode(train_text.encode("utf-8")), ids)
    assert np.array_equal(vocab.encode(corpus.train[:1000]), vocab.encode(corpus.train[:1000].tobytes()))
    # Words the training text never had are id 1; the separator is id 0; "<unk>" written in
    # the text is a word of its own (here unknown), not the reserved id.
    ids = vocab.encode("zzq_never_seen_anywhere_1 = 1\0<unk>")
    assert ids[0] == st.UNK and ids[-4] == st.SEPARATOR
    assert vocab.decode(ids).startswith("<unk> = 1\0")
    small = st.build_vocab(corpus, 50)
    some = small.encode(train_text[:5000])
    assert (some == st.UNK).any() and some.max() < 50
    with pytest.raises(ValueError, match="outside"):
        small.decode([50])


def test_validation_files_are_held_out(corpus, cache):
    assert not set(corpus.train_files) & set(corpus.val_files)
    train, val, vocab = st.word_tokens(corpus, 4096)
    # Separators count the files: the ids keep the boundaries the bytes had.
    assert (train == st.SEPARATOR).sum() == len(corpus.train_files) - 1
    assert (val == st.SEPARATOR).sum() == len(corpus.val_files) - 1
    assert np.array_equal(val, vocab.encode(corpus.val))
    # The vocabulary did not see the validation files: words only they use are unknown.
    only_val = set(st.split_tokens(corpus.val)) - set(st.split_tokens(corpus.train))
    assert only_val and not only_val & set(vocab.tokens[2:])
    assert 0 < np.mean(val == st.UNK) < 0.2


def test_cache_is_used_and_rebuilt_when_damaged(corpus, cache, monkeypatch):
    train, val, vocab = st.word_tokens(corpus, 3000)
    files = list(cache.glob("*.npz"))
    assert len(files) == 1 and corpus.digest in files[0].name and "-3000" in files[0].name
    built = []
    real_build = st.build_vocab
    monkeypatch.setattr(st, "build_vocab", lambda *a: built.append(a) or real_build(*a))
    again = st.word_tokens(corpus, 3000)
    assert not built, "a valid cache entry was rebuilt"
    assert np.array_equal(again[0], train) and np.array_equal(again[1], val)
    assert again[2].digest == vocab.digest and again[2].tokens == vocab.tokens
    # Truncated, garbage, or valid-looking but altered: each rebuilt, and the entry repaired.
    raw = files[0].read_bytes()
    for damaged in (raw[: len(raw) // 2], b"not a zip file", raw.replace(b"return", b"retorn", 1)):
        files[0].write_bytes(damaged)
        built.clear()
        fixed = st.word_tokens(corpus, 3000)
        assert built and np.array_equal(fixed[0], train) and fixed[2].digest == vocab.digest
        built.clear()
        st.word_tokens(corpus, 3000)
        assert not built
    # Another vocabulary size is another entry.
    st.word_tokens(corpus, 2500)
    assert len(list(cache.glob("*.npz"))) == 2


def test_a_stale_entry_for_another_corpus_is_not_used(corpus, cache):
    st.word_tokens(corpus, 3000)
    entry = next(cache.glob("*.npz"))
    other = st.load_corpus(200_000)
    assert other.digest != corpus.digest
    # Put this corpus's arrays under the other corpus's name: the stored digest disagrees.
    entry.rename(st._cache_path(other, 3000))
    train, val, vocab = st.word_tokens(other, 3000)
    fresh = st.word_tokens(other, 3000, cache=False)
    assert np.array_equal(train, fresh[0]) and np.array_equal(val, fresh[1]) and vocab.digest == fresh[2].digest


def test_too_small_or_missing_corpus_fails_clearly(tmp_path, cache):
    with pytest.raises(FileNotFoundError, match=r"missing.*0 bytes found.*tokens needed"):
        st.load_word_text(1000, 32, 8, root=tmp_path / "missing")
    # Two small files: enough for a split, far too little for 64 windows of 4096 tokens.
    for name in ("a.py", "b.py"):
        (tmp_path / "lib" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "lib" / name).write_text("x = 1\n" * 200)
    with pytest.raises(ValueError, match=r"lib.*1200 training bytes.*needed 4161 training tokens") as e:
        st.load_word_text(1000, 4096, 64, max_bytes=10_000, val_fraction=0.5, root=tmp_path / "lib")
    assert "--corpus-bytes" in str(e.value)
    # No files at all under an existing directory: the split itself fails, naming the bytes.
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty: 0 bytes of eligible .py files found"):
        st.load_word_text(1000, 32, 8, root=tmp_path / "empty")
    # The batch classes name the unit of what they got.
    with pytest.raises(ValueError, match=r"5 tokens.*34 tokens needed"):
        st.TrainBatches(np.zeros(5, np.int32), 32, 4, 0, 0)
    with pytest.raises(ValueError, match=r"5 bytes"):
        st.validation_windows(np.zeros(5, np.uint8), 32, 4)


def test_batches_of_ids_per_rank_and_validation(corpus, cache):
    text = st.load_word_text(4096, 32, 8, max_bytes=SMALL)
    assert text.summary()["data"] == "stdlib" and text.summary()["vocab_digest"] == text.vocab.digest
    assert text.summary()["corpus_digest"] == corpus.digest
    a = st.TrainBatches(text.train, 32, 8, seed=3, rank=1).take(3)
    b = st.TrainBatches(text.train, 32, 8, seed=3, rank=1).take(3)
    c = st.TrainBatches(text.train, 32, 8, seed=3, rank=0).take(3)
    assert a[0].shape == (24, 32) and a[0].dtype == np.int64
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])
    assert np.array_equal(a[0][:, 1:], a[1][:, :-1])  # targets are the next tokens
    assert a[0].max() < 4096 and a[0].min() >= 0
    x, y = st.validation_windows(text.val, 32, 16)
    x2, _ = st.validation_windows(text.val, 32, 16)
    assert x.shape == (16, 32) and np.array_equal(x, x2) and np.array_equal(x[:, 1:], y[:, :-1])


def test_the_examples_momentum_is_each_optimizers_own_default():
    """``--beta`` left out gives BinSGDM hvd_quant's own default (0.8 since 2026-12-06),
    the Adam family and SGD 0.9; given, it wins for every optimizer."""
    from hvd_quant.optimizers.binsgdm import DEFAULT_BETA

    def beta(*argv):
        return st.lm_arguments("test", list(argv)).beta

    assert beta("--optimizer", "binsgdm") == DEFAULT_BETA == 0.8
    assert beta("--optimizer", "adam") == beta("--optimizer", "onebit_adam") == 0.9
    assert beta("--optimizer", "binsgdm", "--beta", "0.9") == 0.9
    assert st.schedule_summary(st.lm_arguments("test", ["--optimizer", "binsgdm"]))["beta"] == 0.8
