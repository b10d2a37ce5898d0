"""moebench.probecache: a slow probe's answer is remembered per installation and asked again when the
installation (or the interpreter, or a part the caller names) changes; an unusable cache is no cache."""

from __future__ import annotations

import os

from moebench import probecache


def test_an_answer_is_remembered_until_the_package_changes(tmp_path, monkeypatch):
    monkeypatch.setenv(probecache.CACHE_ENV, str(tmp_path / "cache"))
    package = tmp_path / "lib"
    package.mkdir()
    init = package / "__init__.py"
    init.write_text("x = 1\n")
    calls = []

    def probe(answer):
        return lambda: calls.append(answer) or answer

    key = probecache.fingerprint(str(init), "torch 2.13")
    assert probecache.answer(key, probe(None)) is None and calls == [None]
    assert probecache.answer(key, probe("never asked")) is None and calls == [None]  # remembered
    assert probecache.answer(probecache.fingerprint(str(init), "torch 2.14"), probe("other torch")) == "other torch"
    init.write_text("x = 2  # reinstalled\n")
    os.utime(init, ns=(1, 1))
    changed = probecache.fingerprint(str(init), "torch 2.13")
    assert changed != key
    assert probecache.answer(changed, probe("does not import here: ValueError")) == "does not import here: ValueError"
    assert calls == [None, "other torch", "does not import here: ValueError"]


def test_an_unwritable_cache_still_answers(tmp_path, monkeypatch):
    blocker = tmp_path / "afile"
    blocker.write_text("")
    monkeypatch.setenv(probecache.CACHE_ENV, str(blocker / "sub"))
    assert probecache.answer("k", lambda: "asked") == "asked"
    assert probecache.answer("k", lambda: "asked again") == "asked again"  # nothing could be kept
