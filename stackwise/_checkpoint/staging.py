"""All-or-nothing writes of a checkpoint folder: claimed, staged, then moved into place.

A save of ``<parent>/<name>`` goes through three steps, shared by both savers
(:mod:`stackwise._checkpoint.save`):

1. **Claim.** The file ``<parent>/<name>.stackwise-lock`` is created exclusively (a complete
   file of the writer's host, pid and start, hard-linked into place: ``os.link`` fails if the
   name exists, even on NFS). A second writer into the same path finds it and raises
   FileExistsError naming the first. A claim whose writer is gone (same host, no such pid)
   is stale: the next writer takes it over. One from another host, or a pid that is alive,
   is never taken over: the message says to remove the file if that writer is gone.
2. **Stage.** Under the claim, the staging folder ``<parent>/<name>.stackwise-tmp`` (an
   interrupted save's leftover cleared first) receives the whole new checkpoint in
   ``new/``. A failure removes the staging folder and the claim: nothing else was touched.
3. **Move into place.** A new ``directory`` (or one that is to be replaced whole) is one
   rename of ``new/`` (what was there moved aside into the staging folder first, then
   removed): a reader sees the old checkpoint or the new one, or, between the two renames,
   none. Into a folder that already exists and holds other files (``save_safetensors``
   beside a ``config.json``), the old checkpoint's files are moved aside first, then the
   new ones moved in one by one, the index last: each rename is atomic, the whole is not,
   but a reader never sees old and new files mixed (it sees the old checkpoint, part of the
   new one, which ``load_checkpoint`` refuses as incomplete, or the new one). A failure
   while moving puts the old files back.

Every rename stays within ``<parent>``, one file system, so each is atomic (``os.replace``).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import time

__all__ = ["Stage"]

_LOCK = ".stackwise-lock"
_TMP = ".stackwise-tmp"


def _move(source: str, destination: str) -> None:
    """One atomic rename (the tests make it fail at the k-th call)."""
    os.replace(source, destination)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _holder(claim: dict) -> str:
    if "pid" not in claim:
        return "a writer whose claim file cannot be read"
    return (f"pid {claim['pid']} on host {claim.get('host')!r}, "
            f"{claim.get('who', 'a writer')}, since {claim.get('since')}")


class Stage:
    """The claim and staging folder of one save of ``directory`` (see the module's steps)."""

    def __init__(self, directory: str, who: str):
        self.directory, self.who = os.path.abspath(directory), who
        parent, name = os.path.split(self.directory)
        self.parent = parent
        self.lock = os.path.join(parent, name + _LOCK)
        self.folder = os.path.join(parent, name + _TMP)
        self.new = os.path.join(self.folder, "new")
        self.made: list[str] = []  # the parents this save created (removed if it fails)
        self.claim = {"host": socket.gethostname(), "pid": os.getpid(), "who": who,
                      "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                      "token": secrets.token_hex(8)}
        self.held = False

    # ---------------------------------------------------------------- the claim

    def take(self) -> None:
        """Claims the directory and makes an empty staging folder; FileExistsError naming
        the writer that holds the claim."""
        missing, path = [], self.parent
        while path and not os.path.exists(path):
            missing.append(path)
            path = os.path.dirname(path)
        if not os.path.isdir(path):
            raise FileExistsError(
                f"{self.who}: cannot make the folder {self.directory}: {path} is a file, not "
                "a folder. Save under a folder."
            )
        os.makedirs(self.parent, exist_ok=True)
        self.made = missing
        for _ in range(3):  # a stale claim taken over, then ours
            if self._link():
                break
            other = self._read(self.lock)
            if other is None:
                continue  # released meanwhile: try again
            if not self._stale(other):
                raise FileExistsError(
                    f"{self.who}: {self.directory} is being written by another save ("
                    f"{_holder(other)}), which claimed it in {self.lock}; two saves into one "
                    "folder would mix their tensors. Save to another directory, or wait for "
                    f"that save to finish. If that writer is gone, remove {self.lock}."
                )
            self._take_over(other)
        else:
            raise FileExistsError(
                f"{self.who}: could not claim {self.directory}: other writers keep claiming "
                f"{self.lock}. Save to another directory."
            )
        self.held = True
        prefix = os.path.basename(self.folder)
        for leftover in os.listdir(self.parent):  # of a save that died before it cleaned up
            path = os.path.join(self.parent, leftover)  # (or an older stackwise's, as
            if leftover.startswith(prefix):  # <name>.stackwise-tmp.partial_save)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        os.mkdir(self.folder)

    def _link(self) -> bool:
        """The claim file, complete, linked to its name if nothing has it: True if so."""
        mine = f"{self.lock}.{self.claim['token']}"
        with open(mine, "w", encoding="utf-8") as f:
            json.dump(self.claim, f)
        try:
            os.link(mine, self.lock)
            return True
        except FileExistsError:
            return False
        finally:
            os.remove(mine)

    @staticmethod
    def _read(path: str) -> dict | None:
        try:
            with open(path, encoding="utf-8") as f:
                claim = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # a claim that cannot be read: never taken for stale
        return claim if isinstance(claim, dict) else {}

    @staticmethod
    def _stale(claim: dict) -> bool:
        """A claim of this host whose process is gone."""
        pid = claim.get("pid")
        return (claim.get("host") == socket.gethostname() and isinstance(pid, int)
                and not _alive(pid))

    def _take_over(self, stale: dict) -> None:
        """Removes a stale claim, unless another writer replaced it meanwhile."""
        aside = f"{self.lock}.{self.claim['token']}.stale"
        try:
            os.rename(self.lock, aside)
        except FileNotFoundError:
            return  # another writer took it over first
        if self._read(aside) == stale:
            os.remove(aside)
            return
        try:  # a fresh claim, moved aside by mistake: put back
            os.link(aside, self.lock)
        except FileExistsError:
            pass
        os.remove(aside)

    def check_held(self) -> None:
        """Raises if our claim is no longer ours (removed by hand, or taken over)."""
        if self._read(self.lock) != self.claim:
            raise FileExistsError(
                f"{self.who}: the claim {self.lock} on {self.directory} was removed or taken "
                "by another writer while this save ran; nothing was moved into place. Save "
                "again once no other save writes there."
            )

    # ---------------------------------------------------------------- moving into place

    def replace_whole(self) -> None:
        """``new/`` becomes ``directory``; what was there (a file, or a folder that is
        replaced whole) moved aside first, and back if the second rename fails."""
        self.check_held()
        if not os.path.lexists(self.directory):
            _move(self.new, self.directory)
            return
        old = os.path.join(self.folder, "old")
        _move(self.directory, old)
        try:
            _move(self.new, self.directory)
        except BaseException:
            _move(old, self.directory)
            raise

    def replace_files(self, files: list[str], old: list[str]) -> None:
        """Files ``new/<f>`` into the existing ``directory``, in order (the index last), the
        old checkpoint's files ``old`` moved aside first; all put back if a move fails."""
        self.check_held()
        aside = os.path.join(self.folder, "old")
        os.mkdir(aside)
        moved_out, moved_in = [], []
        try:
            for f in old:
                _move(os.path.join(self.directory, f), os.path.join(aside, f))
                moved_out.append(f)
            for f in files:
                _move(os.path.join(self.new, f), os.path.join(self.directory, f))
                moved_in.append(f)
        except BaseException:
            for f in reversed(moved_in):
                _move(os.path.join(self.directory, f), os.path.join(self.new, f))
            for f in reversed(moved_out):
                _move(os.path.join(aside, f), os.path.join(self.directory, f))
            raise

    def release(self) -> None:
        """Removes the staging folder (with whatever is in it) and the claim; after a failed
        save, the parent folders it created."""
        if not self.held:
            return
        shutil.rmtree(self.folder, ignore_errors=True)
        if self._read(self.lock) == self.claim:
            os.remove(self.lock)
        self.held = False

    def abandon(self) -> None:
        """After a failure: :meth:`release`, and the parents this save made removed."""
        self.release()
        for path in self.made:  # deepest first; a folder someone else filled is kept
            try:
                os.rmdir(path)
            except OSError:
                break

