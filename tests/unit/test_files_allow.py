"""Files are the operator's to hand out (issue 34, item 6): the path rule of
``--allow-source-path`` (millwheel/connectors/spec.py ``SourcePaths``) and a files source
confined to it (millwheel/connectors/files.py), on real files, directories and links.

The rule judges where a path leads (``..`` and links resolved), refuses with
PermissionDeniedError naming the path as given and the flag, and says the same whether
the file exists or not; a confined source refuses a file that is a link, or one reached
through a directory that leads elsewhere, before it reads a byte of it. Unconfined
(``millwheel run``) it reads what the user's own process may.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from millwheel.connectors.files import FilesSource
from millwheel.connectors.spec import ConnectorSpec, SourcePaths
from millwheel.errors import PermissionDeniedError

SECRET = b'{"key": "root", "value": "the secret", "timestamp": 1}\n'


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    """(allowed, secret): an allowed directory with two lines in ``in.jsonl``, and a
    0600 file outside it."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "in.jsonl").write_text("".join(json.dumps({"key": f"k{i}", "value": i, "timestamp": i}) + "\n"
                                              for i in range(2)))
    secret = tmp_path / "private" / "secret.jsonl"
    secret.parent.mkdir()
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    return allowed, secret


def refused(paths: SourcePaths, pattern: str) -> str:
    with pytest.raises(PermissionDeniedError) as err:
        paths.check_pattern(pattern, "injector 'x' source.path")
    text = str(err.value)
    assert "--allow-source-path" in text and repr(pattern) in text, text
    return text


def test_no_directory_allowed_refuses_every_files_source(tree: tuple[Path, Path]) -> None:
    allowed, _secret = tree
    text = refused(SourcePaths(), str(allowed / "in.jsonl"))
    assert "none given" in text


def test_a_path_is_judged_where_it_leads(tree: tuple[Path, Path]) -> None:
    allowed, secret = tree
    paths = SourcePaths.parse([str(allowed)])
    paths.check_pattern(str(allowed / "in.jsonl"), "p")
    paths.check_pattern(str(allowed / "*.jsonl"), "p")
    paths.check_pattern(str(allowed / "sub" / "*" / "x-[0-9].jsonl"), "p")  # need not exist yet
    refused(paths, str(secret))
    refused(paths, f"{allowed}/../private/secret.jsonl")  # traversal
    refused(paths, f"{allowed}/*/../../private/*.jsonl")  # '..' after a wildcard
    refused(paths, "in.jsonl")  # relative: to nothing the client knows
    refused(paths, f"{allowed}*/x.jsonl")  # the fixed part is the allowed directory's parent
    (allowed / "link.jsonl").symlink_to(secret)
    refused(paths, str(allowed / "link.jsonl"))
    (allowed / "door").symlink_to(secret.parent, target_is_directory=True)
    refused(paths, str(allowed / "door" / "*.jsonl"))
    # An allowed directory named through a link is the directory it leads to.
    (tree[0].parent / "alias").symlink_to(allowed, target_is_directory=True)
    SourcePaths.parse([str(tree[0].parent / "alias")]).check_pattern(str(allowed / "in.jsonl"), "p")


def test_a_refusal_says_the_same_whether_the_file_exists(tree: tuple[Path, Path]) -> None:
    allowed, secret = tree
    paths = SourcePaths.parse([str(allowed)])
    missing = secret.parent / "nothing.jsonl"
    there = refused(paths, str(secret)).replace(str(secret), "PATH")
    absent = refused(paths, str(missing)).replace(str(missing), "PATH")
    assert there == absent
    (allowed / "to-secret").symlink_to(secret)
    (allowed / "to-nothing").symlink_to(missing)
    assert refused(paths, str(allowed / "to-secret")).replace("to-secret", "L") == \
        refused(paths, str(allowed / "to-nothing")).replace("to-nothing", "L")
    assert str(secret) not in refused(paths, str(allowed / "to-secret"))  # nor where a link leads
    # A link outside leading in is refused as written, as a file that is not there is:
    # the answer does not tell what is outside.
    (secret.parent / "into").symlink_to(allowed / "in.jsonl")
    assert refused(paths, str(secret.parent / "into")).replace("into", "N") == \
        refused(paths, str(secret.parent / "none")).replace("none", "N")


def test_only_files_sources_are_checked(tree: tuple[Path, Path]) -> None:
    allowed, secret = tree
    paths = SourcePaths.parse([str(allowed)])
    files = ConnectorSpec("files", json.dumps({"type": "files", "path": str(secret)}))
    redis = ConnectorSpec("redis-stream", json.dumps({"type": "redis-stream", "url": "redis://h", "stream": "s"}))
    paths.check_sources([("plain", None), ("pulled", redis)])
    with pytest.raises(PermissionDeniedError, match="injector 'files' source.path"):
        paths.check_sources([("plain", None), ("files", files)])


def source(pattern: str, allowed: Path | None) -> FilesSource:
    src = FilesSource({"path": pattern}, "/")
    if allowed is not None:
        src.confine(SourcePaths.parse([str(allowed)]))
    src.open(None)
    return src


def test_a_confined_source_reads_regular_files_under_its_directory(tree: tuple[Path, Path]) -> None:
    allowed, _secret = tree
    entries = source(str(allowed / "*.jsonl"), allowed).read_batch(10, 0)
    assert [e.fields["key"] for e in entries] == [b"k0", b"k1"]


