"""A shared host: another user's planted links and folders, a filesystem without flock, per-user core locks.

On a cluster's shared scratch space another user can create the folder a victim will name as --out, or files in it.
Each test plants what such a user could, then runs what the victim runs; nothing of the victim's may be written
through a link, and the refusal names what was found. docs/reliability.md has a row for each.
"""
from __future__ import annotations

import errno
import os
import stat

import pytest

from eagle_compat.errors import OutputDirectoryBusy
from eagle_compat.extract import atomic_io, directory_lock, writer

OTHER_UID = 4242  # a user id that is not the test's (the tests run as any user; chown needs root)


def victims_file(tmp_path):
    victim = tmp_path / "victim" / "notes.txt"
    victim.parent.mkdir()
    victim.write_text("the victim's own file\n")
    return victim


@pytest.mark.parametrize("lock", [directory_lock.LOCK_FILE, directory_lock.WRITERS_LOCK])
def test_a_planted_lock_link_is_refused_and_its_target_untouched(tmp_path, lock):
    victim = victims_file(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / lock).symlink_to(victim)
    with pytest.raises(atomic_io.SymlinkRefused, match=r"is a symbolic link .*refusing to follow it"):
        if lock == directory_lock.LOCK_FILE:
            with directory_lock.DirectoryLock(str(out)):
                pass
        else:
            directory_lock.hold_as_writer(str(out))
    assert victim.read_text() == "the victim's own file\n"


def test_the_lock_held_is_the_lock_file_at_its_path(tmp_path, monkeypatch):
    """A lock file removed between its open and its flock is let go and the file at the path locked; a lock file
    removed or replaced while held is named by the holder's check, and the folder's own lock refuses a second run."""
    out = tmp_path / "out"
    out.mkdir()
    real_try_flock, removed = directory_lock.try_flock, []

    def removed_after_open(path, *args, **kwargs):
        fd = real_try_flock(path, *args, **kwargs)
        if not removed:  # another process removes the file this run has just opened and locked
            removed.append(os.fstat(fd).st_ino)
            os.unlink(path)
        return fd
    monkeypatch.setattr(directory_lock, "try_flock", removed_after_open)
    with directory_lock.DirectoryLock(str(out)) as lock:
        held, at_path = os.fstat(lock.fd), os.stat(out / directory_lock.LOCK_FILE)
        assert (held.st_dev, held.st_ino) == (at_path.st_dev, at_path.st_ino) and removed
        directory_lock.check_lock_held(str(out))
        (out / directory_lock.LOCK_FILE).unlink()
        (out / directory_lock.LOCK_FILE).write_text("{}")  # a new file of another run under the name
        with pytest.raises(OutputDirectoryBusy, match="holder unknown"):
            with directory_lock.DirectoryLock(str(out)):
                pass
        with pytest.raises(directory_lock.LockFileRemoved, match=r"was removed or replaced while this run held it"):
            directory_lock.check_lock_held(str(out))
    directory_lock.check_lock_held(str(out))  # released: nothing to check
    with directory_lock.DirectoryLock(str(out)):
        pass


def test_a_temporary_file_is_never_opened_through_a_link(tmp_path, monkeypatch):
    # the temporary name made predictable, a link planted under it: the write is refused, the target untouched
    victim = victims_file(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(writer.os, "urandom", lambda n: b"\0" * n)
    monkeypatch.setattr(directory_lock.socket, "gethostname", lambda: "host")
    target = out / "data_0.pt"
    planted = out / f"data_0.pt.tmp-host-{os.getpid()}-00000000"
    planted.symlink_to(victim)
    with pytest.raises(atomic_io.SymlinkRefused):
        atomic_io.atomic_write_file(str(target), lambda tmp: open(tmp, "w").write("states"))
    assert victim.read_text() == "the victim's own file\n" and not target.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder another user's needs root (chown)")
def test_an_out_folder_of_another_user_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    os.chown(out, OTHER_UID, -1)
    with pytest.raises(writer.OutputDirectoryConflict, match=rf"belongs to another user .*uid {OTHER_UID}"):
        directory_lock.refuse_others_folder(str(out))


def test_an_out_folder_everyone_may_write_is_refused_unless_sticky(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)
    with pytest.raises(writer.OutputDirectoryConflict, match=r"writable by every user \(mode 777\)"):
        directory_lock.refuse_others_folder(str(out))
    out.chmod(0o777 | stat.S_ISVTX)  # /tmp's mode: others cannot replace the files this run makes
    directory_lock.refuse_others_folder(str(out))
    out.chmod(0o755)
    directory_lock.refuse_others_folder(str(out))


def test_extract_refuses_a_planted_out_folder_before_anything_is_written(tmp_path, no_engine):
    from eagle_compat.extract import job
    from eagle_compat import tiny_models

    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)
    data = tmp_path / "data.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    opts = job.ExtractOptions(model=tiny_models.build_tiny_model("llama"), data=str(data), out=str(out),
                              layers=[0, 1], batch_size=1, max_len=16)
    with pytest.raises(writer.OutputDirectoryConflict, match="writable by every user"):
        job.run(opts)
    assert os.listdir(out) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="a file of another user needs root (chown)")
def test_in_a_group_writable_out_only_this_users_files_are_trusted(tmp_path, tiny_llama, fake_engine, capsys):
    """--out its group may write (a team's folder, umask 002) is taken; a file another user put there is never
    taken for this run's: not a sample file (whose index line still matches it), the tokenized input or the record."""
    import shutil

    from eagle_compat.extract import job
    from helpers import extract_options, token_lines

    data = token_lines(tmp_path / "data.jsonl", 12, seed=3)
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o2775)  # its group may write (setgid, no sticky bit): a member can replace any file in it
    assert job.run(extract_options(tiny_llama, data, out))["complete"]
    theirs = tmp_path / "theirs.pt"  # the same bytes, size and time as the file it replaces: only its owner differs
    shutil.copy2(out / "data_1.pt", theirs)
    os.chown(theirs, OTHER_UID, -1)
    os.replace(theirs, out / "data_1.pt")
    with pytest.raises(writer.OutputDirectoryConflict, match=rf"data_1\.pt is not this run's: input line 2: the file "
                                                             rf"belongs to uid {OTHER_UID}, not to this user"):
        job.run(extract_options(tiny_llama, data, out, resume=True))
    (out / "data_1.pt").unlink()
    assert job.run(extract_options(tiny_llama, data, out, resume=True))["written_this_run"] == 4  # its batch
    os.chown(out / writer.SPOOL_FILE, OTHER_UID, -1)
    capsys.readouterr()
    assert job.run(extract_options(tiny_llama, data, out, resume=True))["complete"]
    assert "input read back from" not in capsys.readouterr().err  # tokenized again, and kept as this user's
    assert os.stat(out / writer.SPOOL_FILE).st_uid == os.geteuid()
    os.chown(out / writer.MANIFEST, OTHER_UID, -1)
    with pytest.raises(writer.OutputDirectoryConflict, match=rf"manifest\.json belongs to uid {OTHER_UID}, not to "
                                                             "this user"):
        job.run(extract_options(tiny_llama, data, out, resume=True))


def test_a_filesystem_without_flock_is_named_with_the_way_out(tmp_path, monkeypatch):
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(directory_lock.fcntl, "flock", no_flock)
    with pytest.raises(atomic_io.OutputWriteError,
                       match=r"the filesystem has no flock \(\w+ mounted at /.*Lustre: -o flock"):
        with directory_lock.DirectoryLock(str(tmp_path)):
            pass


def test_locks_that_hold_per_machine_only_are_said_for_shards(monkeypatch):
    monkeypatch.setattr(directory_lock, "mount_of", lambda path: ("/scratch", "lustre", "rw,localflock"))
    assert "does not hold across machines" in directory_lock.lock_scope_note("/scratch/out")
    monkeypatch.setattr(directory_lock, "mount_of", lambda path: ("/scratch", "lustre", "rw,flock"))
    assert directory_lock.lock_scope_note("/scratch/out") is None


def test_core_locks_are_per_user_and_a_planted_folder_is_refused(tmp_path, monkeypatch):
    from eagle_compat.extract import ray_runner
    monkeypatch.setattr(ray_runner, "CORE_LOCKS", str(tmp_path / "cores-{uid}"))
    path = ray_runner.core_locks_dir()
    assert path.endswith(f"cores-{os.geteuid()}") and stat.S_IMODE(os.stat(path).st_mode) == 0o700
    os.rmdir(path)
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", path)  # another user's link where this user's folder goes
    with pytest.raises(writer.OutputDirectoryConflict, match="not a folder of yours"):
        ray_runner.core_locks_dir()


def test_ray_without_an_address_starts_its_own_cluster(monkeypatch):
    """Ray's default address joins the cluster recorded in /tmp/ray/ray_current_cluster (another user's, or a
    stale one); --ray without an address must start a local one, as the help says."""
    import types
    from eagle_compat.extract import ray_runner

    calls = []
    fake = types.SimpleNamespace(
        is_initialized=lambda: False, init=lambda address=None, **kw: calls.append(address),
        get_runtime_context=lambda: types.SimpleNamespace(gcs_address="127.0.0.1:6379"))
    monkeypatch.setattr(ray_runner, "require_ray", lambda: fake)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    _, what = ray_runner.connect(None)
    assert calls == ["local"] and "started by this run" in what
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # never contacted: the stand-in records the call only
    ray_runner.connect(None)
    ray_runner.connect("auto")
    assert calls[1:] == [None, "auto"]


def test_actors_of_an_installed_eagle_compat_keep_their_nodes_packages(monkeypatch):
    from eagle_compat.extract import ray_runner
    monkeypatch.setattr(ray_runner, "PACKAGE_DIR", "/usr/lib/python3/site-packages/eagle_compat")
    assert ray_runner.actor_runtime_env() == {}
    monkeypatch.setattr(ray_runner, "PACKAGE_DIR", "/shared/checkout/src/eagle_compat")
    monkeypatch.setenv("PYTHONPATH", "/opt/x")
    assert ray_runner.actor_runtime_env() == {"env_vars": {"PYTHONPATH": "/shared/checkout/src" + os.pathsep + "/opt/x"}}