def test_a_file_swapped_for_a_link_is_not_read(tree: tuple[Path, Path]) -> None:
    allowed, secret = tree
    src = source(str(allowed / "in.jsonl"), allowed)
    assert len(src.read_batch(10, 0)) == 2
    (allowed / "new").symlink_to(secret)
    os.replace(allowed / "new", allowed / "in.jsonl")  # the file is now a link to the secret
    with pytest.raises(PermissionDeniedError, match="not under a directory") as err:
        src.read_batch(10, 0)
    assert str(secret) not in str(err.value)
    # A link leading inside is not followed either (O_NOFOLLOW): regular files only.
    (allowed / "other.jsonl").write_bytes(b'{"key": "o", "value": 1, "timestamp": 1}\n')
    (allowed / "new").symlink_to(allowed / "other.jsonl")
    os.replace(allowed / "new", allowed / "in.jsonl")
    with pytest.raises(PermissionDeniedError, match="is a symbolic link"):
        src.read_batch(10, 0)


def test_a_link_appearing_among_the_matches_fails_the_source(tree: tuple[Path, Path]) -> None:
    allowed, secret = tree
    src = source(str(allowed / "*.jsonl"), allowed)
    assert len(src.read_batch(10, 0)) == 2
    (allowed / "zz.jsonl").symlink_to(secret)
    with pytest.raises(PermissionDeniedError, match="zz.jsonl': is a symbolic link"):
        src.read_batch(10, 0)


def test_a_directory_swapped_for_a_link_is_refused(tree: tuple[Path, Path]) -> None:
    allowed, secret = tree
    feed = allowed / "feed"
    feed.mkdir()
    (feed / "a.jsonl").write_bytes(b'{"key": "a", "value": 1, "timestamp": 1}\n')
    src = source(str(feed / "*.jsonl"), allowed)
    assert len(src.read_batch(10, 0)) == 1
    feed.rename(allowed / "old")
    feed.symlink_to(secret.parent, target_is_directory=True)  # the pattern's own directory now leads out
    with pytest.raises(PermissionDeniedError, match="not under a directory"):
        src.read_batch(10, 0)
    # A wildcard directory leading out: the pattern is named, not what it found there.
    src = source(str(allowed / "*" / "*.jsonl"), allowed)
    with pytest.raises(PermissionDeniedError, match="through a directory that resolves elsewhere") as err:
        src.read_batch(10, 0)
    assert "secret" not in str(err.value)


def test_a_fifo_put_in_a_files_place_does_not_hang_the_reader(tree: tuple[Path, Path]) -> None:
    allowed, _secret = tree
    src = source(str(allowed / "in.jsonl"), allowed)
    assert len(src.read_batch(10, 0)) == 2
    os.remove(allowed / "in.jsonl")
    os.mkfifo(allowed / "in.jsonl")
    src.name = str(allowed / "in.jsonl")  # as if the listing had seen a regular file just before
    with pytest.raises(PermissionDeniedError, match="not a regular file"):
        src._read(10)


def test_a_hard_link_to_a_file_outside_is_not_read(tree: tuple[Path, Path]) -> None:
    """A hard link inside the allowed directory names the secret's own inode: no path
    check can tell, so a file with more than one link is refused, judged on the open
    descriptor, before a byte is read; the ordinary files beside it are read."""
    allowed, secret = tree
    src = source(str(allowed / "*.jsonl"), allowed)
    assert [e.fields["key"] for e in src.read_batch(10, 0)] == [b"k0", b"k1"]  # a normal file: read
    os.link(secret, allowed / "zz.jsonl")
    with pytest.raises(PermissionDeniedError) as err:
        src.read_batch(10, 0)
    text = str(err.value)
    assert "zz.jsonl'" in text and "has 2 hard links" in text and "copy it instead" in text, text
    assert "--allow-source-path" in text and str(secret) not in text and "secret" not in text, text
    assert src.name.endswith("zz.jsonl") and src.offset == 0  # nothing of it consumed
    # From the start: the files before it in one batch are read, then it is refused (a
    # refused file does not hold back what precedes it); alone, and as the `until: end`
    # source's last file: refused the same.
    fresh = source(str(allowed / "*.jsonl"), allowed)
    assert [e.fields["key"] for e in fresh.read_batch(10, 0)] == [b"k0", b"k1"]
    with pytest.raises(PermissionDeniedError, match="has 2 hard links"):
        fresh.read_batch(10, 0)
    with pytest.raises(PermissionDeniedError, match="has 2 hard links"):
        source(str(allowed / "zz.jsonl"), allowed).read_batch(10, 0)
    until_end = FilesSource({"path": str(allowed / "*.jsonl"), "until": "end"}, "/")
    until_end.confine(SourcePaths.parse([str(allowed)]))
    with pytest.raises(PermissionDeniedError, match="has 2 hard links"):
        until_end.open(None)
    # A copy is read; unconfined (`millwheel run`) the link is read as the user's own file.
    os.remove(allowed / "zz.jsonl")
    (allowed / "zz.jsonl").write_bytes(b'{"key": "copy", "value": 1, "timestamp": 1}\n')
    assert [e.fields["key"] for e in src.read_batch(10, 0)] == [b"copy"]
    os.link(secret, allowed / "zzz.jsonl")
    entries = source(str(allowed / "zzz.jsonl"), None).read_batch(10, 0)
    assert [e.fields["value"] for e in entries] == [b"the secret"]


def test_run_unconfined_reads_any_path_the_user_may(tree: tuple[Path, Path]) -> None:
    allowed, secret = tree
    (allowed / "link.jsonl").symlink_to(secret)
    entries = source(str(allowed / "link.jsonl"), None).read_batch(10, 0)
    assert [e.fields["value"] for e in entries] == [b"the secret"]
